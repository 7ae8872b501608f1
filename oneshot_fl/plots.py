"""Plots written into the run folder (headless matplotlib)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence

import numpy as np
import torch


@functools.cache
def _pyplot():
    """matplotlib.pyplot on the headless Agg backend, imported (and the backend set) once, at the first
    plot: importing it costs ~0.7 s of CPU, which processes that never plot (the launcher validating a
    config) should not pay."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


class _Pyplot:
    def __getattr__(self, name):
        return getattr(_pyplot(), name)


plt = _Pyplot()


def label_distribution(counts: np.ndarray, path: Path, title: str) -> None:
    """Per-client label histograms (as uploaded), drawn by flwr-datasets' visualisation."""
    _pyplot()  # the Agg backend before flwr-datasets imports pyplot
    from flwr_datasets.visualization import plot_label_distributions

    from oneshot_fl.data.partition import ReportedCountsPartitioner

    fig, _, _ = plot_label_distributions(
        ReportedCountsPartitioner(counts), label_name="label", plot_type="bar", size_unit="absolute",
        partition_id_axis="x", legend=True, title=title,
    )
    fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)


def accuracy_curve(history: Sequence[dict], path: Path, title: str, reference: dict[str, float] | None = None) -> None:
    """Test accuracy of the global model per distillation epoch (+ horizontal reference lines)."""
    points = [(h["epoch"], h["accuracy"]) for h in history if h.get("accuracy") is not None]
    if not points:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*points), marker="o", ms=3, label="global model")
    for name, value in (reference or {}).items():
        if value is not None:
            ax.axhline(value, ls="--", lw=1, color="grey" if "client" in name else "tab:red", label=name)
    ax.set_xlabel("distillation epoch")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)


def client_accuracies(names: list[str], accuracies: list[float], global_accuracy: float | None,
                      path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(names) + 2), 3.5))
    ax.bar(range(len(names)), accuracies, color="tab:blue")
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right", fontsize=8)
    if global_accuracy is not None:
        ax.axhline(global_accuracy, color="tab:red", ls="--", label=f"global {global_accuracy:.3f}")
        ax.legend(fontsize=8)
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=10)
    fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)


def heatmap(matrix: np.ndarray, path: Path, title: str, xlabel: str, ylabel: str) -> None:
    """Annotated heat map, e.g. FedHydra's U_r / U_c (classes x clients, the paper's Fig. 5b)."""
    rows, cols = matrix.shape
    fig, ax = plt.subplots(figsize=(1.0 + 0.7 * cols, 1.0 + 0.45 * rows))
    im = ax.imshow(matrix, cmap="viridis", aspect="auto", vmin=0)
    for i in range(rows):
        for j in range(cols):
            if rows * cols <= 400:
                ax.text(j, i, f"{matrix[i, j]:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if matrix[i, j] < 0.5 * matrix.max() else "black")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax)
    fig.savefig(path, bbox_inches="tight", dpi=120)
    plt.close(fig)


def sample_grid(images: torch.Tensor, labels: torch.Tensor, num_classes: int, path: Path, per_class: int = 8) -> None:
    """A grid of synthetic samples: one row per class (images in [0, 1], NCHW)."""
    from torchvision.utils import save_image

    rows = []
    for c in range(num_classes):
        picked = images[labels == c][:per_class]
        pad = torch.zeros(per_class - len(picked), *images.shape[1:])
        rows.append(torch.cat([picked.detach().cpu().float(), pad]))
    save_image(torch.cat(rows).clamp(0, 1), path, nrow=per_class, padding=1, pad_value=1.0)
