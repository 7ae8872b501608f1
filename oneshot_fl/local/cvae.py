"""Local training of a resource-constrained client's CVAE (FedMHO Sec. 4.2.1, Eq. 3; Table III for epochs and LR).

Adam on the negative ELBO (BCE summed over pixels + KL weight x KL, averaged over the batch);
the label is the condition. Only the decoder leaves the client (client_app/task.py). A DP client
(local.dp.epsilon > 0) trains the same CVAE with DP-SGD (train_private_cvae), by default at its own Adam
learning rate and batch (PRIVATE_CVAE).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from oneshot_fl.config import CVAEConfig, DPConfig
from oneshot_fl.data.datasets import Split, to_tensor
from oneshot_fl.local.dp import PrivateTraining, dp_sgd
from oneshot_fl.models.cvae import CVAE, default_cvae_arch, elbo_loss, elbo_per_example, resolve_latent_dim
from oneshot_fl.progress import EpochClock

log = logging.getLogger(__name__)

# FedMHO Table III / section 5.1.4 (CVAE-small): local epochs and Adam learning rate per dataset.
# CIFAR-10 is not in the paper; it gets SVHN's values.
PAPER_CVAE = {
    "mnist": {"epochs": 30, "lr": 5e-2},
    "fmnist": {"epochs": 40, "lr": 5e-2},
    "svhn": {"epochs": 40, "lr": 1e-3},
    "cifar10": {"epochs": 40, "lr": 1e-3},
}
LARGE_CVAE_LR = 1e-3  # CVAE-large (FEDCVAE baseline), FedMHO code worker_lmf.py
PAPER_BATCH = 64  # the FedMHO code's CVAE batch
# A DP decoder client (DP-SGD on the whole CVAE): FedMHO's Adam 5e-2 at batch 64 diverges under the noise, and the
# decoders draw their classes better the larger the batch (the noise std on the mean gradient is sigma * C / batch,
# and sigma grows far slower than the batch at a fixed epsilon; Abadi et al., "Deep Learning with Differential
# Privacy", Sec. 5). Chosen on tuning decoders (MNIST NIID-Bench 0.5, seed 100, cvae-mlp, epsilon 8: a real-data
# classifier's accuracy on their samples, count-weighted, 19.7 % at FedMHO's recipe, 81.4 at batch 512, 91.9 at
# 2048, 95.3 here; 99.4 without DP): a batch near a client's whole shard.
PRIVATE_CVAE = {"lr": 4e-2, "batch_size": 4096}


@dataclass(frozen=True)
class CVAESettings:
    """CVAEConfig with every "paper default" resolved for one dataset."""

    arch: str
    latent_dim: int
    kl_weight: float
    epochs: int
    lr: float
    batch_size: int


def resolve_cvae_settings(cfg: CVAEConfig, dataset: str, input_shape: tuple[int, int, int],
                          private: bool = False) -> CVAESettings:
    """The CVAE settings of a decoder client: cfg's, its 0 / -1 placeholders as the paper's (`private`: a DP
    client's lr and batch from PRIVATE_CVAE, the paper's epochs)."""
    arch = cfg.arch or default_cvae_arch(input_shape)
    paper = PAPER_CVAE[dataset]
    if private:
        lr, batch = cfg.lr or PRIVATE_CVAE["lr"], cfg.batch_size or PRIVATE_CVAE["batch_size"]
    else:
        lr, batch = cfg.lr or (LARGE_CVAE_LR if arch == "cvae-large" else paper["lr"]), cfg.batch_size or PAPER_BATCH
    epochs = cfg.epochs if cfg.epochs > 0 else paper["epochs"]
    return CVAESettings(arch, resolve_latent_dim(arch, cfg.latent_dim), cfg.kl_weight, epochs, lr, batch)


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
