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


# --- feddf.source='dataset' through the strategy, on an in-memory public set ---------------------

def _feddf(tmp_path, monkeypatch, **over):
    from oneshot_fl.config import from_run_config, merge_overrides
    from oneshot_fl.data.datasets import Split
    from strategies.context import FuseContext
    from strategies import feddf as feddf_module

    rng = np.random.default_rng(0)
    public = Split(rng.integers(0, 256, (24, 32, 32, 3), dtype=np.uint8), np.full(24, -1, np.int64))  # RGB 32 px
    loads = []

    def fake_load_split(name, split, data_dir, download):
        loads.append((name, split))
        return public

    monkeypatch.setattr(feddf_module, "load_split", fake_load_split)
    flat = {"method": "feddf", "preset": "smoke", "feddf.source": "dataset", "feddf.public-dataset": "cifar10",
            "distill.epochs": 2, "distill.synth-batch": 8, "distill.kd-steps": 2, **over}
    cfg = from_run_config(merge_overrides(flat))
    test = Split(rng.integers(0, 256, (6, 28, 28, 1), dtype=np.uint8), np.arange(6) % 10)
    ctx = FuseContext(cfg=cfg, device=torch.device("cpu"), num_classes=10, input_shape=(1, 28, 28), test=test,
                      run_dir=tmp_path)
    return feddf_module.FedDF(cfg, ctx), ctx, public, loads


def _uploads():
    from oneshot_fl.models.registry import build
    from oneshot_fl.uploads import Upload

    return [Upload(node_id=i, partition_id=i, role="classifier", arch="cnn2",
                   state=build("cnn2", (1, 28, 28), 10, seed=i).state_dict(),
                   label_counts=np.full(10, 5 + i, np.int64), num_examples=10 * (5 + i)) for i in range(2)]


def test_dataset_source_needs_a_known_public_dataset_other_than_the_clients(tmp_path, monkeypatch):
    from oneshot_fl.config import ConfigError

    for public, message in (("", "needs feddf.public-dataset"), ("imagenet", "not a known dataset"),
                            ("mnist", "is the clients' own dataset")):
        with pytest.raises(ConfigError, match=message):
            _feddf(tmp_path, monkeypatch, **{"feddf.public-dataset": public})
    _feddf(tmp_path, monkeypatch, **{"feddf.public-dataset": "fmnist"})  # accepted
    _feddf(tmp_path, monkeypatch, **{"feddf.source": "generator", "feddf.public-dataset": ""})  # not needed


class _ArgmaxTeacher:
    def predict(self, x, labels=None):
        return x.flatten(1)[:, :10] * 100.0  # logits from the (converted) pixels


def test_dataset_source_draws_converted_public_images_labelled_by_the_teacher(tmp_path, monkeypatch):
    strategy, ctx, public, loads = _feddf(tmp_path, monkeypatch, **{"feddf.patience": 0})
    source = strategy.make_synthesizer(_ArgmaxTeacher(), None, ctx)
    assert isinstance(source, ProxySynthesizer) and loads == [("cifar10", "train")]
    seen = []
    for _ in range(3):  # 24 images, batches of 8: one pass, every image once
        batch = source.synthesize()
        assert batch.images.shape == (8, 1, 28, 28)
        assert torch.equal(batch.teacher_logits, _ArgmaxTeacher().predict(batch.images))
        assert torch.equal(batch.labels, batch.teacher_logits.argmax(1))
        seen.append(batch.images)
    assert torch.allclose(torch.cat(seen).sum(0), convert_images(public.images, (1, 28, 28)).sum(0), atol=1e-3)


def test_dataset_source_with_early_stopping_holds_out_part_of_each_public_batch(tmp_path, monkeypatch):
    strategy, ctx, _, _ = _feddf(tmp_path, monkeypatch, **{"feddf.patience": 3, "feddf.val-fraction": 0.25})
    source = strategy.make_synthesizer(_ArgmaxTeacher(), None, ctx)
    assert isinstance(source, HoldoutSynthesizer) and isinstance(source.inner, ProxySynthesizer)
    batch = source.synthesize()
    assert len(batch.labels) == 6 and len(source.validation()[0]) == 2  # 8 images: 2 held out


def test_feddf_fuses_on_public_data_from_the_fedavg_student(tmp_path, monkeypatch):
    strategy, ctx, _, loads = _feddf(tmp_path, monkeypatch, **{"feddf.patience": 5})
    result = strategy.fuse(_uploads(), ctx)
    assert loads == [("cifar10", "train")]
    assert result.metrics["source"] == "dataset" and result.metrics["student_init"] == "fedavg"
    assert [h["epoch"] for h in result.history] == [1, 2]
    assert all(h["kd_steps"] == 2 and "val_kl" in h for h in result.history)
    assert all(h["gen_ce"] == 0.0 for h in result.history)  # no generator was trained
