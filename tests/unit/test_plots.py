"""The run-folder figures, read off their matplotlib Figure objects: titles, axis labels, a tick or legend entry
naming every class and client (with its role where roles differ), integer epochs, distinct class colours and a
sample grid large enough to read."""

import itertools
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from oneshot_fl import plots

DIGITS = [str(c) for c in range(10)]
FMNIST = ("T-shirt", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Boot")


def texts(items) -> list[str]:
    return [t.get_text() for t in items]


def visible_ticks(ax) -> list[float]:
    lo, hi = ax.get_xlim()
    return [float(t) for t in ax.get_xticks() if lo <= t <= hi]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plots.plt.close("all")


@pytest.fixture
def captured(monkeypatch):
    """Every Figure the save functions build, by builder name."""
    figures: dict[str, list] = {}

    def recorder(name, real):
        def record(*args, **kwargs):
            fig = real(*args, **kwargs)
            figures.setdefault(name, []).append(fig)
            return fig
        return record

    for name in ("label_distribution_figure", "client_accuracies_figure", "accuracy_curve_figure",
                 "sample_grid_figure", "heatmap_figure"):
        monkeypatch.setattr(plots, name, recorder(name, getattr(plots, name)))
    return figures


# ---- words ----

def test_the_partition_text_names_the_scheme_and_alpha_only_for_dirichlet():
    assert plots.partition_text("dirichlet", 0.5) == "Dirichlet alpha=0.5"
    assert plots.partition_text("niid-bench", 0.01) == "NIID-Bench Dirichlet alpha=0.01"
    assert plots.partition_text("2c/c", 0.5) == "label skew #C=2 (2c/c: 2 classes per client)"
    assert plots.partition_text("iid", 0.5) == "IID"


def test_client_labels_carry_the_role_only_where_roles_differ():
    names = ["p0 cnn2", "p3 cvae-mlp"]
    assert plots.client_labels(names, ["classifier", "decoder"]) == ["p0 cnn2 (classifier)", "p3 cvae-mlp (decoder)"]
    assert plots.client_labels(names, ["classifier", "classifier"]) == names
    assert plots.client_labels(names) == names


# ---- label counts ----

def test_label_counts_name_every_class_and_client_with_its_role_in_distinct_colours():
    counts = np.array([[5, 4, 3, 2, 1, 0, 0, 0, 0, 0], [0, 0, 0, 0, 7, 8, 9, 10, 0, 0], [1] * 8 + [0, 0]])
    fig = plots.label_distribution_figure(counts, "fleet", names=["p0 cnn2", "p1 cnn2", "p2 cvae-mlp"],
                                          roles=["classifier", "classifier", "decoder"])
    ax = fig.axes[0]
    assert ax.get_title() == "fleet"
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("client", "samples (label count)")
    assert texts(ax.get_xticklabels()) == ["p0 cnn2 (classifier)", "p1 cnn2 (classifier)", "p2 cvae-mlp (decoder)"]
    legend = ax.get_legend()
    assert legend.get_title().get_text() == "class"
    assert texts(legend.get_texts()) == DIGITS  # classes 8, 9 held by no client are named too
    assert len(ax.containers) == 10
    for c, bars in enumerate(ax.containers):  # one stacked bar per class, as high as its counts
        assert [p.get_height() for p in bars.patches] == counts[:, c].tolist()
    colours = [np.array(bars.patches[0].get_facecolor()[:3]) for bars in ax.containers]
    # pairwise far apart: the old sequential RdYlGn map put classes 4/5 and 6/7 0.09 apart in RGB
    assert min(np.linalg.norm(a - b) for a, b in itertools.combinations(colours, 2)) > 0.2


def test_label_counts_without_roles_name_partitions_and_label_classes_by_name():
    fig = plots.label_distribution_figure(np.ones((2, 10), dtype=int), "t", class_names=FMNIST)
    ax = fig.axes[0]
    assert texts(ax.get_xticklabels()) == ["p0", "p1"]
    assert texts(ax.get_legend().get_texts()) == [f"{c} {name}" for c, name in enumerate(FMNIST)]


def test_twenty_classes_get_twenty_different_colours():
    colours = plots.class_colours(20)
    assert len({tuple(np.round(c, 4)) for c in colours}) == 20
    assert colours[:10] == plots.class_colours(10)  # tab20 ordered as tab10's hues first
    fig = plots.label_distribution_figure(np.ones((3, 20), dtype=int), "t")
    faces = {tuple(bars.patches[0].get_facecolor()) for bars in fig.axes[0].containers}
    assert len(faces) == 20


# ---- accuracy per epoch ----

def test_accuracy_curve_ticks_are_whole_epochs():
    history = [{"epoch": e, "accuracy": e / 40} for e in range(5, 31, 5)] + [{"epoch": 31, "accuracy": None}]
    fig = plots.accuracy_curve_figure(history, "feddf on mnist, Dirichlet alpha=0.5: global test accuracy",
                                      {"best client": 0.4, "teacher ensemble": 0.7, "missing": None})
    ax = fig.axes[0]
    fig.canvas.draw()
    assert ax.get_title() == "feddf on mnist, Dirichlet alpha=0.5: global test accuracy"
    assert ax.get_xlabel().startswith("server training epoch") and ax.get_ylabel() == "test accuracy"
    assert visible_ticks(ax) == [5.0, 10.0, 15.0, 20.0, 25.0, 30.0]
    assert all(label.lstrip("−-").isdigit() for label in texts(ax.get_xticklabels()))
    assert texts(ax.get_legend().get_texts()) == ["global model", "best client 0.400", "teacher ensemble 0.700"]


@pytest.mark.parametrize("epochs", [[1], [1, 2, 3], list(range(1, 8)), list(range(0, 200))])
def test_accuracy_curve_ticks_stay_integer_for_short_and_long_runs(epochs):
    fig = plots.accuracy_curve_figure([{"epoch": e, "accuracy": 0.5} for e in epochs], "t")
    ticks = visible_ticks(fig.axes[0])
    assert len(ticks) >= 2 and all(t == int(t) for t in ticks)


def test_no_accuracy_no_curve(tmp_path):
    assert plots.accuracy_curve_figure([{"epoch": 1, "accuracy": None}], "t") is None
    plots.accuracy_curve([{"epoch": 1, "accuracy": None}], tmp_path / "accuracy.png", "t")
    assert not (tmp_path / "accuracy.png").exists()


# ---- client accuracies ----

def test_client_accuracies_mark_roles_and_clients_without_a_classifier():
    fig = plots.client_accuracies_figure(["p0 cnn2", "p1 cnn2", "p2 cvae-mlp"], [0.5, 0.6, None], 0.7,
                                         "fedmho-md on mnist: clients vs global model",
                                         roles=["classifier", "classifier", "decoder"])
    ax = fig.axes[0]
    assert ax.get_title() == "fedmho-md on mnist: clients vs global model"
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("client", "test accuracy")
    assert texts(ax.get_xticklabels()) == ["p0 cnn2 (classifier)", "p1 cnn2 (classifier)", "p2 cvae-mlp (decoder)"]
    assert [p.get_height() for p in ax.patches] == [0.5, 0.6, 0.0]
    assert [(t.get_text(), t.get_position()[0]) for t in ax.texts] == [("no classifier", 2)]
    assert texts(ax.get_legend().get_texts()) == ["global model 0.700", "client (local test accuracy)"]


# ---- heat maps ----

@pytest.mark.parametrize("classes", [10, 20])
def test_heatmap_labels_every_class_and_client(classes):
    matrix = np.random.default_rng(0).random((classes, 4))
    fig = plots.heatmap_figure(matrix, "U_r: whom to trust for each class (rows sum to 1)", "client", "class")
    ax = fig.axes[0]
    assert ax.get_title() == "U_r: whom to trust for each class (rows sum to 1)"
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("client", "class")
    assert texts(ax.get_yticklabels()) == [str(c) for c in range(classes)]
    assert texts(ax.get_xticklabels()) == ["0", "1", "2", "3"]
    named = plots.heatmap_figure(matrix, "t", "client", "class", xticklabels=["p0", "p1", "p2", "p5"])
    assert texts(named.axes[0].get_xticklabels()) == ["p0", "p1", "p2", "p5"]


def test_heatmap_is_saved(tmp_path):
    plots.heatmap(np.eye(3), tmp_path / "h.png", "t", "client", "class")
    assert (tmp_path / "h.png").stat().st_size > 0


# ---- synthetic samples ----

def grid_inputs(channels=1, size=28):
    labels = torch.tensor([c for c in range(9) for _ in range(10)])  # class 9 drew nothing
    images = torch.rand(len(labels), channels, size, size)
    return images, labels


def test_sample_grid_is_large_titled_and_names_each_class_row():
    images, labels = grid_inputs()
    fig = plots.sample_grid_figure(images, labels, 10)
    ax = fig.axes[0]
    width, height = fig.get_size_inches() * fig.dpi
    assert fig.dpi >= 100 and width >= 8 * 50 and height >= 10 * 50
    fig.canvas.draw()
    box = ax.get_window_extent()
    assert box.height / 10 >= 50 and box.width / 8 >= 50  # each drawn cell >= 50 px (the old PNG: 29 px)
    assert ax.get_title() == "synthetic samples, one row per class"
    assert ax.get_ylabel() == "class"
    assert texts(ax.get_yticklabels()) == DIGITS[:9] + ["9 (none)"]


def test_sample_grid_rows_hold_their_class_and_names_come_from_the_dataset():
    images, labels = grid_inputs(channels=3, size=32)
    fig = plots.sample_grid_figure(images, labels, 10, per_class=4, title="feddf: synthetic samples",
                                   class_names=FMNIST)
    ax = fig.axes[0]
    assert ax.get_title() == "feddf: synthetic samples"
    assert texts(ax.get_yticklabels())[:2] == ["0 T-shirt", "1 Trouser"]
    assert texts(ax.get_yticklabels())[-1] == "9 Boot (none)"
    grid = np.asarray(ax.images[0].get_array())
    pad = 2
    y, x = pad + 3 * (32 + pad), pad + 1 * (32 + pad)  # class 3, second sample
    expected = images[labels == 3][1].permute(1, 2, 0).numpy()
    assert np.allclose(grid[y:y + 32, x:x + 32], expected)
    assert (ax.get_yticks()[3] - y) == pytest.approx(15.5)  # the label sits on its row


def test_sample_grid_png_is_readable_size(tmp_path):
    from PIL import Image

    images, labels = grid_inputs()
    plots.sample_grid(images, labels, 10, tmp_path / "synthetic_samples.png")
    width, height = Image.open(tmp_path / "synthetic_samples.png").size
    assert width >= 8 * 50 and height >= 10 * 50  # was 234 x 294


# ---- the call sites ----

def test_the_partition_preview_titles_the_scheme_and_names_every_class(tmp_path, mnist_dir, captured):
    from launcher.preview import preview_partition

    preview_partition(["dataset='mnist' partition='2c/c' num-clients=4"], tmp_path / "a")
    preview_partition(["dataset='mnist' partition='dirichlet' alpha=0.3 num-clients=4"], tmp_path / "b")
    two, dirichlet = (fig.axes[0] for fig in captured["label_distribution_figure"])
    assert two.get_title() == ("mnist, label skew #C=2 (2c/c: 2 classes per client), K=4, seed=0: "
                               "label counts per client")
    assert "alpha" not in two.get_title()
    assert dirichlet.get_title() == "mnist, Dirichlet alpha=0.3, K=4, seed=0: label counts per client"
    assert texts(two.get_legend().get_texts()) == DIGITS  # 8, 9 held by nobody, still named
    assert texts(two.get_xticklabels()) == ["p0", "p1", "p2", "p3"]
    assert (tmp_path / "a" / "label_counts.png").is_file()


def test_a_fedmho_run_marks_the_role_of_each_client(tmp_path, mnist_dir, captured):
    from tests.strategies.test_fedmho import _strategy, mixed_replies, run

    run(_strategy(tmp_path, **{"num-clients": 4}), mixed_replies())
    roles = ["p0 cnn2 (classifier)", "p1 cnn2 (classifier)", "p2 cvae-mlp (decoder)", "p3 cvae-mlp (decoder)"]
    counts = captured["label_distribution_figure"][0].axes[0]
    assert texts(counts.get_xticklabels()) == roles
    assert counts.get_title() == "mnist, Dirichlet alpha=0.5, K=4: label counts per client (as uploaded)"
    accuracy = captured["client_accuracies_figure"][0].axes[0]
    assert texts(accuracy.get_xticklabels()) == roles
    assert texts(accuracy.texts) == ["no classifier", "no classifier"]
    assert accuracy.get_title() == "fedmho-md on mnist, Dirichlet alpha=0.5: clients vs global model"
    grids = [fig.axes[0].get_title() for fig in captured["sample_grid_figure"]]
    assert grids == ["fedmho-md: kept synthetic samples (decoder outputs, decoders in turn), one row per class",
                     "fedmho-md: dropped synthetic samples (filtered out), one row per class"]


# pyplot half-imported by another thread (Flower loading the ClientApp, whose flwr-datasets imports it, beside a
# ServerApp that plots at once: a resumed run) while this process makes its first plot
HALF_IMPORTED = """
import importlib.abc, sys, threading, time
from oneshot_fl import plots
assert "matplotlib.pyplot" not in sys.modules
started = threading.Event()
class Slow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "matplotlib.figure" and threading.current_thread().name == "loader":
            started.set()
            time.sleep(3)  # pyplot is in sys.modules, its body not yet run
        return None
sys.meta_path.insert(0, Slow())
loader = threading.Thread(target=lambda: __import__("matplotlib.pyplot"), name="loader")
loader.start()
assert started.wait(60)
fig = plots.heatmap_figure([[0.5, 0.5], [0.2, 0.8]], "t", "client", "class")
print(type(fig).__name__, plots.plt.get_backend().lower())
loader.join()
"""


def test_the_first_plot_waits_for_pyplot_being_imported_by_another_thread():
    out = subprocess.run([sys.executable, "-c", HALF_IMPORTED], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["Figure", "agg"]
