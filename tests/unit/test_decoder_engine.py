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


# --- FedMHO's quota and filter against numbers worked out by hand ----------------------------------------------

def test_squared_quota_hand_computed_for_three_decoders():
    # 3 decoders, 4 classes, N_syn = 407 -> floor(407 / 4) = 101 samples per class (FedMHO code: int(N / C); not
    # round(101.75) = 102).
    counts = np.array([[3, 1, 0, 5],
                       [4, 1, 7, 0],
                       [0, 2, 0, 0]])
    # class 0: squares 9, 16, 0 -> shares 9/25, 16/25 -> 36.36, 64.64 -> floors 36, 64 (100), the larger remainder
    #          (.64) gets the 101st sample -> 36, 65, 0
    # class 1: squares 1, 1, 4 -> 16.83, 16.83, 67.33 -> floors 16, 16, 67 (99); remainders .83, .83, .33 -> the two
    #          largest (a tie: lower index first) -> 17, 17, 67
    # class 2: only decoder 1 holds it -> 0, 101, 0;  class 3: only decoder 0 -> 101, 0, 0
    plan = squared_plan(counts, total=407)
    assert plan.T.tolist() == [[36, 65, 0], [17, 17, 67], [0, 101, 0], [101, 0, 0]]
    # the code's rounding: floor(share * 101) per decoder, a few short of the quota
    assert squared_plan(counts, total=407, rounding="floor").T.tolist() == [[36, 64, 0], [16, 16, 67], [0, 101, 0],
                                                                              [101, 0, 0]]
    # linear shares (the FedCVAE-Ens reading) would give class 0 40, 61 and class 1 25, 25, 51: not these


def test_histogram_plan_hand_computed():
    # decoder totals by data size (8 : 2 of 100), then each decoder's classes by its own histogram
    counts = np.array([[6, 2, 0], [0, 1, 1]])
    assert histogram_plan(counts, total=100).tolist() == [[60, 20, 0], [0, 10, 10]]


def test_nearest_filter_hand_computed_distances():
    def images(values):  # one image per row of pixel values
        return torch.tensor(values, dtype=torch.float64).view(len(values), 1, 1, -1)

    # class 0, one pixel: 0, 2, 3, 9, 10 x 6 -> mean 74 / 10 = 7.4; distances 7.4, 5.4, 4.4, 1.6, 2.6 (x 6);
    #          keep int(0.8 * 10) = 8 -> drop the 0 and the 2 (indices 0, 1)
    a = [[0.0], [2.0], [3.0], [9.0]] + [[10.0]] * 6
    # class 1: 1.0 1.1 1.2 1.3 1.4 1.5 8.0 -> mean 16.5 / 7 = 2.357; distances 1.357 1.257 1.157 1.057 0.957 0.857
    #          5.643; keep int(0.8 * 7) = int(5.6) = 5 (not round: 6) -> drop 1.0 and 8.0 (indices 10, 16)
    b = [[1.0], [1.1], [1.2], [1.3], [1.4], [1.5], [8.0]]
    kept = nearest_to_class_mean(images(a + b), torch.tensor([0] * 10 + [1] * 7), 0.8)
    assert sorted(set(range(17)) - set(kept.tolist())) == [0, 1, 10, 16]
    # class 2, two pixels (Euclidean over the flattened image, not L1 or one pixel): points (2.9, 0), (-2, 2),
    # (-2, -2), (1.1, 0) have mean (0, 0); L2 distances 2.9, 2.83, 2.83, 1.1 (L1 would be 2.9, 4, 4, 1.1);
    # keep int(0.8 * 4) = 3 -> drop (2.9, 0), index 0
    c = [[2.9, 0.0], [-2.0, 2.0], [-2.0, -2.0], [1.1, 0.0]]
    kept = nearest_to_class_mean(images(c), torch.tensor([2] * 4), 0.8)
    assert kept.tolist() == [1, 2, 3]
    # class 3: 0 2 5 6 9 -> mean 4.4 (the centre of k-means with k = 1; the median, 5, would drop the 0 instead);
    # distances 4.4 2.4 0.6 1.6 4.6 -> keep 4 -> drop the 9
    kept = nearest_to_class_mean(images([[0.0], [2.0], [5.0], [6.0], [9.0]]), torch.tensor([3] * 5), 0.8)
    assert kept.tolist() == [0, 1, 2, 3]


def test_the_synthesizer_keeps_r_th_of_each_class_of_the_quota():
    # 2 decoders, N_syn = 60 -> 6 per class; R_th = 0.8 -> int(4.8) = 4 kept per class, 40 in all (FedMHO MNIST:
    # 6,000 -> 600 per class -> 480 kept, 4,800)
    counts = np.array([[2, 0, 1, 1, 1, 1, 1, 1, 1, 1], [1, 3, 1, 1, 1, 1, 1, 1, 1, 1]])
    synthesizer = DecoderSynthesizer(decoders(), counts, total=60, keep_ratio=0.8, seed=3)
    assert synthesizer.plan[:, 0].tolist() == [5, 1]  # squares 4 : 1 of 6 -> 4.8, 1.2 -> 5, 1
    assert synthesizer.plan[:, 1].tolist() == [0, 6]
    kept, dropped = synthesizer.synthesize()
    assert np.bincount(kept.labels.numpy(), minlength=10).tolist() == [4] * 10 and len(dropped) == 20


def test_pictures_take_each_decoder_in_turn():
    from oneshot_fl.engine.decoders import SyntheticSet, spread_by_source

    labels = torch.tensor([0, 0, 0, 0, 1, 1, 0])
    sources = torch.tensor([0, 0, 0, 1, 1, 1, 2])
    synthetic = SyntheticSet(torch.zeros(7, 1, 2, 2), labels, sources)
    assert spread_by_source(synthetic, 4).tolist() == [0, 3, 6, 1, 4, 5]
    assert spread_by_source(synthetic, 1).tolist() == [0, 4]


# --- the real-data scorer of decoder samples -------------------------------------------------------------------

class _Fixed(torch.nn.Module):
    """Predicts the class written in the first pixel."""

    def __init__(self):
        super().__init__()
        self.dummy = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return F.one_hot(x.flatten(1)[:, 0].long(), 3).float()


def test_score_samples_counts_hits_per_class():
    from oneshot_fl.engine.supervised import score_samples

    predicted = torch.tensor([0, 0, 1, 2, 2, 1], dtype=torch.float32).view(6, 1, 1, 1)
    labels = torch.tensor([0, 0, 1, 1, 1, 1])
    result = score_samples(_Fixed(), predicted, labels, 3, batch_size=4)
    # class 0: 2 of 2; class 1: 2 of 4 (the 1 at index 2 and 5); class 2: no sample
    assert result == {"accuracy": round(4 / 6, 4), "per_class": [1.0, 0.5, None]}
    assert score_samples(_Fixed(), torch.empty(0, 1, 1, 1), torch.empty(0, dtype=torch.long), 3) == \
        {"accuracy": None, "per_class": [None] * 3}


def test_the_sample_scorer_learns_real_classes_and_reports_its_held_out_accuracy():
    from oneshot_fl.engine.supervised import fit_sample_scorer

    torch.manual_seed(0)
    labels = torch.arange(2).repeat(100)
    images = torch.rand(200, 1, 28, 28) * 0.2
    images[labels == 1, :, :14] += 0.7  # class 1: a bright top half
    model, about = fit_sample_scorer(images, labels, 10, seed=5)
    assert about["fitted_on"] == 100 and about["held_out_accuracy"] >= 0.95
    assert not model.training


def test_fusion_with_dropout_is_reproducible_and_leaves_the_global_generator_alone():
    def trained(seed):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5),
                                    torch.nn.Linear(16, 3))
        torch.manual_seed(1234 + seed)  # whatever the caller's generator holds, the training is the seed's
        train_on_synthetic(model, x, y, None, SupervisedSettings(epochs=2, lr=1e-2, batch_size=4), None, seed=7)
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
    assert torch.equal(trained(0), trained(1))
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Dropout(0.5))
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    train_on_synthetic(model, x, y, None, SupervisedSettings(epochs=1, lr=1e-2, batch_size=4), None, seed=7)
    assert torch.equal(torch.rand(3), expected)
