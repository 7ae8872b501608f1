"""benchmarks/ms_growth.py: the plateau stop replayed on recorded MS curves, against hand-computed stops."""

import argparse

import pytest
import torch

from benchmarks.ms_growth import fleet_arg, plateau_stop


def test_plateau_stop_stops_where_the_probability_stalls_and_pads_with_that_loss():
    # pair (0, 0) ran all 6 steps: p = exp(-L) = .0498, .1353, .1496, .1511, .1513, .1513
    # t=2: p2 - p0 = .0998, t=3: p3 - p1 = .0158 (both >= .01); t=4: p4 - p2 = .0017 < .01 -> stop at 4
    slow = [3.0, 2.0, 1.9, 1.89, 1.889, 1.5]
    # pair (0, 1) was convinced at step 2 (padded from there): the rule leaves it alone
    convinced = [2.0, 0.5, 0.005, 0.005, 0.005, 0.005]
    # pair (1, 0) keeps rising by more than .01 per 2 steps: runs to the end
    rising = [4.0, 3.0, 2.5, 2.0, 1.5, 1.0]
    losses = torch.tensor([[slow, convinced], [rising, rising]])
    steps_run = torch.tensor([[6, 2], [6, 6]])
    out, steps = plateau_stop(losses, steps_run, window=2, rise=0.01)
    assert steps.tolist() == [[4, 2], [6, 6]]
    assert out[0, 0].tolist() == pytest.approx([3.0, 2.0, 1.9, 1.89, 1.889, 1.889])
    assert torch.equal(out[0, 1], losses[0, 1]) and torch.equal(out[1], losses[1])
    assert torch.equal(losses[0, 0, 5], torch.tensor(1.5))  # the input curves are not modified


def test_fleet_argument_is_k_colon_seed():
    assert fleet_arg("20:2") == (20, 2)
    with pytest.raises(argparse.ArgumentTypeError, match="K:seed"):
        fleet_arg("20")


def test_report_puts_each_fleet_beside_the_smallest(tmp_path, monkeypatch):
    from benchmarks import ms_growth

    monkeypatch.setattr(ms_growth, "REPORT", tmp_path / "ms_growth.md")

    def fleet(k, seconds, steps, never):
        plateau = [{"window": w, "rise": r, "steps_left": left, "max_du": 0.01, "max_du_r": 0.001,
                    "same_top_client": 1.0} for (w, r), left in zip(ms_growth.PLATEAU_RULES, (0.9, 0.8, 0.7))]
        return {"k": k, "seed": 0, "pairs": 10 * k, "t_g": 30, "ms_batch": 16, "seconds": seconds,
                "generator_steps": steps, "steps_per_pair": steps / (10 * k), "never_convinced": never,
                "ms_per_step": 1000 * seconds / steps, "plateau": plateau}

    record = {"code_version": "abc1234", "machine": {}, "date": "2026-01-01",
              "fleets": [fleet(20, 80.0, 4000, 0.5), fleet(5, 10.0, 500, 0.25)]}
    text = ms_growth.render([record]).read_text()
    rows = [line for line in text.splitlines() if line.startswith(("| 5 |", "| 20 |"))][:2]
    # K = 20: 8x the seconds and 8x the steps of K = 5 (4000 / 500) for 4x the clients, 20 steps per pair
    assert rows == ["| 5 | 0 | 50 | 10.0 | 1.00x (K ratio 1x) | 500 | 1.00x | 10.0 | 25% | 20.0 |",
                    "| 20 | 0 | 200 | 80.0 | 8.00x (K ratio 4x) | 4,000 | 8.00x | 20.0 | 50% | 20.0 |"]
    assert "8.0x from K = 5 to K = 20 for 4x the clients" in text
    assert "leaves 80-80% of the steps" in text
