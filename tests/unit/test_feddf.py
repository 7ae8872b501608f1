"""FedDF's pieces: public-data conversion, the held-out split, early stopping with the best student kept."""

import numpy as np
import pytest
import torch

from oneshot_fl.engine.distill import DistillSettings, distill
from oneshot_fl.engine.early_stop import EarlyStopping
from oneshot_fl.engine.pool import SyntheticPool
from oneshot_fl.engine.sources import HoldoutSynthesizer, ProxySynthesizer, convert_images
from oneshot_fl.engine.synthesizer import SynthBatch


def test_public_images_are_converted_to_the_runs_channels_and_size():
    rgb = np.zeros((2, 32, 32, 3), dtype=np.uint8)
    rgb[..., 0] = 255  # pure red
    grey = convert_images(rgb, (1, 28, 28))
    assert grey.shape == (2, 1, 28, 28) and torch.allclose(grey, torch.full_like(grey, 0.299), atol=1e-5)
    mono = np.full((1, 28, 28, 1), 51, dtype=np.uint8)
    colour = convert_images(mono, (3, 32, 32))
    assert colour.shape == (1, 3, 32, 32) and torch.allclose(colour, torch.full_like(colour, 0.2), atol=1e-5)


class _Teacher:
    def predict(self, x):
        return x.flatten(1)[:, :3] * 10


class _Counter:
    """A source whose batch i holds the values i*10 .. i*10+9 (to see where each sample went)."""

    def __init__(self):
        self.calls = 0

    def synthesize(self):
        values = torch.arange(10.0) + 10 * self.calls
        self.calls += 1
        return SynthBatch(values[:, None], values.long() % 3, values[:, None].repeat(1, 3),
                          {"ce": 0.0, "bn": 0.0, "adv": 0.0})

    def state_dict(self):
        return {"calls": self.calls}

    def load_state_dict(self, state):
        self.calls = state["calls"]


def test_holdout_keeps_a_share_of_every_batch_out_of_training():
    holdout = HoldoutSynthesizer(_Counter(), fraction=0.2, max_size=3)
    first = holdout.synthesize()
    assert first.images.flatten().tolist() == list(range(2, 10))
    assert holdout.validation()[0].flatten().tolist() == [0, 1]
    second = holdout.synthesize()
    assert second.images.flatten().tolist() == list(range(12, 20))
    assert holdout.validation()[0].flatten().tolist() == [1, 10, 11]  # FIFO, at most 3
    with pytest.raises(ValueError):
        HoldoutSynthesizer(_Counter(), fraction=0.0, max_size=3)


def test_proxy_synthesizer_draws_without_replacement_and_labels_by_the_teacher():
    images = np.arange(6 * 4, dtype=np.uint8).reshape(6, 2, 2, 1) * 10
    proxy = ProxySynthesizer(_Teacher(), images, (1, 2, 2), batch_size=3, seed=0, device=torch.device("cpu"))
    a, b = proxy.synthesize(), proxy.synthesize()
    firsts = sorted(a.images[:, 0, 0, 0].tolist() + b.images[:, 0, 0, 0].tolist())
    assert np.allclose(firsts, images[:, 0, 0, 0] / 255.0)  # every image once per pass
    assert torch.equal(a.labels, a.teacher_logits.argmax(1))


def test_early_stopping_stops_after_patience_and_restores_the_best_student():
    student = torch.nn.Linear(1, 3, bias=False)
    x = torch.ones(4, 1)
    target = torch.tensor([[3.0, 0.0, 0.0]]).repeat(4, 1)
    stop = EarlyStopping(lambda: (x, target), patience=2)
    scores = []
    for epoch, w in enumerate([[1.0, 0, 0], [3.0, 0, 0], [0.0, 0, 0], [0.5, 0, 0]], start=1):
        student.weight.data = torch.tensor(w)[:, None]
        scores.append(stop.update(epoch, student)["val_kl"])
        if stop.should_stop:
            break
    assert epoch == 4 and stop.best_epoch == 2 and scores[1] < 1e-6
    stop.restore(student)
    assert torch.allclose(student.weight.data.flatten(), torch.tensor([3.0, 0, 0]))


def test_distill_ends_early_and_leaves_the_best_student():
    torch.manual_seed(0)
    student = torch.nn.Linear(1, 3)
    source = HoldoutSynthesizer(_Counter(), 0.3, 100)

    class Never(EarlyStopping):  # a held-out score that never improves after epoch 1
        def update(self, epoch, model):
            if epoch == 1:
                self.best_state = {k: v.clone() for k, v in model.state_dict().items()}
                self.best_epoch = 1
            else:
                self.bad_epochs += 1
            return {"val_best_epoch": self.best_epoch}

    stop = Never(source.validation, patience=2)
    settings = DistillSettings(epochs=10, lr=0.01, eval_every=100)
    history, _ = distill(student, source, SyntheticPool("paper", 1, 1, 10), settings, lambda m: 0.0, seed=0,
                         early_stop=stop)
    assert [h["epoch"] for h in history] == [1, 2, 3]
    assert history[-1]["accuracy"] is not None  # the stopping epoch is evaluated
    for key, value in stop.best_state.items():
        assert torch.equal(student.state_dict()[key], value)
