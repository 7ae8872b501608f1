"""The per-run picture of the decoders' samples: a row per class, labelled with a real-data classifier's score."""

import numpy as np
import torch

from oneshot_fl import plots


def texts(labels):
    return [t.get_text() for t in labels]


def test_rows_carry_their_class_and_the_share_recognised():
    labels = torch.arange(10).repeat_interleave(3)[:-3]  # class 9 has no sample
    images = torch.rand(len(labels), 1, 28, 28)
    scores = [1.0, 0.5, 0.974] + [0.0] * 6 + [None]
    fig = plots.scored_sample_grid_figure(images, labels, 10, scores, per_class=3, title="fedmho: kept samples",
                                          scorer="a cnn2 fitted on real test images")
    ax = fig.axes[0]
    rows = texts(ax.get_yticklabels())
    assert rows[:3] == ["0  100 %", "1  50 %", "2  97 %"] and rows[-1] == "9  (none)"
    assert ax.get_title() == "fedmho: kept samples"
    assert "a cnn2 fitted on real test images" in ax.get_ylabel()
    # the images are where sample_grid puts them: class 2, third sample
    grid = np.asarray(ax.images[0].get_array())
    pad = 2
    y, x = pad + 2 * (28 + pad), pad + 2 * (28 + pad)
    assert np.allclose(grid[y:y + 28, x:x + 28, 0], images[labels == 2][2, 0].numpy())
    plots.plt.close(fig)


def test_class_names_stay_in_the_row_labels(tmp_path):
    labels = torch.tensor([0, 1])
    names = ["T-shirt", "Trouser"] + [f"c{i}" for i in range(2, 10)]
    fig = plots.scored_sample_grid_figure(torch.rand(2, 1, 28, 28), labels, 10, [0.25, 1.0] + [None] * 8,
                                          class_names=names)
    assert texts(fig.axes[0].get_yticklabels())[:2] == ["0 T-shirt  25 %", "1 Trouser  100 %"]
    plots.plt.close(fig)
    plots.scored_sample_grid(torch.rand(2, 1, 28, 28), labels, 10, [0.25, 1.0] + [None] * 8,
                             tmp_path / "synthetic_samples.png")
    assert (tmp_path / "synthetic_samples.png").stat().st_size > 1000
