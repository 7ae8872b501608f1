"""Local training of a client classifier: SGD over the client's shard (optionally cropped and flipped),
progress per epoch."""

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
from oneshot_fl.data.augment import crop_flip, crop_flip_params
from oneshot_fl.data.datasets import Split, to_tensor
from oneshot_fl.fastpath import FLOAT32, FastPath, HeldImages
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
                label: str = "client", fast: FastPath = FLOAT32) -> TrainStats:
    """Train `model` in place on `shard` for cfg.epochs epochs of SGD (momentum, no schedule).

    `fast` (oneshot_fl/fastpath.py; off on a CPU): bf16 autocast around the forward (the loss, the optimizer
    and its state stay float32), the shard held on the device as uint8, the model in channels-last layout.
    The loss and accuracy of an epoch are summed on the device and read once per epoch, so no step waits for
    the GPU; a non-finite loss is reported at the end of its epoch."""
    if len(shard) == 0:
        raise ValueError(f"{label}: empty shard, nothing to train on")
    fast.prepare(model.to(device)).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay)
    data_device = device if fast.device_data else torch.device("cpu")
    images = HeldImages(shard.images, device) if fast.device_data else to_tensor(shard.images)
    y_all = torch.as_tensor(shard.labels, dtype=torch.long).to(data_device)
    n = len(y_all)
    batch = min(cfg.batch_size, n)
    # the crops' own stream, derived like the dropout seed below: the batch order is the same with or without them
    crops = torch.Generator().manual_seed(derive_seed(generator.initial_seed(), "augment")) \
        if cfg.augment == "crop-flip" else None
    # dropout masks the same in every process; their seed is derived from the generator's, not drawn
    # from it, so the generator's stream (the batch order) stays the same
    with seeded_global_rng(derive_seed(generator.initial_seed(), "global-rng"), device):
        start, steps = time.perf_counter(), 0
        clock = EpochClock(cfg.epochs)
        loss_sum = correct = seen = 0.0
        for epoch in range(1, cfg.epochs + 1):
            order = torch.randperm(n, generator=generator)
            offsets, flips = crop_flip_params(n, crops) if crops is not None else (None, None)
            if fast.device_data:  # one copy per epoch, not one per step
                order = order.to(device)
                offsets, flips = (offsets.to(device), flips.to(device)) if crops is not None else (None, None)
            # float64 on the device: the same sums as Python floats of the float32 losses, read once per epoch
            loss_total = torch.zeros((), dtype=torch.float64, device=device)
            hits = torch.zeros((), dtype=torch.long, device=device)
            finite = torch.ones((), dtype=torch.bool, device=device)
            seen = 0
            for first in range(0, n, batch):
                idx = order[first:first + batch]
                if len(idx) < 2 and n >= 2:  # a 1-sample batch breaks BatchNorm in train mode
                    continue
                x = images.batch(idx) if fast.device_data else images[idx]
                x, y = x.to(device, non_blocking=True), y_all[idx].to(device, non_blocking=True)
                if crops is not None:
                    x = crop_flip(x, offsets[first:first + batch], flips[first:first + batch])
                with fast.autocast(device):
                    logits = model(x)
                logits = logits.float()
                loss = loss_fn(logits, y, x)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                steps += 1
                finite &= torch.isfinite(loss.detach())
                loss_total += loss.detach().double() * len(idx)
                hits += (logits.argmax(1) == y).sum()
                seen += len(idx)
            if not bool(finite):
                raise FloatingPointError(f"{label}: non-finite training loss at epoch {epoch} (lower local.lr)")
            loss_sum, correct = float(loss_total), float(hits)
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
