"""experiments.memory_format: both formats time the same model, and the report shows each step's ratio."""

from experiments import memory_format


def test_both_formats_hold_the_same_weights():
    row = memory_format.measure("cnn2", (1, 28, 28), 8, reps=1)
    # the same seeded weights in two layouts: logits agree to float rounding (another init would differ by ~0.1)
    assert row["max_abs_logit_diff"] < 1e-5
    for step in ("train", "inference", "synthesis"):
        s = row[step]
        assert s["nchw_ms"] > 0 and s["channels_last_ms"] > 0
        # the ratio is taken before the times are rounded to 0.01 ms: allow that rounding and the ratio's own
        ratio = s["nchw_ms"] / s["channels_last_ms"]
        rounding = ratio * (0.005 / s["nchw_ms"] + 0.005 / s["channels_last_ms"]) + 0.0005
        assert abs(s["speedup"] - ratio) <= rounding + 1e-9


def test_report_row():
    step = {"nchw_ms": 30.0, "channels_last_ms": 20.0, "speedup": 1.5}
    record = {"code_version": "abc1234", "date": "2026-11-27", "machine": {"cpus": 2}, "torch": "2",
              "rows": [{"arch": "googlenet", "input": [3, 32, 32], "batch": 32, "max_abs_logit_diff": 1e-6,
                        "train": step, "inference": step, "synthesis": step}]}
    text = memory_format.render([record])
    assert "## abc1234, 2026-11-27" in text
    cells = " | ".join(["30.0 / 20.0 | 1.50x"] * 3)
    assert f"| googlenet | 3x32x32 | 32 | {cells} | 1.0e-06 |" in text
