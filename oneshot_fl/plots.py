"""Plots written into the run folder (headless matplotlib).

Every figure has a builder, `*_figure(...) -> matplotlib.figure.Figure`, that draws it (title, axis labels,
a label for every class and client), and a save function under the old name that builds, saves and closes
it: tests read the labels off the Figure instead of comparing pixels.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

DPI = 120
SAMPLE_CELL_INCHES = 0.6  # one synthetic image in the sample grid: 60 px at SAMPLE_DPI
SAMPLE_DPI = 100


@functools.cache
def _pyplot():
    """matplotlib.pyplot on the headless Agg backend, imported (and the backend set) once, at the first
    plot: importing it costs ~0.7 s of CPU, which processes that never plot (the launcher validating a
    config) should not pay. Imported before the backend is set, not after `matplotlib.use`: in a simulation
    Flower loads the ClientApp (whose flwr-datasets imports pyplot) in another thread of the ServerApp's
    process, and `use` would call the half-imported module's switch_backend; the import waits for it."""
    import matplotlib.pyplot as pyplot

    pyplot.switch_backend("Agg")
    return pyplot


class _Pyplot:
    def __getattr__(self, name):
        return getattr(_pyplot(), name)


plt = _Pyplot()


def _save(fig: Figure, path: Path, dpi: int = DPI) -> None:
    fig.savefig(path, bbox_inches="tight", dpi=dpi)
    plt.close(fig)


# ---- words and colours shared by the figures ----

def partition_text(partition: str, alpha: float | None = None) -> str:
    """How a figure title names the partition scheme (names as in oneshot_fl.config.PARTITIONS): the
    Dirichlet concentration only for the Dirichlet schemes, the label skew for 2c/c (NIID-Bench's #C=2)."""
    if partition == "dirichlet":
        return f"Dirichlet alpha={alpha:g}"
    if partition == "niid-bench":
        return f"NIID-Bench Dirichlet alpha={alpha:g}"
    if partition == "2c/c":
        return "label skew #C=2 (2c/c: 2 classes per client)"
    if partition == "iid":
        return "IID"
    return partition


def class_labels(num_classes: int, class_names: Sequence[str] | None = None) -> list[str]:
    """'3', or '3 Dress' where the dataset names its classes by more than their index."""
    names = list(class_names) if class_names is not None and len(class_names) == num_classes else None
    return [str(c) if names is None or names[c] == str(c) else f"{c} {names[c]}" for c in range(num_classes)]


def client_labels(names: Sequence[str], roles: Sequence[str] | None = None) -> list[str]:
    """Client tick labels, each with its upload role ('p3 cvae-mlp (decoder)') where the fleet's roles differ."""
    if roles is None or len(set(roles)) < 2:
        return list(names)
    return [f"{name} ({role})" for name, role in zip(names, roles)]


def class_colours(num_classes: int) -> list[tuple[float, float, float, float]]:
    """A distinct qualitative colour per class: tab10 up to 10 classes, tab20 (tab10's hues, then their light
    shades) up to 20, then tab20b / tab20c, then evenly spaced hues."""
    import matplotlib  # as _pyplot: only a process that plots imports matplotlib
    from matplotlib.colors import to_rgba

    maps = matplotlib.colormaps
    if num_classes <= 10:
        colours = list(maps["tab10"].colors)
    else:
        tab20 = list(maps["tab20"].colors)
        colours = tab20[0::2] + tab20[1::2] + list(maps["tab20b"].colors) + list(maps["tab20c"].colors)
        if num_classes > len(colours):
            colours = [maps["hsv"](i / num_classes) for i in range(num_classes)]
    return [to_rgba(c) for c in colours[:num_classes]]


def _x_ticks(ax, labels: Sequence[str]) -> None:
    long = len(labels) > 8 or max((len(s) for s in labels), default=0) > 6
    ax.set_xticks(range(len(labels)), labels, rotation=45 if long else 0, ha="right" if long else "center",
                  fontsize=8)


# ---- label counts per client ----

def label_distribution_figure(counts: np.ndarray, title: str, *, names: Sequence[str] | None = None,
                              roles: Sequence[str] | None = None,
                              class_names: Sequence[str] | None = None) -> Figure:
    """Per-client label histograms as stacked bars, one qualitative colour per class (legend names every class,
    also those no client holds); x ticks name each client, with its role where the roles differ."""
    counts = np.asarray(counts)
    clients, num_classes = counts.shape
    names = list(names) if names is not None else [f"p{k}" for k in range(clients)]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * clients + 3.0), 4.5))
    bottom = np.zeros(clients)
    for c, (label, colour) in enumerate(zip(class_labels(num_classes, class_names), class_colours(num_classes))):
        ax.bar(range(clients), counts[:, c], bottom=bottom, color=colour, label=label, width=0.8)
        bottom += counts[:, c]
    _x_ticks(ax, client_labels(names, roles))
    ax.set_xlim(-0.6, clients - 0.4)
    ax.set_xlabel("client")
    ax.set_ylabel("samples (label count)")
    ax.set_title(title, fontsize=10)
    ax.legend(title="class", loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8,
              ncol=1 if num_classes <= 20 else 2)
    ax.grid(axis="y", alpha=0.3)
    return fig


def label_distribution(counts: np.ndarray, path: Path, title: str, *, names: Sequence[str] | None = None,
                       roles: Sequence[str] | None = None, class_names: Sequence[str] | None = None) -> None:
    """Per-client label histograms (as uploaded) -> `path`."""
    _save(label_distribution_figure(counts, title, names=names, roles=roles, class_names=class_names), path)


# ---- accuracy per epoch ----

def accuracy_curve_figure(history: Sequence[dict], title: str, reference: dict[str, float] | None = None,
                          *, xlabel: str = "server training epoch (distillation / fusion)") -> Figure | None:
    """Test accuracy of the global model per epoch (+ horizontal reference lines); integer epoch ticks.
    None when no epoch has an accuracy."""
    from matplotlib.ticker import MaxNLocator  # as _pyplot

    points = [(h["epoch"], h["accuracy"]) for h in history if h.get("accuracy") is not None]
    if not points:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    ax.plot(*zip(*points), marker="o", ms=3, label="global model")
    for name, value in (reference or {}).items():
        if value is not None:
            ax.axhline(value, ls="--", lw=1, color="grey" if "client" in name else "tab:red",
                       label=f"{name} {value:.3f}")
    epochs = [e for e, _ in points]
    margin = max(1.0, 0.04 * (max(epochs) - min(epochs)))  # >= 2 integers in view, else the locator gives fractions
    ax.set_xlim(min(epochs) - margin, max(epochs) + margin)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 5, 10]))  # epochs 5, 10, 15, not 6, 9
    ax.set_xlabel(xlabel)
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    return fig


def accuracy_curve(history: Sequence[dict], path: Path, title: str, reference: dict[str, float] | None = None) -> None:
    """Test accuracy of the global model per distillation epoch (+ horizontal reference lines) -> `path`."""
    fig = accuracy_curve_figure(history, title, reference)
    if fig is not None:
        _save(fig, path)


# ---- local accuracy per client ----

def client_accuracies_figure(names: Sequence[str], accuracies: Sequence[float | None], global_accuracy: float | None,
                             title: str, *, roles: Sequence[str] | None = None) -> Figure:
    """Each client's local test accuracy (a client without one, e.g. a FedMHO decoder client, gets a 'no
    classifier' mark instead of a bar) against the global model; the role of each client where roles differ."""
    fig, ax = plt.subplots(figsize=(max(5.0, 0.55 * len(names) + 2.5), 4))
    heights = [a if a is not None else 0.0 for a in accuracies]
    ax.bar(range(len(names)), heights, color="tab:blue", label="client (local test accuracy)")
    for k, a in enumerate(accuracies):
        if a is None:
            ax.text(k, 0.02, "no classifier", rotation=90, ha="center", va="bottom", fontsize=7, color="dimgrey")
    _x_ticks(ax, client_labels(names, roles))
    if global_accuracy is not None:
        ax.axhline(global_accuracy, color="tab:red", ls="--", label=f"global model {global_accuracy:.3f}")
    ax.legend(fontsize=8)
    ax.set_xlabel("client")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(0, 1)
    ax.set_title(title, fontsize=10)
    return fig


def client_accuracies(names: list[str], accuracies: list[float | None], global_accuracy: float | None,
                      path: Path, title: str, *, roles: Sequence[str] | None = None) -> None:
    _save(client_accuracies_figure(names, accuracies, global_accuracy, title, roles=roles), path)


# ---- heat maps ----

def heatmap_figure(matrix: np.ndarray, title: str, xlabel: str, ylabel: str, *,
                   xticklabels: Sequence[str] | None = None, yticklabels: Sequence[str] | None = None) -> Figure:
    """Annotated heat map with a tick for every row and column (default labels 0..n-1)."""
    matrix = np.asarray(matrix)
    rows, cols = matrix.shape
    fig, ax = plt.subplots(figsize=(1.5 + 0.7 * cols, 1.2 + 0.45 * rows))
    im = ax.imshow(matrix, cmap="viridis", aspect="auto", vmin=0)
    if rows * cols <= 400:
        for i in range(rows):
            for j in range(cols):
                ax.text(j, i, f"{matrix[i, j]:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if matrix[i, j] < 0.5 * matrix.max() else "black")
    ax.set_xticks(range(cols), [str(j) for j in range(cols)] if xticklabels is None else list(xticklabels),
                  fontsize=8)
    ax.set_yticks(range(rows), [str(i) for i in range(rows)] if yticklabels is None else list(yticklabels),
                  fontsize=8 if rows <= 40 else 6)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    fig.colorbar(im, ax=ax)
    return fig


def heatmap(matrix: np.ndarray, path: Path, title: str, xlabel: str, ylabel: str, *,
            xticklabels: Sequence[str] | None = None, yticklabels: Sequence[str] | None = None) -> None:
    """Annotated heat map, e.g. FedHydra's U_r / U_c (classes x clients, the paper's Fig. 5b) -> `path`."""
    _save(heatmap_figure(matrix, title, xlabel, ylabel, xticklabels=xticklabels, yticklabels=yticklabels), path)


# ---- synthetic samples ----

def _grid_image(images: torch.Tensor, labels: torch.Tensor, num_classes: int, per_class: int,
                pad: int) -> tuple[np.ndarray, list[int]]:
    """(rows*H + pads, per_class*W + pads, 3) in [0, 1], one row per class on a white background, and how many
    samples each row shows."""
    images = images.detach().cpu().float().clamp(0, 1)
    labels = labels.detach().cpu()
    channels, height, width = images.shape[1:]
    grid = np.ones((pad + num_classes * (height + pad), pad + per_class * (width + pad), 3), dtype=np.float32)
    shown = []
    for c in range(num_classes):
        picked = images[labels == c][:per_class]
        shown.append(len(picked))
        for j, image in enumerate(picked):
            pixels = image.permute(1, 2, 0).numpy()
            y, x = pad + c * (height + pad), pad + j * (width + pad)
            grid[y:y + height, x:x + width] = pixels if channels == 3 else pixels[..., :1]
    return grid, shown


def sample_grid_figure(images: torch.Tensor, labels: torch.Tensor, num_classes: int, per_class: int = 8, *,
                       title: str | None = None, class_names: Sequence[str] | None = None) -> Figure:
    """A grid of synthetic samples, one row per class, each row labelled with its class ('(none)' where the
    class has no sample); cells of SAMPLE_CELL_INCHES at SAMPLE_DPI."""
    pad = 2
    grid, shown = _grid_image(images, labels, num_classes, per_class, pad)
    height = images.shape[2]
    fig, ax = plt.subplots(figsize=(per_class * SAMPLE_CELL_INCHES + 1.8, num_classes * SAMPLE_CELL_INCHES + 1.0),
                           dpi=SAMPLE_DPI)
    ax.imshow(grid, interpolation="nearest", vmin=0, vmax=1)
    rows = [label if n else f"{label} (none)" for label, n in zip(class_labels(num_classes, class_names), shown)]
    ax.set_yticks([pad + c * (height + pad) + (height - 1) / 2 for c in range(num_classes)], rows, fontsize=9)
    ax.set_xticks([])
    ax.tick_params(axis="y", length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_ylabel("class")
    ax.set_xlabel(f"up to {per_class} samples per class")
    ax.set_title(title or "synthetic samples, one row per class", fontsize=10)
    fig.tight_layout()
    return fig


def sample_grid(images: torch.Tensor, labels: torch.Tensor, num_classes: int, path: Path, per_class: int = 8, *,
                title: str | None = None, class_names: Sequence[str] | None = None) -> None:
    """A grid of synthetic samples: one row per class (images in [0, 1], NCHW) -> `path`."""
    fig = sample_grid_figure(images, labels, num_classes, per_class, title=title, class_names=class_names)
    _save(fig, path, dpi=SAMPLE_DPI)


def scored_sample_grid_figure(images: torch.Tensor, labels: torch.Tensor, num_classes: int,
                              row_scores: Sequence[float | None], per_class: int = 8, *, title: str | None = None,
                              class_names: Sequence[str] | None = None, scorer: str = "a real-data classifier"
                              ) -> Figure:
    """sample_grid_figure whose row labels also give the share of that class's samples a real-data classifier
    recognises ('3  97 %'; '(none)' where the class has no sample), the right-hand side naming the scorer."""
    fig = sample_grid_figure(images, labels, num_classes, per_class, title=title, class_names=class_names)
    ax = fig.axes[0]
    rows = []
    for label, score in zip(class_labels(num_classes, class_names), row_scores):
        rows.append(f"{label}  (none)" if score is None else f"{label}  {100 * score:.0f} %")
    ax.set_yticks(ax.get_yticks(), rows, fontsize=9)
    ax.set_ylabel(f"class  (share of its samples {scorer} recognises)", fontsize=9)
    fig.tight_layout()
    return fig


def scored_sample_grid(images: torch.Tensor, labels: torch.Tensor, num_classes: int, row_scores: Sequence[float | None],
                       path: Path, per_class: int = 8, *, title: str | None = None,
                       class_names: Sequence[str] | None = None, scorer: str = "a real-data classifier") -> None:
    """A grid of synthetic samples, a row per class labelled with a real-data classifier's score -> `path`."""
    fig = scored_sample_grid_figure(images, labels, num_classes, row_scores, per_class, title=title,
                                    class_names=class_names, scorer=scorer)
    _save(fig, path, dpi=SAMPLE_DPI)
