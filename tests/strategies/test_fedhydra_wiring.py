"""FedHydra's wiring: the teacher it distils from is the stratified one with the U it computed (rows =
classes, columns = clients), the synthetic labels reach a label-routed SA, the mode and the knobs change
what they name, a subclass of the strategy (a benchmark's variant) replaces its recipe, and the student is
frozen during generator steps and restored after."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from oneshot_fl.config import from_run_config, merge_overrides
from oneshot_fl.engine.stratify import Stratification, normalise
from oneshot_fl.engine.synthesizer import GeneratorLoss, GeneratorSynthesizer
from oneshot_fl.engine.teachers import ClientEnsemble, MeanLogits, StratifiedAggregation, Teacher
from oneshot_fl.models.generator import GeneratorSpec
from oneshot_fl.models.registry import build
from oneshot_fl.uploads import decode_and_check, encode
from strategies import build_strategy
import strategies.datafree as datafree
import strategies.fedhydra as fedhydra_module

BASE = {"method": "fedhydra", "preset": "smoke", "num-clients": 3, "save-uploads": False, "distill.epochs": 1}


def _uploads():
    rng = np.random.default_rng(0)
    uploads = []
    for k in range(3):
        model = build("cnn2", (1, 28, 28), 10, seed=k)
        content = encode("classifier", "cnn2", model.state_dict(), rng.integers(1, 50, 10), k, {})
        uploads.append(decode_and_check(content, k + 1, 10, (1, 28, 28)))
    return uploads


def _fixed_stratification():
    """Client 0 owns classes 0-3, client 1 classes 4-6, client 2 classes 7-9 (u of 1 vs 0.01)."""
    u = torch.full((10, 3), 0.01)
    u[:4, 0] = u[4:7, 1] = u[7:, 2] = 1.0
    u_r, u_c = normalise(u)
    return Stratification(u=u, u_r=u_r, u_c=u_c, losses=torch.zeros(3, 10, 1), score="prob-auc",
                          samples=torch.rand(3, 10, 2, 1, 28, 28, generator=torch.Generator().manual_seed(1)))


class _Unchecked(fedhydra_module.FedHydra):
    """The robust recipe without expel (and so without the peer check): the teacher's U is MS's own."""

    @property
    def recipe(self):
        return dataclasses.replace(fedhydra_module.RECIPES["robust"], expel=False)


def _captured_teacher(tmp_path, monkeypatch, overrides, cls=None):
    """Run FedHydra's fuse with MS replaced by a fixed U and the KD loop replaced by a spy."""
    strategy = build_strategy(from_run_config(merge_overrides({**BASE, **overrides})), run_dir=tmp_path / "run",
                              cls=cls)
    fixed = _fixed_stratification()
    calls = {}

    def fake_stratify(ensemble, ctx):
        calls["ms"] = True
        return fixed
    monkeypatch.setattr(strategy, "stratify", fake_stratify)

    def spy_distill(student, synthesizer, pool, settings, evaluate, **kw):
        calls["teacher"], calls["student"], calls["settings"] = synthesizer.teacher, student, settings
        x = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
        aggregator = synthesizer.teacher.aggregator
        calls["start"] = aggregator.calibration.stats if getattr(aggregator, "adapts", False) else None
        with torch.no_grad():  # the ensemble's hooks are removed when fuse ends: probe it now
            images = fixed.samples.reshape(-1, *fixed.samples.shape[3:])  # MS's images, every client's
            calls["ms_tops"] = torch.stack([m(images) for m in synthesizer.teacher.ensemble.models]).amax(dim=2)
            calls["probe"] = (synthesizer.teacher.predict(x),
                              torch.stack([m(x) for m in synthesizer.teacher.ensemble.models]))
        batch = synthesizer.synthesize()  # one real batch, for the run's sample grid
        pool.add(batch.images, batch.labels, batch.teacher_logits)
        return [{"epoch": 1, "accuracy": 0.1}], 0
    monkeypatch.setattr(datafree, "distill", spy_distill)
    strategy.ctx.run_dir.mkdir(parents=True)  # serve() makes it once the quorum is met; fuse is called directly
    strategy.fuse(_uploads(), strategy.ctx)
    calls["strategy"] = strategy
    return calls, fixed


def test_robust_fedhydra_distils_from_the_calibrated_class_routed_sa_teacher(tmp_path, monkeypatch, mnist_dir):
    calls, fixed = _captured_teacher(tmp_path, monkeypatch, {}, cls=_Unchecked)
    aggregator = calls["teacher"].aggregator
    assert calls["ms"] and isinstance(aggregator, StratifiedAggregation)
    assert (aggregator.space, aggregator.route) == ("calibrated", "class")
    assert torch.equal(aggregator.u_r, fixed.u_r) and torch.equal(aggregator.u_c, fixed.u_c)  # not swapped
    assert calls["settings"].beta == 1.0
    # the teacher starts from each client's mean and spread of its top logit over MS's images ...
    start, tops = calls["start"], calls["ms_tops"]
    assert torch.allclose(start.mean, tops.mean(1), atol=1e-5) and torch.allclose(start.spread, tops.std(1), atol=1e-5)
    # ... and on the first batch it is the SA of the clients' logits standardised by those, not the batch's own
    predicted, logits = calls["probe"]
    calibrated = (logits - start.mean[:, None, None]) / start.spread[:, None, None]
    assert torch.allclose(predicted, torch.einsum("ck,kbc->bc", fixed.u_r, calibrated), atol=1e-4)
    top = logits.amax(dim=2)
    per_batch = (logits - top.mean(1)[:, None, None]) / top.std(1)[:, None, None]
    assert not torch.allclose(predicted, torch.einsum("ck,kbc->bc", fixed.u_r, per_batch), atol=1e-3)
    assert not torch.allclose(predicted, torch.einsum("ck,kbc->bc", fixed.u_r, logits), atol=1e-3)  # raw logits
    assert not torch.allclose(predicted, logits.mean(0), atol=1e-3)  # a mean-logit teacher would not pass
    report = json.loads((tmp_path / "run" / "stratification.json").read_text())
    assert report["settings"]["sa_space"] == "calibrated" and "peer_check" not in report


def test_the_robust_recipe_teaches_with_the_u_weigh_computed(tmp_path, monkeypatch, mnist_dir):
    calls, fixed = _captured_teacher(tmp_path, monkeypatch, {})
    aggregator = calls["teacher"].aggregator
    ensemble = calls["teacher"].ensemble
    with ensemble.bn_paused():
        distributions = fedhydra_module.peer_distributions(ensemble.models, fixed.samples, torch.device("cpu"))
    expected = fedhydra_module.weigh(fixed.u, distributions, fedhydra_module.RECIPES["robust"])
    assert expected.check is not None
    assert torch.allclose(aggregator.u_r, expected.u_r) and torch.allclose(aggregator.u_c, expected.u_c)
    report = json.loads((tmp_path / "run" / "stratification.json").read_text())
    assert torch.allclose(torch.tensor(report["used_u_r"]), expected.u_r)
    assert report["settings"] == calls["strategy"].resolved_settings()


def test_a_strategy_class_must_be_the_methods_own_or_a_subclass_of_it(tmp_path, mnist_dir):
    from strategies.fedavg import FedAvg

    cfg = from_run_config(merge_overrides(BASE))
    with pytest.raises(TypeError, match="^FedAvg is not a FedHydra$"):
        build_strategy(cfg, run_dir=tmp_path / "a", cls=FedAvg)
    strategy = build_strategy(cfg, run_dir=tmp_path / "b", cls=_Unchecked)
    assert type(strategy) is _Unchecked and strategy.resolved_settings()["expel"] is False
    assert type(build_strategy(cfg, run_dir=tmp_path / "c")) is fedhydra_module.FedHydra


def test_bn_cap_reaches_the_teacher(tmp_path, monkeypatch, mnist_dir):
    calls, _ = _captured_teacher(tmp_path / "a", monkeypatch, {}, cls=_Unchecked)
    assert calls["teacher"].ensemble.bn_cap == 10.0  # the robust recipe's
    calls, _ = _captured_teacher(tmp_path / "c", monkeypatch, {"fedhydra.mode": "paper"})
    assert calls["teacher"].ensemble.bn_cap == 0.0


def test_paper_mode_and_beta_change_what_they_name(tmp_path, monkeypatch, mnist_dir):
    calls, fixed = _captured_teacher(tmp_path / "a", monkeypatch, {"fedhydra.mode": "paper"})
    agg = calls["teacher"].aggregator
    assert (agg.space, agg.route) == ("logits", "label") and torch.equal(agg.u_r, fixed.u_r)
    assert torch.equal(agg.u_c, fixed.u_c)
    calls, _ = _captured_teacher(tmp_path / "c", monkeypatch, {"fedhydra.beta": 0.25}, cls=_Unchecked)
    assert calls["settings"].beta == 0.25


@pytest.mark.parametrize("overrides, batch, score, stop, keep", [
    ({}, 16, "prob-auc", 0.01, fedhydra_module.PEER_SAMPLES),
    ({"fedhydra.mode": "paper"}, "synth", "paper", 0.0, 0),
])
def test_stratify_receives_the_recipes_ms_settings(tmp_path, monkeypatch, mnist_dir, overrides, batch, score, stop,
                                                   keep):
    strategy = build_strategy(from_run_config(merge_overrides({**BASE, "fedhydra.ms-steps": 3, **overrides})),
                              run_dir=tmp_path)
    seen = {}

    def spy(models, num_classes, spec, steps, batch, lr, seed, device, **kw):
        seen.update(steps=steps, batch=batch, **kw)
        return _fixed_stratification()
    monkeypatch.setattr(fedhydra_module, "stratify_sequential", spy)
    ensemble = ClientEnsemble([build("cnn2", (1, 28, 28), 10, seed=k) for k in range(3)], ["cnn2"] * 3)
    strategy.stratify(ensemble, strategy.ctx)
    synth = strategy.cfg.distill.synth_batch
    assert seen == {"steps": 3, "batch": synth if batch == "synth" else batch, "score": score, "stop_loss": stop,
                    "keep_samples": keep}


class _LabelSpy:
    needs_labels = True

    def __init__(self):
        self.labels = []

    def __call__(self, client_logits, labels=None):
        self.labels.append(labels)
        return client_logits.mean(0)


def test_synthetic_labels_reach_the_aggregator_and_the_student_is_frozen_then_restored():
    models = [build("cnn2", (1, 28, 28), 10, seed=k) for k in range(2)]
    spy = _LabelSpy()
    teacher = Teacher(ClientEnsemble(models, ["cnn2"] * 2), spy)
    student = build("cnn2", (1, 28, 28), 10, seed=9).train()
    synth = GeneratorSynthesizer(teacher, student, GeneratorSpec(8, 4, 28, 1), GeneratorLoss(), 10, 20, 2, 1e-3,
                                 seed=0, device=torch.device("cpu"))
    batch = synth.synthesize()
    assert spy.labels and all(lab is not None and torch.equal(lab, batch.labels) for lab in spy.labels)
    assert student.training and all(p.requires_grad for p in student.parameters())
    assert all(p.grad is None for p in student.parameters())  # the generator's loss never reached the student
    assert sorted(batch.labels.tolist()) == sorted(list(range(10)) * 2)  # balanced labels


def test_mean_logits_is_not_what_fedhydra_uses(tmp_path, monkeypatch, mnist_dir):
    calls, _ = _captured_teacher(tmp_path, monkeypatch, {})
    assert not isinstance(calls["teacher"].aggregator, MeanLogits)
    with pytest.raises(ValueError, match="route"):
        StratifiedAggregation(torch.ones(2, 2), torch.ones(2, 2), "logits", "nowhere")


def test_result_json_carries_the_methods_resolved_settings(tmp_path, mnist_dir):
    """result.json's `method_settings` is the strategy's resolved_settings(): {} for a method without a recipe, the
    subclass's own where one replaces them (FedHydra's recipe, a benchmark's variant)."""
    from strategies.fedavg import FedAvg
    from tests.strategies.test_fedavg import _reply

    class _Named(FedAvg):
        def resolved_settings(self):
            return {"recipe": "named", "steps": 3}

    for cls, expected in ((None, {}), (_Named, {"recipe": "named", "steps": 3})):
        run_dir = tmp_path / (cls.__name__ if cls else "plain")
        cfg = from_run_config(merge_overrides({"method": "fedavg", "preset": "smoke", "num-clients": 2}))
        strategy = build_strategy(cfg, run_dir=run_dir, cls=cls)
        strategy._sent = [1, 2]
        strategy.aggregate_train(1, [_reply(1), _reply(2, seed=1)])
        assert json.loads((run_dir / "result.json").read_text())["method_settings"] == expected
