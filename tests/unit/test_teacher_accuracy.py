"""strategies.datafree.teacher_accuracies: every teacher of a fuse scored on one pass of the clients
over the test set (on CIFAR-10 that pass is minutes on a CPU), with the accuracies each teacher
gets on its own."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

from oneshot_fl.data.datasets import Split
from oneshot_fl.engine.teachers import ClientEnsemble, MeanLogits, Teacher, WeightedLogits
from strategies.datafree import client_test_logits, per_class_recall, teacher_accuracies, teacher_accuracy


class FirstPixel(nn.Module):
    """logits = a * x + b from the image's first pixel x in [0, 1]; counts its forwards."""

    def __init__(self, a, b):
        super().__init__()
        self.a, self.b = nn.Parameter(torch.tensor(a)), nn.Parameter(torch.tensor(b))
        self.calls = 0

    def forward(self, images):
        self.calls += 1
        x = images[:, 0, 0, 0][:, None]
        return self.a * x + self.b


def _fleet():
    right = FirstPixel([-10.0, 10.0], [0.0, 0.0])  # bright -> 1, dark -> [0, 0] -> 0: always right
    wrong = FirstPixel([10.0, -10.0], [-1.0, 0.0])  # bright -> [9, -10] -> 0, dark -> [-1, 0] -> 1: always wrong
    labels = np.array([1, 1, 1, 0, 0])
    images = np.zeros((5, 2, 2, 1), dtype=np.uint8)
    images[labels == 1, 0, 0, 0] = 255
    ctx = SimpleNamespace(test=Split(images, labels), device=torch.device("cpu"), num_classes=2, held_test=None)
    return right, wrong, ClientEnsemble([right, wrong], ["x", "x"], vectorize=False), ctx


def test_every_teacher_scored_on_one_pass_of_the_clients():
    right, wrong, ensemble, ctx = _fleet()
    # the mean: bright [-0.5, 0] -> 1 (right), dark [-0.5, 0] -> 1 (wrong): 3 of 5
    teachers = {"mean": (MeanLogits(), False), "right": (WeightedLogits(torch.tensor([1.0, 0.0])), False),
                "wrong": (WeightedLogits(torch.tensor([0.0, 1.0])), False)}
    accs = teacher_accuracies(ensemble, teachers, ctx, batch_size=2)
    assert accs == {"mean": pytest.approx(0.6), "right": 1.0, "wrong": 0.0}
    assert right.calls == wrong.calls == 3  # ceil(5 / 2) batches, once for all three teachers


def test_oracle_labels_reach_only_the_teacher_that_asks_for_them():
    class ByLabel:
        """Client 0's logits where a label is given, client 1's otherwise."""

        def __call__(self, client_logits, labels=None):
            return client_logits[1] if labels is None else client_logits[0]

    _, _, ensemble, ctx = _fleet()
    accs = teacher_accuracies(ensemble, {"free": (ByLabel(), False), "oracle": (ByLabel(), True)}, ctx)
    assert accs == {"free": 0.0, "oracle": 1.0}
    assert teacher_accuracy(Teacher(ensemble, ByLabel()), ctx, oracle_labels=True) == 1.0


def test_cached_client_logits_are_read_instead_of_running_the_clients_again_and_give_per_class_recall():
    right, wrong, ensemble, ctx = _fleet()
    logits = client_test_logits(ensemble, ctx, batch_size=2)
    assert logits.shape == (2, 5, 2) and right.calls == wrong.calls == 3
    # right: bright [-10, 10] -> 1, dark [0, 0] -> argmax 0; wrong: bright [9, -10] -> 0, dark [-1, 0] -> 1
    assert per_class_recall(logits, ctx.test.labels).tolist() == [[1.0, 0.0], [1.0, 0.0]]  # (class, client)
    accs = teacher_accuracies(ensemble, {"right": (WeightedLogits(torch.tensor([1.0, 0.0])), False)}, ctx,
                              batch_size=2, client_logits=logits)
    assert accs == {"right": 1.0} and right.calls == 3  # no forward beyond the cached pass
    only_wrong = per_class_recall(logits[1:], np.array([1, 1, 1, 0, 0]))
    assert only_wrong.tolist() == [[0.0], [0.0]]
    missing = per_class_recall(logits, np.array([1, 1, 1, 1, 1]))  # no image of class 0: no recall, not 0
    assert bool(torch.isnan(missing[0]).all()) and missing[1].tolist() == pytest.approx([0.6, 0.4])  # 3 / 5, 2 / 5
