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
