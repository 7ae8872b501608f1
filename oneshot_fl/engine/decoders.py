"""Synthetic data from uploaded CVAE decoders (FedMHO stage 1 and section 4.4; FedCVAE-Ens).

Three steps, each a plain function:
  plan      how many samples of each class every decoder draws, from the uploaded label counts
              squared    FedMHO code: floor(N / C) per class; decoder k's share of class p is
                         n_kp^2 / sum_j n_jp^2; a class no decoder holds goes to all decoders
                         equally ("uniform") or is left out ("skip")
              histogram  FedCVAE-Ens: decoder k draws N * n_k / sum_j n_j samples, its classes in
                         the proportions of its own histogram
  generate  z ~ N(0, I), x = decoder(z, one-hot(p)) (the Sigmoid mean, no Bernoulli draw), seeded
  filter    per class, keep the R_th fraction nearest (Euclidean, raw pixels) to the class mean
            (k-means with k = 1 is just the mean)
Splitting an integer quota by shares uses largest remainders ("exact": the parts sum to the
quota) or plain floors ("floor": the FedMHO code, a few samples short of the quota).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from oneshot_fl.models.cvae import Decoder

SCHEMES = ("squared", "histogram")
ABSENT_POLICIES = ("uniform", "skip")
ROUNDINGS = ("exact", "floor")


def split_quota(quota: int, weights: np.ndarray, rounding: str = "exact") -> np.ndarray:
    """Integer parts of `quota` proportional to `weights` (non-negative, positive sum)."""
    weights = np.asarray(weights, dtype=np.float64)
    if quota < 0 or (weights < 0).any() or weights.sum() <= 0:
        raise ValueError(f"cannot split {quota} by weights {weights.tolist()}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding {rounding!r}: use {' or '.join(ROUNDINGS)}")
    exact = quota * weights / weights.sum()
    parts = np.floor(exact + 1e-9).astype(np.int64)
    if rounding == "exact":
        short = quota - int(parts.sum())
        order = np.argsort(-(exact - parts), kind="stable")  # largest remainder first, ties by index
        parts[order[:short]] += 1
    return parts


def squared_plan(counts: np.ndarray, total: int, absent: str = "uniform", rounding: str = "exact") -> np.ndarray:
    """(k, C) samples per decoder and class: balanced classes, shares proportional to counts squared."""
    counts = _check_counts(counts)
    if absent not in ABSENT_POLICIES:
        raise ValueError(f"absent-class policy {absent!r}: use {' or '.join(ABSENT_POLICIES)}")
    k, num_classes = counts.shape
    per_class = total // num_classes
    plan = np.zeros((k, num_classes), dtype=np.int64)
    for p in range(num_classes):
        squares = counts[:, p].astype(np.float64) ** 2
        if squares.sum() == 0:
            if absent == "skip":
                continue
            squares = np.ones(k)  # FedMHO code: uniform weights when no decoder holds the class
        plan[:, p] = split_quota(per_class, squares, rounding)
    return plan


def histogram_plan(counts: np.ndarray, total: int, rounding: str = "exact") -> np.ndarray:
    """(k, C) samples per decoder and class: decoder totals by data size, classes by its own histogram."""
    counts = _check_counts(counts)
    plan = np.zeros_like(counts)
    for k, per_decoder in enumerate(split_quota(total, counts.sum(axis=1), rounding)):
        plan[k] = split_quota(int(per_decoder), counts[k], rounding)
    return plan


def make_plan(scheme: str, counts: np.ndarray, total: int, absent: str = "uniform",
              rounding: str = "exact") -> np.ndarray:
    if scheme == "squared":
        return squared_plan(counts, total, absent, rounding)
    if scheme == "histogram":
        return histogram_plan(counts, total, rounding)
    raise ValueError(f"sampling scheme {scheme!r}: use {' or '.join(SCHEMES)}")


def _check_counts(counts: np.ndarray) -> np.ndarray:
    counts = np.asarray(counts)
    if counts.ndim != 2 or counts.shape[0] == 0 or counts.dtype.kind not in "iu" or (counts < 0).any():
        raise ValueError("label counts must be a non-empty (decoders, classes) array of non-negative integers")
    return counts.astype(np.int64)


@dataclass
class SyntheticSet:
    images: torch.Tensor  # float (n, C, H, W) in [0, 1], on the CPU
    labels: torch.Tensor  # long (n,)
    sources: torch.Tensor  # long (n,): index of the decoder that drew each sample

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, index: torch.Tensor) -> "SyntheticSet":
        return SyntheticSet(self.images[index], self.labels[index], self.sources[index])


@torch.no_grad()
def generate(decoders: Sequence[Decoder], plan: np.ndarray, seed: int, device: torch.device,
             batch_size: int = 1024) -> SyntheticSet:
    """Draw plan[k, p] samples of class p from decoder k; z from one seeded stream per decoder."""
    if len(decoders) != plan.shape[0]:
        raise ValueError(f"{len(decoders)} decoders but a plan for {plan.shape[0]}")
    images, labels, sources = [], [], []
    for k, decoder in enumerate(decoders):
        decoder.to(device).eval()
        wanted = torch.repeat_interleave(torch.arange(plan.shape[1]), torch.as_tensor(plan[k]))
        # all of this decoder's z in one draw: the samples do not depend on the batch size
        z_all = torch.randn(len(wanted), decoder.latent_dim, generator=torch.Generator().manual_seed(seed + k))
        for first in range(0, len(wanted), batch_size):
            y = wanted[first:first + batch_size]
            images.append(decoder(z_all[first:first + batch_size].to(device), y.to(device)).float().cpu())
            labels.append(y)
            sources.append(torch.full_like(y, k))
    if not labels:
        return SyntheticSet(torch.empty(0), torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
    return SyntheticSet(torch.cat(images), torch.cat(labels), torch.cat(sources))


def nearest_to_class_mean(images: torch.Tensor, labels: torch.Tensor, keep_ratio: float) -> torch.Tensor:
    """Indices (sorted) of the int(keep_ratio * n_c) samples of each class c nearest to its mean
    image (FedMHO Alg. 2: k-means with one cluster on raw pixels, Euclidean distance)."""
    if not 0.0 < keep_ratio <= 1.0:
        raise ValueError(f"keep ratio {keep_ratio} must be in (0, 1]")
    kept = []
    for c in torch.unique(labels):
        idx = torch.nonzero(labels == c).squeeze(1)
        flat = images[idx].flatten(1).double()
        distance = (flat - flat.mean(dim=0, keepdim=True)).norm(dim=1)
        keep = int(keep_ratio * len(idx) + 1e-9)
        kept.append(idx[torch.argsort(distance, stable=True)[:keep]])
    return torch.sort(torch.cat(kept)).values if kept else torch.empty(0, dtype=torch.long)


class DecoderSynthesizer:
    """The uploaded decoders as one data source: plan from their label counts, draw, filter."""

    def __init__(self, decoders: Sequence[Decoder], label_counts: np.ndarray, total: int, scheme: str = "squared",
                 absent: str = "uniform", rounding: str = "exact", keep_ratio: float = 0.8, seed: int = 0,
                 device: torch.device | str = "cpu"):
        self.decoders = list(decoders)
        self.plan = make_plan(scheme, label_counts, total, absent, rounding)
        self.keep_ratio, self.seed, self.device = keep_ratio, seed, torch.device(device)

    def draw(self) -> SyntheticSet:
        return generate(self.decoders, self.plan, self.seed, self.device)

    def keep(self, drawn: SyntheticSet) -> torch.Tensor:
        """Indices (sorted) of the drawn samples the filter keeps: each class's keep_ratio nearest to its mean."""
        return nearest_to_class_mean(drawn.images, drawn.labels, self.keep_ratio)

    def filter(self, drawn: SyntheticSet) -> tuple[SyntheticSet, SyntheticSet]:
        """(kept, dropped) samples of a draw."""
        kept = self.keep(drawn)
        mask = torch.ones(len(drawn), dtype=torch.bool)
        mask[kept] = False
        return drawn.subset(kept), drawn.subset(torch.nonzero(mask).squeeze(1))

    def synthesize(self) -> tuple[SyntheticSet, SyntheticSet]:
        """(kept, dropped) synthetic samples."""
        return self.filter(self.draw())


def spread_by_source(synthetic: SyntheticSet, per_class: int) -> torch.Tensor:
    """Indices of up to `per_class` samples of each class, taken in turn from every decoder that drew the class
    (decoder a, b, c, a, b, c, ...), so that a picture of the first few per class shows each decoder's work."""
    picked = []
    for c in torch.unique(synthetic.labels).tolist():
        of_class = torch.nonzero(synthetic.labels == c).squeeze(1)
        queues = [of_class[synthetic.sources[of_class] == k].tolist()
                  for k in torch.unique(synthetic.sources[of_class]).tolist()]
        taken: list[int] = []
        while len(taken) < per_class and any(queues):
            for queue in queues:
                if queue and len(taken) < per_class:
                    taken.append(queue.pop(0))
        picked += taken
    return torch.as_tensor(picked, dtype=torch.long)
