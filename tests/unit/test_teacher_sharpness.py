"""experiments.teacher_sharpness: the statistics of one teacher's logits, by hand."""

import math

import pytest
import torch

from experiments.teacher_sharpness import server_config, teacher_stats
from oneshot_fl.config import default_run_config, from_run_config, merge_overrides
from oneshot_fl.errors import ConfigError


def test_teacher_stats_by_hand():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    labels = torch.tensor([1, 0])  # the first row's argmax is class 0: one of two right
    s = teacher_stats(logits, labels, temperature=1.0)
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert s["accuracy"] == pytest.approx(0.5)
    assert s["entropy"] == pytest.approx((math.log(2.0) + h) / 2)
    assert s["top_probability"] == pytest.approx((0.5 + 0.75) / 2)
    assert s["logit_spread"] == pytest.approx((0.0 + math.log(3.0) / math.sqrt(2.0)) / 2)
    # temperature 0.5 doubles the logits: the second row becomes 9:1
    sharp = teacher_stats(logits, labels, temperature=0.5)
    assert sharp["top_probability"] == pytest.approx((0.5 + 0.9) / 2)
    assert sharp["accuracy"] == s["accuracy"] and sharp["logit_spread"] == s["logit_spread"]


def test_a_replays_archive_gives_the_run_config_it_was_served_with(tmp_path):
    archived = {**default_run_config(), "method": "fedhydra", "dataset": "fmnist", "seed": 7,
                "data-dir": "/elsewhere", "replayed-from": "/runs/fleet/uploads"}
    with pytest.raises(ConfigError, match="replayed-from"):  # what the archive's keys alone would meet
        from_run_config(merge_overrides(archived))
    cfg = server_config(archived, str(tmp_path))
    assert (cfg.method, cfg.dataset, cfg.seed, cfg.flat["data-dir"]) == ("fedhydra", "fmnist", 7, str(tmp_path))
    assert "replayed-from" not in cfg.flat and server_config(archived).flat["data-dir"] == "/elsewhere"
