"""FedHydra's wiring: the teacher it distils from is the stratified one with the U it computed (rows =
classes, columns = clients), the synthetic labels reach a label-routed SA, the knobs change what they
name, and the student is frozen during generator steps and restored after."""

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


def _captured_teacher(tmp_path, monkeypatch, overrides):
    """Run FedHydra's fuse with MS replaced by a fixed U and the KD loop replaced by a spy."""
    strategy = build_strategy(from_run_config(merge_overrides({**BASE, **overrides})), run_dir=tmp_path / "run")
    fixed = _fixed_stratification()
    calls = {}

    def fake_stratify(ensemble, ctx):
        calls["ms"] = True
        return fixed
    monkeypatch.setattr(strategy, "stratify", fake_stratify)

    def spy_distill(student, synthesizer, pool, settings, evaluate, **kw):
        calls["teacher"], calls["student"], calls["settings"] = synthesizer.teacher, student, settings
        x = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():  # the ensemble's hooks are removed when fuse ends: probe it now
            calls["probe"] = (synthesizer.teacher.predict(x),
                              torch.stack([m(x) for m in synthesizer.teacher.ensemble.models]))
        batch = synthesizer.synthesize()  # one real batch, for the run's sample grid
        pool.add(batch.images, batch.labels, batch.teacher_logits)
        return [{"epoch": 1, "accuracy": 0.1}], 0
    monkeypatch.setattr(datafree, "distill", spy_distill)
    strategy.ctx.run_dir.mkdir(parents=True)  # serve() makes it once the quorum is met; fuse is called directly
    strategy.fuse(_uploads(), strategy.ctx)
    return calls, fixed


def test_robust_fedhydra_distils_from_the_calibrated_class_routed_sa_teacher(tmp_path, monkeypatch, mnist_dir):
    calls, fixed = _captured_teacher(tmp_path, monkeypatch, {"fedhydra.peer-check": "off"})
    aggregator = calls["teacher"].aggregator
    assert (aggregator.space, aggregator.route, aggregator.scales) == ("calibrated", "class", None)
    assert torch.equal(aggregator.u_r, fixed.u_r) and torch.equal(aggregator.u_c, fixed.u_c)  # not swapped
    # on a known batch the teacher is the SA of the clients' logits, each standardised by its top logit's
    # mean and spread over the batch
    predicted, logits = calls["probe"]
    top = logits.amax(dim=2)
    calibrated = (logits - top.mean(1)[:, None, None]) / top.std(1)[:, None, None]
    assert torch.allclose(predicted, torch.einsum("ck,kbc->bc", fixed.u_r, calibrated), atol=1e-4)
    assert not torch.allclose(predicted, torch.einsum("ck,kbc->bc", fixed.u_r, logits), atol=1e-3)  # raw logits
    report = json.loads((tmp_path / "run" / "stratification.json").read_text())
    assert report["settings"]["sa_space"] == "calibrated" and report["logit_divisors"] is None


def test_capped_fedhydra_distils_from_the_class_routed_sa_teacher_with_its_own_u(tmp_path, monkeypatch, mnist_dir):
    calls, fixed = _captured_teacher(tmp_path, monkeypatch,
                                     {"fedhydra.peer-check": "off", "fedhydra.sa-space": "capped"})
    aggregator = calls["teacher"].aggregator
    assert calls["ms"] and isinstance(aggregator, StratifiedAggregation)
    assert (aggregator.space, aggregator.route) == ("capped", "class")
    assert torch.equal(aggregator.u_r, fixed.u_r) and torch.equal(aggregator.u_c, fixed.u_c)  # not swapped
    assert calls["settings"].beta == 1.0
    # the logit caps come from MS's kept images: each client's mean logit std there over the median's,
    # clients below the median left alone
    models = calls["teacher"].ensemble.models
    with torch.no_grad():
        spread = torch.stack([m(fixed.samples.flatten(0, 2)).std(dim=1).mean() for m in models])
    assert aggregator.scales.tolist() == pytest.approx((spread / spread.median()).clamp_min(1.0).tolist(), rel=1e-5)
    assert sorted(aggregator.scales.tolist())[:2] == [1.0, 1.0] and aggregator.scales.max() > 1.0
    report = json.loads((tmp_path / "run" / "stratification.json").read_text())
    assert report["logit_divisors"] == pytest.approx(aggregator.scales.tolist())
    loud = int(aggregator.scales.argmax())
    assert f"divided down to it (upload index, divisor): [({loud}, " in report["server_action"]
    # on a known input the teacher is the SA of the clients' capped logits, not their mean
    predicted, logits = calls["probe"]
    by_hand = torch.einsum("ck,kbc->bc", fixed.u_r, logits / aggregator.scales[:, None, None])
    assert torch.allclose(predicted, by_hand, atol=1e-5)
    assert not torch.allclose(predicted, logits.mean(0), atol=1e-3)  # a mean-logit teacher would not pass
    uncalibrated = torch.einsum("ck,kbc->bc", fixed.u_r, logits)
    assert not torch.allclose(predicted, uncalibrated, atol=1e-3)  # nor one that skips the calibration


def test_logit_cap_and_bn_cap_reach_the_teacher(tmp_path, monkeypatch, mnist_dir):
    capped = {"fedhydra.peer-check": "off", "fedhydra.sa-space": "capped"}
    calls, _ = _captured_teacher(tmp_path / "a", monkeypatch, capped)
    assert calls["teacher"].ensemble.bn_cap == 10.0  # the robust mode's
    default_scales = calls["teacher"].aggregator.scales
    calls, _ = _captured_teacher(tmp_path / "b", monkeypatch, {**capped, "fedhydra.logit-cap": 2.0,
                                                               "fedhydra.bn-cap": 4.0})
    assert calls["teacher"].ensemble.bn_cap == 4.0
    # max(1, r / 2) = max(1, (max(1, r) / 2)) for the same MS images
    assert calls["teacher"].aggregator.scales.tolist() == pytest.approx((default_scales / 2).clamp_min(1.0).tolist())
    calls, _ = _captured_teacher(tmp_path / "c", monkeypatch, {"fedhydra.mode": "paper"})
    assert calls["teacher"].ensemble.bn_cap == 0.0


def test_robust_knobs_select_probability_space(tmp_path, monkeypatch, mnist_dir):
    calls, fixed = _captured_teacher(tmp_path, monkeypatch,
                                     {"fedhydra.peer-check": "off", "fedhydra.sa-space": "probs"})
    aggregator = calls["teacher"].aggregator
    assert (aggregator.space, aggregator.route, aggregator.scales) == ("probs", "class", None)
    predicted, logits = calls["probe"]
    by_hand = torch.einsum("ck,kbc->bc", fixed.u_r, torch.softmax(logits, 2))
    by_hand = torch.log(by_hand / by_hand.sum(1, keepdim=True) + 1e-12)
    assert torch.allclose(predicted, by_hand, atol=1e-5)


def test_paper_mode_and_single_knobs_change_what_they_name(tmp_path, monkeypatch, mnist_dir):
    calls, fixed = _captured_teacher(tmp_path / "a", monkeypatch, {"fedhydra.mode": "paper"})
    agg = calls["teacher"].aggregator
    assert (agg.space, agg.route) == ("logits", "label") and torch.equal(agg.u_r, fixed.u_r)
    calls, _ = _captured_teacher(tmp_path / "b", monkeypatch, {"fedhydra.mode": "paper", "fedhydra.sa-space": "probs"})
    assert (calls["teacher"].aggregator.space, calls["teacher"].aggregator.route) == ("probs", "label")
    calls, _ = _captured_teacher(tmp_path / "c", monkeypatch, {"fedhydra.beta": 0.25, "fedhydra.peer-check": "off"})
    assert calls["settings"].beta == 0.25


def test_stratify_receives_the_ms_knobs(tmp_path, monkeypatch, mnist_dir):
    strategy = build_strategy(from_run_config(merge_overrides({**BASE, "fedhydra.ms-batch": 7, "fedhydra.ms-steps": 3,
                                                               "fedhydra.ms-stop-loss": 0.5})), run_dir=tmp_path)
    seen = {}

    def spy(models, num_classes, spec, steps, batch, lr, seed, device, **kw):
        seen.update(steps=steps, batch=batch, **kw)
        return _fixed_stratification()
    monkeypatch.setattr(fedhydra_module, "stratify_sequential", spy)
    ensemble = ClientEnsemble([build("cnn2", (1, 28, 28), 10, seed=k) for k in range(3)], ["cnn2"] * 3)
    strategy.stratify(ensemble, strategy.ctx)
    assert seen == {"steps": 3, "batch": 7, "score": "prob-auc", "stop_loss": 0.5,
                    "keep_samples": fedhydra_module.PEER_SAMPLES}


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
        StratifiedAggregation(torch.ones(2, 2), torch.ones(2, 2), "probs", "nowhere")
