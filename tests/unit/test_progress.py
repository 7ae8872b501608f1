"""Epoch log lines carry e/E and an ETA from the mean epoch time."""

from __future__ import annotations

import logging

import numpy as np

from oneshot_fl import progress
from oneshot_fl.progress import EpochClock, format_seconds


def test_format_seconds():
    assert format_seconds(0) == "00:00"
    assert format_seconds(65.4) == "01:05"
    assert format_seconds(3600 + 61) == "1:01:01"


def test_eta_is_the_mean_epoch_time_times_the_epochs_left(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(progress.time, "perf_counter", lambda: now[0])
    clock = EpochClock(total=10)
    now[0] += 30.0  # epochs 1..3 took 30 s
    assert clock.eta(3) == "ETA 01:10"
    assert clock.eta(10) == "ETA 00:00"
    resumed = EpochClock(total=10, first=6)  # a resumed loop: only the epochs run here count
    now[0] += 20.0
    assert resumed.eta(7) == "ETA 00:30"


def test_local_training_logs_epoch_totals_and_eta(caplog):
    import torch

    from oneshot_fl.config import LocalConfig
    from oneshot_fl.data.datasets import Split
    from oneshot_fl.local.train import train_local
    from oneshot_fl.models.registry import build

    rng = np.random.default_rng(0)
    shard = Split(images=rng.integers(0, 255, (16, 28, 28, 1), dtype=np.uint8), labels=rng.integers(0, 10, 16))
    cfg = LocalConfig(epochs=2, batch_size=8)
    model = build("cnn2", (1, 28, 28), 10, seed=0)
    with caplog.at_level(logging.INFO, logger="oneshot_fl.local.train"):
        train_local(model, shard, cfg, torch.device("cpu"), torch.Generator().manual_seed(0), label="c")
    lines = [r.getMessage() for r in caplog.records if "local epoch" in r.getMessage()]
    assert len(lines) == 2 and "local epoch 1/2" in lines[0] and "ETA " in lines[0]
    assert lines[1].rstrip(")").endswith("ETA 00:00")


def test_a_model_with_dropout_trains_the_same_whatever_the_process_global_rng_holds():
    """Dropout draws from torch's global RNG: local training seeds it from the client's generator (and puts it
    back), so a GoogLeNet or VGG client trains the same in every process and the caller's RNG is untouched."""
    import torch

    from oneshot_fl.config import LocalConfig
    from oneshot_fl.data.datasets import Split
    from oneshot_fl.local.train import train_local
    from oneshot_fl.models.registry import build

    rng = np.random.default_rng(0)
    shard = Split(images=rng.integers(0, 255, (16, 28, 28, 1), dtype=np.uint8), labels=rng.integers(0, 10, 16))
    weights = []
    for other_state in (1, 2):
        torch.manual_seed(other_state)  # whatever ran in this process before
        before = torch.random.get_rng_state()
        model = build("vgg9-small", (1, 28, 28), 10, seed=0)
        train_local(model, shard, LocalConfig(epochs=2, batch_size=8, lr=0.05), torch.device("cpu"),
                    torch.Generator().manual_seed(7), label="c")
        assert torch.equal(torch.random.get_rng_state(), before)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(weights[0], weights[1])
