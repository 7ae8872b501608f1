"""Local training of a resource-constrained client's CVAE (FedMHO Sec. 4.2.1, Eq. 3; Table III for epochs and LR).

Adam on the negative ELBO (BCE summed over pixels + KL weight x KL, averaged over the batch);
the label is the condition. Only the decoder leaves the client (client_app/task.py). A DP client
(local.dp.epsilon > 0) trains the same CVAE with DP-SGD (train_private_cvae), by default at its own Adam
learning rate and batch (oneshot_fl.config.PRIVATE_CVAE; the settings are resolved by
oneshot_fl.config.resolve_cvae_settings).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from oneshot_fl.config import CVAESettings, DPConfig
from oneshot_fl.data.datasets import Split, to_tensor
from oneshot_fl.local.dp import PrivateTraining, dp_sgd
from oneshot_fl.models.cvae import CVAE, elbo_loss, elbo_per_example
from oneshot_fl.progress import EpochClock

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class CVAEStats:
    epochs: int
    steps: int
    final_loss: float  # negative ELBO per sample, last epoch
    final_recon: float
    final_kl: float
    seconds: float


def train_cvae(model: CVAE, shard: Split, settings: CVAESettings, device: torch.device,
               generator: torch.Generator, label: str = "client") -> CVAEStats:
    """Train `model` in place on `shard` (labels as the condition)."""
    if len(shard) == 0:
        raise ValueError(f"{label}: empty shard, nothing to train on")
    model.to(device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    x_all = to_tensor(shard.images)
    y_all = torch.as_tensor(shard.labels, dtype=torch.long)
    n = len(y_all)
    batch = min(settings.batch_size, n)
    start, steps = time.perf_counter(), 0
    sums = {"loss": 0.0, "recon": 0.0, "kl": 0.0}
    clock = EpochClock(settings.epochs)
    for epoch in range(1, settings.epochs + 1):
        order = torch.randperm(n, generator=generator)
        sums = {"loss": 0.0, "recon": 0.0, "kl": 0.0}
        for first in range(0, n, batch):
            idx = order[first:first + batch]
            x, y = x_all[idx].to(device), y_all[idx].to(device)
            recon, mu, logvar = model(x, y, generator=generator)
            loss, bce, kld = elbo_loss(recon, x, mu, logvar, settings.kl_weight)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"{label}: non-finite CVAE loss at epoch {epoch} (lower cvae.lr)")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            steps += 1
            for key, value in (("loss", loss), ("recon", bce), ("kl", kld)):
                sums[key] += float(value.detach()) * len(idx)
        log.info("%s: CVAE epoch %d/%d  -ELBO %.2f (recon %.2f, KL %.2f)  (%.1fs, %s)", label, epoch,
                 settings.epochs, sums["loss"] / n, sums["recon"] / n, sums["kl"] / n, time.perf_counter() - start,
                 clock.eta(epoch))
    return CVAEStats(settings.epochs, steps, sums["loss"] / n, sums["recon"] / n, sums["kl"] / n,
                     time.perf_counter() - start)


def train_private_cvae(model: CVAE, shard: Split, settings: CVAESettings, dp: DPConfig, counts,
                       device: torch.device, label: str = "client", **generators) -> PrivateTraining:
    """A DP decoder client: the whole CVAE (encoder and decoder: both read the examples) trained with DP-SGD on
    the same negative ELBO, Adam at the setting's lr, its epochs as passes of the expected batch; the decoder
    the client uploads is part of that model (post-processing, no further cost), and its label histogram is
    released inside the same budget (oneshot_fl.local.dp)."""

    def elbo(private: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, None]:
        recon, mu, logvar = private(x, y)
        return elbo_per_example(recon, x, mu, logvar, settings.kl_weight)[0], None

    return dp_sgd(model, shard, dp, counts, device, optimizer=lambda params: torch.optim.Adam(params, lr=settings.lr),
                  batch_size=settings.batch_size, epochs=settings.epochs, loss_of=elbo, label=label, **generators)
