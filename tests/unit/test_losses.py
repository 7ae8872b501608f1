"""The data-free methods' losses (engine/losses.py) and the BN-statistics loss (engine/hooks.py)
pinned to values worked out with plain formulas (math.exp / math.log on Python floats), never by
calling the function under test."""

import math

import pytest
import torch
from torch import nn

from oneshot_fl.engine.hooks import BNStatsLoss, bn_stats_loss
from oneshot_fl.engine.losses import adversarial_loss, hard_label_ce, kd_loss, kl_per_sample


def softmax(row, t=1.0):
    e = [math.exp(v / t) for v in row]
    return [v / sum(e) for v in e]


def kl(p_row, q_row, t=1.0):
    """KL(softmax(p/t) || softmax(q/t)) by the formula sum_j p_j log(p_j / q_j)."""
    p, q = softmax(p_row, t), softmax(q_row, t)
    return sum(pj * math.log(pj / qj) for pj, qj in zip(p, q))


# teacher / student rows: row 0 agrees (both argmax 0), row 1 disagrees (teacher 2, student 1)
TEACHER = [[2.0, 0.0, -1.0], [0.0, 1.0, 3.0]]
STUDENT = [[1.0, 0.5, 0.0], [0.0, 2.0, 1.0]]
T_, S_ = torch.tensor(TEACHER), torch.tensor(STUDENT)


def test_kl_per_sample_of_a_quarter_three_quarters_teacher_against_a_uniform_student():
    # softmax([0, ln 3]) = (1/4, 3/4); the student is uniform (1/2, 1/2)
    out = kl_per_sample(torch.tensor([[0.0, math.log(3.0)]]), torch.zeros(1, 2))
    expected = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)  # = 0.1308...
    assert out.shape == (1,)
    assert out.item() == pytest.approx(expected, abs=1e-6)
    assert expected == pytest.approx(0.130812, abs=1e-6)


def test_kl_per_sample_is_teacher_to_student_row_by_row_at_temperature():
    for t in (1.0, 2.5):
        out = kl_per_sample(T_, S_, temperature=t)
        assert out.tolist() == pytest.approx([kl(TEACHER[0], STUDENT[0], t), kl(TEACHER[1], STUDENT[1], t)], abs=1e-6)
    # KL is not symmetric: swapping teacher and student changes the value
    assert kl_per_sample(S_, T_)[1].item() != pytest.approx(kl_per_sample(T_, S_)[1].item(), abs=1e-3)


def test_kd_loss_batchmean_is_the_row_mean_times_t_squared():
    for t in (1.0, 3.0):
        expected = t * t * (kl(TEACHER[0], STUDENT[0], t) + kl(TEACHER[1], STUDENT[1], t)) / 2
        # argument order: kd_loss(student, teacher)
        assert kd_loss(S_, T_, temperature=t).item() == pytest.approx(expected, abs=1e-6)
        assert kd_loss(S_, T_, temperature=t, reduction="batchmean").item() == pytest.approx(expected, abs=1e-6)


def test_kd_loss_mean_divides_batchmean_by_the_number_of_classes():
    t = 2.0
    expected = t * t * (kl(TEACHER[0], STUDENT[0], t) + kl(TEACHER[1], STUDENT[1], t)) / 2 / 3
    assert kd_loss(S_, T_, temperature=t, reduction="mean").item() == pytest.approx(expected, abs=1e-6)


def test_kd_loss_refuses_an_unknown_reduction():
    with pytest.raises(ValueError, match="kd reduction 'sum': use batchmean or mean"):
        kd_loss(S_, T_, reduction="sum")


def test_kd_loss_gradient_at_t_one_is_student_softmax_minus_teacher_softmax_over_b():
    student = S_.clone().requires_grad_(True)
    kd_loss(student, T_).backward()
    expected = [[(q - p) / 2 for p, q in zip(softmax(t_row), softmax(s_row))] for t_row, s_row in zip(TEACHER, STUDENT)]
    assert torch.allclose(student.grad, torch.tensor(expected), atol=1e-6)


@pytest.mark.parametrize("t", [1.0, 3.0])
def test_adversarial_loss_masks_and_t_squared(t):
    kl0, kl1 = kl(TEACHER[0], STUDENT[0], t), kl(TEACHER[1], STUDENT[1], t)
    # masked rows count 0 but stay in the batch mean (divide by 2, not by the rows kept)
    assert adversarial_loss(T_, S_, "none", t).item() == pytest.approx(-t * t * (kl0 + kl1) / 2, abs=1e-6)
    assert adversarial_loss(T_, S_, "disagree", t).item() == pytest.approx(-t * t * kl1 / 2, abs=1e-6)
    assert adversarial_loss(T_, S_, "agree", t).item() == pytest.approx(-t * t * kl0 / 2, abs=1e-6)


def test_adversarial_loss_default_is_unmasked_at_t_one():
    kl0, kl1 = kl(TEACHER[0], STUDENT[0]), kl(TEACHER[1], STUDENT[1])
    assert adversarial_loss(T_, S_).item() == pytest.approx(-(kl0 + kl1) / 2, abs=1e-6)


def test_hard_label_ce_uses_the_teachers_argmax_as_the_label():
    # labels: argmax of the teacher rows = (0, 2); CE = mean of -log softmax(student)[label]
    expected = -(math.log(softmax(STUDENT[0])[0]) + math.log(softmax(STUDENT[1])[2])) / 2
    assert hard_label_ce(S_, T_).item() == pytest.approx(expected, abs=1e-6)
    # the student's own argmax (0, 1) would give another value
    assert expected != pytest.approx(-(math.log(softmax(STUDENT[0])[0]) + math.log(softmax(STUDENT[1])[1])) / 2)


# --- BN statistics loss ---------------------------------------------------------------------

def _bn2d(mean, var):
    bn = nn.BatchNorm2d(len(mean))
    bn.running_mean.copy_(torch.tensor(mean))
    bn.running_var.copy_(torch.tensor(var))
    return bn.eval()


# x: (2 samples, 2 channels, 1, 2). channel 0 holds 1, 3, 5, 7: mean 4, biased var (9+1+1+9)/4 = 5;
# channel 1 holds 0, 0, 2, 2: mean 1, biased var 1 (unbiased would be 4/3)
X = torch.tensor([[[[1.0, 3.0]], [[0.0, 0.0]]], [[[5.0, 7.0]], [[2.0, 2.0]]]])
RUN_MEAN, RUN_VAR = [0.5, -1.0], [2.0, 0.25]
BN_EXPECTED = math.sqrt((4 - 0.5) ** 2 + (1 + 1) ** 2) + math.sqrt((5 - 2) ** 2 + (1 - 0.25) ** 2)


def test_bn_loss_is_the_sum_of_unsquared_l2_distances_of_mean_and_biased_var():
    bn = _bn2d(RUN_MEAN, RUN_VAR)
    with bn_stats_loss([bn]) as loss:
        bn(X)
        assert loss.per_model[0][0].loss.item() == pytest.approx(BN_EXPECTED, abs=1e-5)
        assert loss.value().item() == pytest.approx(BN_EXPECTED, abs=1e-5)
    assert BN_EXPECTED == pytest.approx(4.031128874 + 3.092329219, abs=1e-6)


def test_bn_loss_on_a_1d_batch_norm_reduces_over_the_batch_only():
    bn = nn.BatchNorm1d(2).eval()
    bn.running_mean.copy_(torch.tensor([1.0, 0.0]))
    bn.running_var.copy_(torch.tensor([1.0, 1.0]))
    x = torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]])  # means (2, 3), biased vars (8/3, 8/3)
    with bn_stats_loss([bn]) as loss:
        bn(x)
        expected = math.sqrt(1 + 9) + math.sqrt(2 * (8 / 3 - 1) ** 2)
        assert loss.value().item() == pytest.approx(expected, abs=1e-5)


class _TwoBN(nn.Module):
    """Two BN layers that both see the input."""

    def __init__(self, first, second):
        super().__init__()
        self.first, self.second = first, second

    def forward(self, x):
        return self.first(x) + self.second(x)


def test_bn_loss_sums_layers_within_a_model_and_averages_over_models_with_bn():
    one = _TwoBN(_bn2d(RUN_MEAN, RUN_VAR), _bn2d([0.0, 0.0], [1.0, 1.0]))
    other = _bn2d([4.0, 1.0], [5.0, 1.0])  # matches X exactly: loss 0
    plain = nn.Linear(2, 2)  # no BN: left out of the mean
    # the second layer of `one` sees X too: mean (4, 1) vs 0, var (5, 1) vs 1
    second = math.sqrt(16 + 1) + math.sqrt(16 + 0)
    with bn_stats_loss([one, plain, other]) as loss:
        assert loss.active
        one(X)
        other(X)
        assert loss.value().item() == pytest.approx((BN_EXPECTED + second + 0.0) / 2, abs=1e-5)
    assert all(len(m._forward_hooks) == 0 for model in (one, other) for m in model.modules())


def test_bn_loss_without_bn_layers_is_zero_and_inactive():
    loss = BNStatsLoss([nn.Linear(2, 2)])
    assert not loss.active and loss.value().item() == 0.0
    loss.remove()


def test_bn_loss_before_any_forward_is_zero():
    with bn_stats_loss([_bn2d(RUN_MEAN, RUN_VAR)]) as loss:
        assert loss.active and loss.value().item() == 0.0


def test_bn_hooks_are_removed_even_when_the_block_raises():
    bn = _bn2d(RUN_MEAN, RUN_VAR)
    with pytest.raises(RuntimeError):
        with bn_stats_loss([bn]):
            assert len(bn._forward_hooks) == 1
            raise RuntimeError("boom")
    assert len(bn._forward_hooks) == 0


def test_the_losses_name_their_softmax_axis_and_warn_about_nothing():
    # a softmax over an implicit axis is deprecated (and wrong for 1-D / 3-D inputs): no warning may fire
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kl_per_sample(T_, S_, 2.0)
        kd_loss(S_, T_, 2.0, reduction="mean")
        adversarial_loss(T_, S_, "disagree", 3.0)
        hard_label_ce(S_, T_)
