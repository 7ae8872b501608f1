"""Co-Boosting's pieces by hand: the ensemble weight update, ODS, and the KD-loop options it uses."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from oneshot_fl.engine.distill import distill
from oneshot_fl.engine.ods import ods_perturb
from oneshot_fl.engine.pool import SyntheticPool
from oneshot_fl.engine.reweight import reweight_pass, reweight_step
from tests.conftest import FixedSource


def test_weight_update_by_hand():
    # client 1 votes class 0, client 2 class 1; the target is 0. With w = (0.5, 0.5):
    # ensemble = (1, 1), p = (.5, .5); dCE/dw_k = (p - y) . (f_k - ensemble) / sum(w) = -1 and +1
    logits = torch.tensor([[[2.0, 0.0]], [[0.0, 2.0]]])  # (m=2, b=1, c=2)
    labels = torch.tensor([0])
    w = torch.tensor([0.5, 0.5])
    w_var = w.clone().requires_grad_(True)
    F.cross_entropy((w_var[:, None, None] * logits).sum(0) / w_var.sum(), labels).backward()
    assert torch.allclose(w_var.grad, torch.tensor([-1.0, 1.0]))
    assert torch.allclose(reweight_step(w, w, logits, labels, step=0.01), torch.tensor([0.51, 0.49]))


def test_weight_update_clamps_to_unit_interval_and_to_one_around_the_pass_start():
    logits = torch.tensor([[[2.0, 0.0]], [[0.0, 2.0]]])
    labels = torch.tensor([0])
    # a huge step: +-1 around the start (0.5 -> [-0.5, 1.5]), then [0, 1]
    assert torch.allclose(reweight_step(torch.tensor([0.5, 0.5]), torch.tensor([0.5, 0.5]), logits, labels, 5.0),
                          torch.tensor([1.0, 0.0]))
    # one pass = one signed step per batch; the clamp is relative to the pass's start
    batches = [(logits, labels)] * 3
    assert torch.allclose(reweight_pass(torch.tensor([0.5, 0.5]), batches, 0.1), torch.tensor([0.8, 0.2]))


def test_ods_takes_one_signed_step_along_a_random_output_direction():
    weight = torch.tensor([[1.0, -2.0], [0.5, 0.0]])  # a linear "teacher": logits = x @ W^T
    teacher = lambda x: x @ weight.T  # noqa: E731
    x = torch.tensor([[0.2, 0.4]])
    rng = torch.Generator().manual_seed(3)
    out = ods_perturb(teacher, x, eps=0.1, rng=rng, temperature=4.0)
    # redo by hand with the same random direction
    direction = torch.rand((1, 2), generator=torch.Generator().manual_seed(3)) * 2 - 1
    x_var = x.clone().requires_grad_(True)
    (direction * F.softmax(teacher(x_var) / 4.0, dim=1)).sum().backward()
    assert torch.allclose(out, x + 0.1 * x_var.grad.sign())
    assert torch.allclose((out - x).abs(), torch.full_like(x, 0.1))


def _coboosting(tmp_path, **params):
    """A Co-Boosting strategy on a hand-made context (no data set, no Flower)."""
    import numpy as np

    from oneshot_fl.config import from_run_config, merge_overrides
    from oneshot_fl.data.datasets import Split
    from strategies.context import FuseContext
    from strategies.coboosting import CoBoosting

    flat = {"method": "coboosting", "preset": "smoke", "distill.epochs": 5,
            **{f"coboosting.{k.replace('_', '-')}": v for k, v in params.items()}}
    cfg = from_run_config(merge_overrides(flat))
    test = Split(np.zeros((4, 2, 2, 1), np.uint8), np.zeros(4, np.int64))
    ctx = FuseContext(cfg=cfg, device=torch.device("cpu"), num_classes=2, input_shape=(1, 2, 2), test=test,
                      run_dir=tmp_path)
    return CoBoosting(cfg, ctx), ctx


def test_coboosting_passes_its_kd_knobs_to_the_loop(tmp_path):
    strategy, _ = _coboosting(tmp_path, kd_temperature=2.5, weight_decay=0.03, lr_schedule="constant",
                              grad_clip=0.7)
    s = strategy.distill_settings()
    assert (s.temperature, s.weight_decay, s.lr_schedule, s.grad_clip) == (2.5, 0.03, "constant", 0.7)
    default = _coboosting(tmp_path / "d")[0].distill_settings()
    assert (default.temperature, default.weight_decay, default.lr_schedule, default.grad_clip) == (
        4.0, 1e-4, "cosine", 10.0)


def test_coboostings_clip_bounds_the_students_update_in_the_loop(tmp_path):
    strategy, _ = _coboosting(tmp_path, grad_clip=0.01, weight_decay=0.0)
    settings = dataclasses.replace(strategy.distill_settings(), epochs=1, momentum=0.0, lr=1.0)
    student = torch.nn.Linear(3, 2)
    before = torch.cat([p.detach().flatten().clone() for p in student.parameters()])
    source = FixedSource(torch.rand(4, 3), torch.tensor([[9.0, -9.0]] * 4))  # far from the student: big gradient
    distill(student, source, SyntheticPool("paper", 1, 1, 4), settings, lambda m: 0.5, seed=0)
    after = torch.cat([p.detach().flatten() for p in student.parameters()])
    assert float((after - before).norm()) == pytest.approx(0.01, rel=1e-4)  # lr 1 x clip 0.01


class _LinearTeacher:
    """Teacher stand-in: logits = x @ W^T; predict() is what Co-Boosting re-scores with."""

    weight = torch.tensor([[1.0, -2.0, 0.5], [0.5, 0.0, -1.0]])

    def __call__(self, x, labels=None):
        logits = x @ self.weight.T
        return logits, torch.zeros(()), logits[None]

    def predict(self, x, labels=None):
        return (x @ self.weight.T).detach() * 2.0  # distinguishable from the ODS forward


def test_kd_transform_perturbs_by_ods_eps_over_255_and_rescores_the_teacher(tmp_path):
    strategy, _ = _coboosting(tmp_path, ods_eps=8.0)
    strategy.teacher = _LinearTeacher()
    images, stale = torch.rand(5, 3), torch.zeros(5, 2)
    out, logits = strategy.perturb(images, stale, torch.Generator().manual_seed(0))
    assert torch.allclose((out - images).abs(), torch.full_like(images, 8.0 / 255.0), atol=1e-6)
    assert torch.allclose(logits, _LinearTeacher().predict(out))  # the teacher on what the student sees
    off, _ = _coboosting(tmp_path / "off", ods_eps=0.0)
    off.teacher = _LinearTeacher()
    same, logits = off.perturb(images, stale, torch.Generator().manual_seed(0))
    assert torch.equal(same, images) and torch.allclose(logits, _LinearTeacher().predict(images))


class _Ensemble:
    """Two frozen clients: client 0 votes class 0, client 1 votes class 1, on every image."""

    calls = 0

    def __len__(self):
        return 2

    def logits(self, x):
        _Ensemble.calls += 1
        return torch.tensor([[2.0, 0.0], [0.0, 2.0]])[:, None, :].expand(2, len(x), 2).clone()


class _Pool:
    def __init__(self, labels):
        self.images = [torch.zeros(len(labels), 1, 2, 2)]
        self.labels = [torch.tensor(labels)]


def test_reweighting_starts_at_epoch_two_with_a_decaying_signed_step(tmp_path):
    strategy, ctx = _coboosting(tmp_path, mu=0.01, mu_decay=0.9)
    strategy.make_aggregator(_Ensemble(), [], ctx)
    strategy.teacher = _LinearTeacher()
    strategy.pool = _Pool([0, 0, 0])  # the generator's targets: class 0, client 0's vote
    assert strategy.aggregator.weights.tolist() == [0.5, 0.5]
    strategy.before_epoch(1)
    assert strategy.aggregator.weights.tolist() == [0.5, 0.5]  # Co-Boosting starts at its second epoch
    _Ensemble.calls = 0
    strategy.before_epoch(2)
    step2 = 0.01 * 0.9  # mu * decay^(epoch - 1)
    assert torch.allclose(strategy.aggregator.weights, torch.tensor([0.5 + step2, 0.5 - step2]))
    strategy.before_epoch(3)
    step3 = 0.01 * 0.9 ** 2
    assert torch.allclose(strategy.aggregator.weights,
                          torch.tensor([0.5 + step2 + step3, 0.5 - step2 - step3]))
    assert _Ensemble.calls == 1  # the clients' logits of a stored pool batch are computed once
    assert [h["epoch"] for h in strategy.weight_history] == [0, 2, 3]
    assert strategy.weight_history[1]["weights"] == pytest.approx([0.5 + step2, 0.5 - step2])


def test_reweight_passes_zero_keeps_the_uniform_ensemble(tmp_path):
    strategy, ctx = _coboosting(tmp_path, reweight_passes=0)
    strategy.make_aggregator(_Ensemble(), [], ctx)
    strategy.pool = _Pool([0, 0])
    for epoch in (1, 2, 3):
        strategy.before_epoch(epoch)
    assert strategy.aggregator.weights.tolist() == [0.5, 0.5]
    two, ctx2 = _coboosting(tmp_path / "two", reweight_passes=2, mu=0.01, mu_decay=1.0)
    two.make_aggregator(_Ensemble(), [], ctx2)
    two.pool = _Pool([0, 0])
    two.before_epoch(1)
    two.before_epoch(2)
    assert torch.allclose(two.aggregator.weights, torch.tensor([0.52, 0.48]))  # two passes, one step each
