"""Training a classifier on a fixed synthetic set (FedMHO knowledge fusion, FedCVAE-Ens server).

Loss per batch (FedMHO Eqs. 5-8, code weights):
  ce_weight * CE(student(x), y)  +  kd_weight * KL(softmax(t / T) || softmax(student(x) / T)) * T^2
with y the decoders' conditioning labels and t precomputed teacher logits (None: CE only). The
data is fixed and never augmented and the teachers are frozen, so their logits are computed once
(`precompute_logits`) instead of once per batch and epoch. Adam; student in train mode (dropout
on); the final-epoch model is returned, the best epoch is only reported.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from oneshot_fl.engine.losses import kd_loss
from oneshot_fl.models.registry import build
from oneshot_fl.progress import EpochClock
from oneshot_fl.seeding import derive_seed, seeded_global_rng

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SupervisedSettings:
    epochs: int
    lr: float
    batch_size: int = 64
    ce_weight: float = 1.0
    kd_weight: float = 0.0
    temperature: float = 1.0
    kd_reduction: str = "mean"
    eval_every: int = 1


@torch.no_grad()
def precompute_logits(teacher: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor,
                      device: torch.device, batch_size: int = 512) -> torch.Tensor:
    """teacher(x) for every image, in batches, kept on the CPU."""
    out = [teacher(images[i:i + batch_size].to(device)).float().cpu() for i in range(0, len(images), batch_size)]
    return torch.cat(out) if out else torch.empty(0)


def train_on_synthetic(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                       teacher_logits: torch.Tensor | None, settings: SupervisedSettings,
                       evaluate: Callable[[nn.Module], float] | None, seed: int,
                       label: str = "fusion") -> list[dict]:
    """Train `model` in place for settings.epochs epochs; returns the per-epoch history.

    Reproducible from `seed`: the batch order has its own generator, and the student's dropout (FedMHO's VGG-9 has
    two Dropout(0.5) layers) draws from torch's global generator, which is seeded from `seed` for the training and
    restored afterwards (unseeded, two replays of one archive ended about a point apart)."""
    if len(labels) == 0:
        raise ValueError(f"{label}: no synthetic samples to train on")
    use_kd = teacher_logits is not None and settings.kd_weight > 0
    if use_kd and teacher_logits.shape[0] != len(labels):
        raise ValueError(f"{label}: {teacher_logits.shape[0]} teacher logits for {len(labels)} samples")
    device = next(model.parameters()).device
    with seeded_global_rng(derive_seed(seed, "dropout"), device):
        return _train(model, images, labels, teacher_logits if use_kd else None, settings, evaluate, seed, label,
                      device)


def _train(model, images, labels, teacher_logits, settings, evaluate, seed, label, device) -> list[dict]:
    use_kd = teacher_logits is not None
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    rng = torch.Generator().manual_seed(seed)
    n, batch = len(labels), min(settings.batch_size, len(labels))
    history, start = [], time.perf_counter()
    clock = EpochClock(settings.epochs)
    for epoch in range(1, settings.epochs + 1):
        model.train()
        order = torch.randperm(n, generator=rng)
        sums = {"ce": 0.0, "kd": 0.0, "loss": 0.0}
        for first in range(0, n, batch):
            idx = order[first:first + batch]
            x, y = images[idx].to(device), labels[idx].to(device)
            logits = model(x)
            ce = F.cross_entropy(logits, y)
            kd = (kd_loss(logits, teacher_logits[idx].to(device), settings.temperature, settings.kd_reduction)
                  if use_kd else logits.new_zeros(()))
            loss = settings.ce_weight * ce + settings.kd_weight * kd
            if not torch.isfinite(loss):
                raise FloatingPointError(f"{label}: non-finite loss at epoch {epoch} (lower the learning rate)")
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            for key, value in (("ce", ce), ("kd", kd), ("loss", loss)):
                sums[key] += float(value.detach()) * len(idx)
        record = {"epoch": epoch, **{k: v / n for k, v in sums.items()}, "accuracy": None,
                  "seconds": time.perf_counter() - start}
        if evaluate is not None and (epoch % settings.eval_every == 0 or epoch == settings.epochs):
            record["accuracy"] = evaluate(model)
        history.append(record)
        acc = f"  test acc {record['accuracy']:.4f}" if record["accuracy"] is not None else ""
        log.info("%s: epoch %d/%d  loss %.4f (ce %.4f, kd %.5f)%s  [%.0fs, %s]", label, epoch, settings.epochs,
                 record["loss"], record["ce"], record["kd"], acc, record["seconds"], clock.eta(epoch))
    return history


# --- how well the decoders' samples carry their classes -------------------------------------------------------
#
# The server of a data-free method holds no training data; the only real images it sees are the central test split
# it evaluates the global model on (a benchmark's yardstick, not part of the method). The sample scorer is fitted on
# a seeded half of that split and only measures the synthetic set: nothing it says reaches the global model (no
# filtering, no selection, no early stopping), so the global model's test accuracy is as unbiased as before. The
# other half of the split gives the scorer's own accuracy on real images it never saw, the bar its scores of the
# synthetic samples are read against. A cnn2 for 3 epochs: seconds on a CPU (MNIST: 5,000 images).

SCORER_ARCH = "cnn2"
SCORER_EPOCHS = 3


def fit_sample_scorer(images: torch.Tensor, labels: torch.Tensor, num_classes: int, seed: int,
                      device: torch.device | str = "cpu") -> tuple[nn.Module, dict]:
    """cnn2 fitted on a seeded half of (images, labels) (real images in [0, 1], NCHW); returns it (eval mode) and a
    description with its accuracy on the other half."""
    n = len(labels)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    fit, held = order[: n // 2], order[n // 2:]
    model = build(SCORER_ARCH, tuple(images.shape[1:]), num_classes, seed=seed).to(device)
    train_on_synthetic(model, images[fit], labels[fit], None,
                       SupervisedSettings(epochs=SCORER_EPOCHS, lr=1e-3, batch_size=64), None, seed, label="scorer")
    model.eval()
    held_out = score_samples(model, images[held], labels[held], num_classes)["accuracy"]
    return model, {"arch": SCORER_ARCH, "epochs": SCORER_EPOCHS, "fitted_on": int(len(fit)),
                   "held_out_accuracy": held_out}


@torch.no_grad()
def score_samples(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, num_classes: int,
                  batch_size: int = 1024) -> dict:
    """The share of (images, labels) that `model` assigns to their labels: overall, and per class (None where the
    class has no sample)."""
    if len(labels) == 0:
        return {"accuracy": None, "per_class": [None] * num_classes}
    device = next(model.parameters()).device
    pred = torch.cat([model(images[i:i + batch_size].to(device)).argmax(1).cpu()
                      for i in range(0, len(labels), batch_size)])
    hit = (pred == labels).float()
    per_class = [round(float(hit[labels == c].mean()), 4) if bool((labels == c).any()) else None
                 for c in range(num_classes)]
    return {"accuracy": round(float(hit.mean()), 4), "per_class": per_class}
