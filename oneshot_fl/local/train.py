"""Local training of a client classifier: SGD over the client's shard, progress per epoch."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from oneshot_fl.config import LocalConfig
from oneshot_fl.data.datasets import Split, to_tensor
from oneshot_fl.progress import EpochClock
from oneshot_fl.seeding import derive_seed, seeded_global_rng

log = logging.getLogger(__name__)

# loss(logits, labels) -> scalar; the default is cross-entropy, other local losses plug in here.
LocalLoss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


@dataclass(frozen=True)
class TrainStats:
    epochs: int
    steps: int
    final_loss: float
    train_accuracy: float
    seconds: float


def train_local(model: nn.Module, shard: Split, cfg: LocalConfig, device: torch.device,
                generator: torch.Generator, loss_fn: LocalLoss = cross_entropy_loss,
                label: str = "client") -> TrainStats:
    """Train `model` in place on `shard` for cfg.epochs epochs of SGD (momentum, no schedule)."""
    if len(shard) == 0:
        raise ValueError(f"{label}: empty shard, nothing to train on")
    model.to(device).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay)
    x_all = to_tensor(shard.images)
    y_all = torch.as_tensor(shard.labels, dtype=torch.long)
    n = len(y_all)
    batch = min(cfg.batch_size, n)
    # dropout masks the same in every process; their seed is derived from the generator's, not drawn
    # from it, so the generator's stream (the batch order) stays the same
    with seeded_global_rng(derive_seed(generator.initial_seed(), "global-rng"), device):
        start, steps = time.perf_counter(), 0
        clock = EpochClock(cfg.epochs)
        loss_sum = correct = seen = 0.0
        for epoch in range(1, cfg.epochs + 1):
            order = torch.randperm(n, generator=generator)
            loss_sum = correct = seen = 0.0
            for first in range(0, n, batch):
                idx = order[first:first + batch]
                if len(idx) < 2 and n >= 2:  # a 1-sample batch breaks BatchNorm in train mode
                    continue
                x, y = x_all[idx].to(device, non_blocking=True), y_all[idx].to(device, non_blocking=True)
                logits = model(x)
                loss = loss_fn(logits, y, x)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"{label}: non-finite training loss at epoch {epoch} (lower local.lr)")
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                steps += 1
                loss_sum += loss.item() * len(idx)
                correct += float((logits.argmax(1) == y).sum())
                seen += len(idx)
            log.info("%s: local epoch %d/%d  loss %.4f  train acc %.4f  (%.1fs, %s)", label, epoch, cfg.epochs,
                     loss_sum / max(seen, 1), correct / max(seen, 1), time.perf_counter() - start, clock.eta(epoch))
    return TrainStats(cfg.epochs, steps, loss_sum / max(seen, 1), correct / max(seen, 1),
                      time.perf_counter() - start)


def cap_shard(shard: Split, max_samples: int, seed: int) -> Split:
    """A seeded random subset of at most max_samples (-1 = keep all)."""
    if max_samples < 0 or len(shard) <= max_samples:
        return shard
    rng = np.random.default_rng(seed)
    return shard.subset(np.sort(rng.choice(len(shard), size=max_samples, replace=False)))
