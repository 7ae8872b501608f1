"""Decoder synthesis (quota arithmetic, generation, filtering) and the fusion loss pieces."""

import warnings
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from oneshot_fl.engine.decoders import (DecoderSynthesizer, generate, histogram_plan, nearest_to_class_mean,
                                        split_quota, squared_plan)
from oneshot_fl.engine.losses import kd_loss
from oneshot_fl.engine.supervised import SupervisedSettings, precompute_logits, train_on_synthetic
from oneshot_fl.models.cvae import build_decoder

MNIST = (1, 28, 28)


# --- quota arithmetic ----------------------------------------------------------------------------

def test_split_quota_exact_sums_to_the_quota_and_floor_matches_the_code():
    weights = np.array([1.0, 1.0, 1.0])
    assert split_quota(10, weights).tolist() == [4, 3, 3]  # largest remainder, ties to the first
    assert split_quota(10, weights, "floor").tolist() == [3, 3, 3]  # FedMHO code: floor(w * n)
    assert split_quota(600, np.array([9.0, 1.0])).tolist() == [540, 60]
    with pytest.raises(ValueError):
        split_quota(10, np.zeros(3))


def test_squared_shares_against_a_hand_computed_example():
    counts = np.array([[30, 0, 5],
                       [10, 0, 5],
                       [0, 0, 0]])
    plan = squared_plan(counts, total=300)  # 100 per class
    # class 0: 900 / 1000 and 100 / 1000; class 2: equal; class 1 is held by nobody -> uniform
    assert plan[:, 0].tolist() == [90, 10, 0]
    assert plan[:, 2].tolist() == [50, 50, 0]
    assert plan[:, 1].tolist() == [34, 33, 33]
    assert squared_plan(counts, 300, absent="skip")[:, 1].tolist() == [0, 0, 0]


@pytest.mark.parametrize("seed", range(5))
def test_squared_shares_sum_to_the_per_class_quota(seed):
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 50, size=(5, 10)) * (rng.random((5, 10)) < 0.6)
    plan = squared_plan(counts, total=6000)
    assert (plan.sum(axis=0) == 600).all() and plan.sum() == 6000
    held = counts.sum(axis=0) > 0
    assert (plan[counts == 0][np.broadcast_to(held, counts.shape)[counts == 0]] == 0).all()  # no share w/o data
    floor = squared_plan(counts, total=6000, rounding="floor")
    assert (floor <= plan).all() and (plan.sum(axis=0) - floor.sum(axis=0) < 5).all()
    skip = squared_plan(counts, total=6000, absent="skip")
    assert (skip.sum(axis=0) == np.where(held, 600, 0)).all()


def test_histogram_plan_splits_by_data_size_then_by_each_histogram():
    counts = np.array([[30, 10, 0], [0, 0, 60]])
    plan = histogram_plan(counts, total=100)
    assert plan.tolist() == [[30, 10, 0], [0, 0, 60]]
    assert histogram_plan(counts, total=7).sum() == 7


def test_plans_refuse_bad_counts():
    with pytest.raises(ValueError, match="non-negative integers"):
        squared_plan(np.array([[1.5, 2.0]]), 10)
    with pytest.raises(ValueError, match="non-negative integers"):
        squared_plan(np.array([[-1, 2]]), 10)


# --- generation and filtering --------------------------------------------------------------------

def decoders(k=2, latent=2):
    out = []
    for i in range(k):
        torch.manual_seed(i)
        out.append(build_decoder("cvae-mlp", MNIST, 10, latent))
    return out


def test_generation_follows_the_plan_and_is_seeded():
    plan = np.zeros((2, 10), dtype=np.int64)
    plan[0, 3], plan[1, 3], plan[1, 7] = 4, 2, 5
    a = generate(decoders(), plan, seed=1, device=torch.device("cpu"), batch_size=3)
    assert a.images.shape == (11, 1, 28, 28) and 0 <= float(a.images.min()) and float(a.images.max()) <= 1
    pairs = sorted(zip(a.sources.tolist(), a.labels.tolist()))
    assert pairs == [(0, 3)] * 4 + [(1, 3)] * 2 + [(1, 7)] * 5
    b = generate(decoders(), plan, seed=1, device=torch.device("cpu"))
    c = generate(decoders(), plan, seed=2, device=torch.device("cpu"))
    assert torch.allclose(a.images, b.images, atol=1e-6)  # same draws whatever the batch size
    assert not torch.allclose(a.images, c.images, atol=1e-3)


def test_filter_keeps_the_right_fraction_and_the_nearest_samples():
    torch.manual_seed(0)
    # class 0: 8 samples near 0 and 2 far outliers; class 1: 5 samples at distances 1..5 from their mean
    near = torch.rand(8, 1, 2, 2) * 0.01
    far = torch.ones(2, 1, 2, 2)
    ramp = torch.arange(1, 6, dtype=torch.float32).view(5, 1, 1, 1).expand(5, 1, 2, 2) * 0.1
    images = torch.cat([near, far, ramp])
    labels = torch.tensor([0] * 10 + [1] * 5)
    kept = nearest_to_class_mean(images, labels, 0.8)
    assert (labels[kept] == 0).sum() == 8 and (labels[kept] == 1).sum() == 4  # int(0.8 * n)
    assert set(kept.tolist()) >= set(range(8))  # the outliers of class 0 are the ones dropped
    assert 13 in kept.tolist() and 12 in kept.tolist() and 11 in kept.tolist()  # mean of the ramp is 0.3
    assert len(nearest_to_class_mean(images, labels, 1.0)) == 15


def test_synthesizer_draws_the_plan_and_drops_one_fifth():
    counts = np.array([[50] * 10, [10] * 10])
    synthesizer = DecoderSynthesizer(decoders(), counts, total=200, keep_ratio=0.8, seed=0)
    kept, dropped = synthesizer.synthesize()
    assert synthesizer.plan.sum() == 200 and len(kept) == 160 and len(dropped) == 40
    assert np.bincount(kept.labels.numpy(), minlength=10).tolist() == [16] * 10


# --- fusion loss pieces ---------------------------------------------------------------------------

def test_kd_reduction_mean_is_batchmean_over_classes():
    torch.manual_seed(0)
    student, teacher = torch.randn(4, 5), torch.randn(4, 5)
    reference = F.kl_div(F.log_softmax(student, 1), F.softmax(teacher, 1), reduction="batchmean")
    assert kd_loss(student, teacher, reduction="batchmean").item() == pytest.approx(reference.item(), rel=1e-5)
    with warnings.catch_warnings():  # PyTorch warns that 'mean' is not the KL; that is the point here
        warnings.simplefilter("ignore")
        code = F.kl_div(F.log_softmax(student, 1), F.softmax(teacher, 1))  # KLDivLoss() default: element mean
    assert kd_loss(student, teacher, reduction="mean").item() == pytest.approx(code.item(), rel=1e-5)
    with pytest.raises(ValueError, match="batchmean"):
        kd_loss(student, teacher, reduction="sum")


def test_supervised_loss_is_ce_plus_weighted_kd():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    teacher = torch.randn(8, 3)
    settings = SupervisedSettings(epochs=1, lr=1e-9, batch_size=8, ce_weight=0.5, kd_weight=2.0,
                                  kd_reduction="batchmean")
    with torch.no_grad():
        logits = model(x)
        expected = 0.5 * F.cross_entropy(logits, y) + 2.0 * kd_loss(logits, teacher, reduction="batchmean")
    history = train_on_synthetic(model, x, y, teacher, settings, evaluate=lambda m: 0.5, seed=0)
    assert history[0]["loss"] == pytest.approx(expected.item(), rel=1e-4)
    assert history[0]["accuracy"] == 0.5
    plain = train_on_synthetic(torch.nn.Linear(4, 3), x, y, None, settings, evaluate=None, seed=0)
    assert plain[0]["kd"] == 0.0


def test_precomputed_teacher_logits_match_a_direct_forward():
    model = torch.nn.Linear(4, 3).eval()
    x = torch.randn(10, 4)
    assert torch.allclose(precompute_logits(model, x, torch.device("cpu"), batch_size=3), model(x).detach())


def test_training_on_nothing_is_a_clear_error():
    with pytest.raises(ValueError, match="no synthetic samples"):
        train_on_synthetic(torch.nn.Linear(4, 3), torch.empty(0, 4), torch.empty(0, dtype=torch.long), None,
                           SupervisedSettings(epochs=1, lr=1e-3), None, seed=0)
