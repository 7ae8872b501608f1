"""benchmarks.ablation: the heterogeneous tuning fleets are their own fleets and groups, and a flip variant poisons
the victim it names on the tuning fleet's uploads."""

from pathlib import Path

from benchmarks import ablation, records


def _teacher(fleet: ablation.Fleet, variant: str, accuracy: float) -> dict:
    return {"table": "ablation", "stage": "teacher", "fleet": fleet.name, "variant": variant,
            "teacher_accuracy": accuracy, "ms_seconds": 10.0, "check_seconds": 1.0, "left_out": [],
            "code_version": "abc1234", "machine": {"processor": "x86_64", "cpus": 2, "gpu": None}}


def test_hetero_fleets_are_named_apart_and_flip_their_own_victim(monkeypatch, tmp_path):
    names = [f.name for f in ablation.fleets()]
    assert len(names) == len(set(names))
    assert {"hetero-mnist-0.1-s100", "hetero-fmnist-0.5-s100-flip-v0", "hetero-fmnist-0.5-s100-flip-v2",
            "mnist-0.1-s0-flip"} <= set(names)
    made = []
    monkeypatch.setattr(ablation, "BENCH_DIR", tmp_path)
    monkeypatch.setattr(ablation, "tuning_uploads", lambda d, c, s: Path(f"/kept/{d}-{c}-s{s}"))
    monkeypatch.setattr(ablation, "train_clients", lambda *a, **k: Path("/kept/paper"))
    monkeypatch.setattr(ablation, "make_variant", lambda honest, poison, victim, out: made.append(
        (honest, poison, victim, out)) or out)
    ablation.Fleet("mnist", "0.1", 100, "flip", hetero=True, victim=2).uploads()
    ablation.Fleet("mnist", "0.1", 0, "flip").uploads()
    assert made == [(Path("/kept/mnist-0.1-s100"), "flip", 2,
                     tmp_path / "runs" / "robustness" / "hetero-mnist-0.1-s100-flip-v2" / "uploads"),
                    (Path("/kept/paper"), "flip", 0, tmp_path / "runs" / "robustness" / "mnist-0.1-s0-flip-v0" /
                     "uploads")]


def test_hetero_fleets_are_averaged_in_their_own_groups(monkeypatch, tmp_path):
    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path)
    hetero = ablation.Fleet("mnist", "0.1", 100, hetero=True)
    flip = ablation.Fleet("fmnist", "0.1", 100, "flip", hetero=True, victim=2)
    honest = ablation.Fleet("mnist", "0.1", 0)
    for fleet, default, without in ((hetero, 0.9275, 0.9441), (flip, 0.5246, 0.4370), (honest, 0.90, 0.90)):
        records.append_record(_teacher(fleet, "default", default))
        records.append_record(_teacher(fleet, "expel", without))
    text = ablation.render(out=tmp_path / "ablation.md").read_text()
    head = next(line for line in text.splitlines() if line.startswith("| variant |"))
    assert head == "| variant | honest | flip | scale10 | hetero honest | hetero flip | MS s | check s |"
    row = next(line for line in text.splitlines() if line.startswith("| expel |"))
    # removing expel: 0.00 on the one-architecture fleet, +1.66 and -8.76 on the heterogeneous ones
    assert row.split(" | ")[1:6] == ["+0.00 (n=1)", "", "", "+1.66 (n=1)", "-8.76 (n=1)"]
    assert "| hetero-mnist-0.1-s100 | 92.75 | " in text
    assert "| (default) | | | | | | 10.0 | 1.0 |" in text  # one empty cell per group, then the seconds


def test_hetero_fleets_get_the_fleet_files_server_settings():
    from launcher.launch import parse_overrides, run_config_items

    sets = ablation.Fleet("fmnist", "0.5", 100, "flip", hetero=True, victim=2).server_sets()
    assert sets["server-model"] == "resnet8" and sets["threads"] == 1
    assert "client-models" not in sets  # the archive fixes the clients
    assert ablation.Fleet("mnist", "0.1", 0).server_sets() == {}
    # as replay_pass hands them to replay: each value comes back as it was
    assert parse_overrides(run_config_items(sets)) == sets


def test_the_teacher_stage_runs_every_teacher_variant_on_a_fleet(monkeypatch, tmp_path, mnist_dir):
    """The teacher stage end to end on a tiny in-process fleet (3 cnn2 clients, 64 images each): one record per
    teacher variant, and the seconds each variant must spend or skip (uniform U: no MS, no check; no expel: no
    check). It reads only what the engine computes now (a variant reading a retired field fails here)."""
    from benchmarks.inprocess_fleet import cached_uploads
    from oneshot_fl.config import from_run_config, merge_overrides

    cfg = from_run_config(merge_overrides({"dataset": "mnist", "partition": "niid-bench", "alpha": 0.5,
                                           "num-clients": 3, "preset": "smoke", "local.max-samples": 64,
                                           "data-dir": str(mnist_dir), "threads": 1, "eval.test-samples": 200}))
    archive = tmp_path / "uploads"
    cached_uploads(archive, cfg, [(pid, "classifier", "cnn2") for pid in range(3)])
    fleet = ablation.Fleet("mnist", "0.5", 100)
    monkeypatch.setattr(ablation.Fleet, "uploads", lambda self: archive)
    monkeypatch.setattr(ablation.Fleet, "server_sets", lambda self: {"fedhydra.ms-steps": 2})
    monkeypatch.setattr(ablation, "code_version", lambda: "test")
    rows = {row["variant"]: row for row in ablation.teacher_pass(fleet)}
    assert tuple(rows) == ablation.TEACHER_VARIANTS == ("default", "ms", "prob-auc", "expel", "calibrated",
                                                        "class-route", "running")
    assert all(0.0 <= row["teacher_accuracy"] <= 1.0 and row["clients"] == [0, 1, 2] for row in rows.values())
    assert rows["ms"]["ms_seconds"] == 0.0 and rows["ms"]["check_seconds"] == 0.0
    assert rows["expel"]["check_seconds"] == 0.0 and rows["expel"]["ms_seconds"] > 0.0
    assert rows["default"]["check_seconds"] > 0.0
