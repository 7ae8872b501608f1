"""FedLMD / FedLMD-Tf local losses against hand-computed masks and values."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from oneshot_fl.config import LocalConfig
from oneshot_fl.local.losses import (fedlmd_loss, fedlmd_tf_loss, majority_labels, make_local_loss,
                                     teacher_masks)


def test_majority_labels_are_those_above_the_mean_count():
    # 4 classes, 100 samples, mean 25: classes 0 (60) and 2 (30) are majority; 25 is not (strict)
    counts = np.array([60, 0, 30, 10])
    assert majority_labels(counts).tolist() == [True, False, True, False]
    assert majority_labels(np.array([25, 25, 25, 25])).tolist() == [False] * 4


def test_masks_for_a_majority_and_a_minority_label():
    majority = torch.tensor([True, False, True, False])
    labels = torch.tensor([0, 1])  # sample 0 has a majority label, sample 1 a minority label
    t_mask, s_mask = teacher_masks(labels, majority, 4)
    # teacher masks the majority labels and the target; the student only the target
    assert t_mask.tolist() == [[True, False, True, False], [True, True, True, False]]
    assert s_mask.tolist() == [[True, False, False, False], [False, True, False, False]]


def test_fedlmd_loss_by_hand():
    majority = torch.tensor([True, False, True, False])
    labels = torch.tensor([0, 1])
    student = torch.tensor([[1.0, 0.5, 2.0, -1.0], [0.0, 3.0, 1.0, 1.0]])
    teacher = torch.tensor([[0.0, 1.0, 5.0, 2.0], [2.0, 0.0, 1.0, -1.0]])
    # sample 0 (y = 0): teacher support {1, 3} -> softmax([1, 2]); student support {1, 2, 3}
    t0 = torch.softmax(torch.tensor([1.0, 2.0]), 0)
    s0 = torch.log_softmax(torch.tensor([0.5, 2.0, -1.0]), 0)  # labels 1, 2, 3
    kl0 = t0[0] * (t0[0].log() - s0[0]) + t0[1] * (t0[1].log() - s0[2])
    # sample 1 (y = 1, a minority label): teacher support {3} only -> one-hot on 3
    s1 = torch.log_softmax(torch.tensor([0.0, 1.0, 1.0]), 0)  # labels 0, 2, 3
    kl1 = -s1[2]
    ce = F.cross_entropy(student, labels)
    beta = 0.5
    expected = ce + beta * (kl0 + kl1) / 2
    assert torch.allclose(fedlmd_loss(student, labels, teacher, majority, tau=1.0, beta=beta), expected, atol=1e-6)
    # the KL term is 0 when the student already matches the masked teacher
    student_match = teacher.clone()
    student_match[0, 0] = 10.0  # the target logit does not enter the masked distributions
    no_kl = fedlmd_loss(student_match, labels, teacher, torch.zeros(4, dtype=torch.bool), beta=1.0)
    assert torch.allclose(no_kl, F.cross_entropy(student_match, labels), atol=1e-6)


def test_fedlmd_tf_targets_the_uniform_minority_distribution():
    majority = torch.tensor([True, False, False, False])
    labels = torch.tensor([1])
    student = torch.tensor([[0.3, 1.0, -0.5, 0.5]])
    # target uniform on {2, 3} (not majority 0, not y = 1); student softmax over {0, 2, 3}
    log_s = torch.log_softmax(torch.tensor([0.3, -0.5, 0.5]), 0)
    kl = 0.5 * (math.log(0.5) - log_s[1]) + 0.5 * (math.log(0.5) - log_s[2])
    expected = F.cross_entropy(student, labels) + kl
    assert torch.allclose(fedlmd_tf_loss(student, labels, majority), expected, atol=1e-6)


def test_rows_with_an_empty_teacher_support_contribute_nothing():
    majority = torch.tensor([True, True, False])  # y = 2 masks the only minority label
    student = torch.randn(1, 3, requires_grad=True)
    labels = torch.tensor([2])
    loss = fedlmd_tf_loss(student, labels, majority, beta=5.0)
    assert torch.allclose(loss, F.cross_entropy(student, labels))
    loss.backward()
    assert torch.isfinite(student.grad).all()


def _softmax(values, tau=1.0):
    e = [math.exp(v / tau) for v in values]
    return [v / sum(e) for v in e]


def _log_softmax(values, tau=1.0):
    return [math.log(p) for p in _softmax(values, tau)]


def _ce(row, label):
    return -_log_softmax(row)[label]


# one sample, 4 classes, majority label 0, true label 1: the teacher's support is {2, 3} (not the
# majority, not y), the student's {0, 2, 3} (not y)
LMD_MAJORITY = torch.tensor([True, False, False, False])
LMD_STUDENT = [0.5, 2.0, -1.0, 1.5]
LMD_TEACHER = [3.0, 0.0, 2.0, -0.5]


@pytest.mark.parametrize("tau", [1.0, 3.0])
def test_fedlmd_temperature_divides_both_logit_sets_and_scales_the_kl_by_tau_squared(tau):
    beta = 0.7
    t = _softmax([LMD_TEACHER[2], LMD_TEACHER[3]], tau)  # teacher on {2, 3}
    log_q = _log_softmax([LMD_STUDENT[0], LMD_STUDENT[2], LMD_STUDENT[3]], tau)  # student on {0, 2, 3}
    kl = t[0] * (math.log(t[0]) - log_q[1]) + t[1] * (math.log(t[1]) - log_q[2])
    expected = _ce(LMD_STUDENT, 1) + beta * tau ** 2 * kl  # the CE term has no temperature
    out = fedlmd_loss(torch.tensor([LMD_STUDENT]), torch.tensor([1]), torch.tensor([LMD_TEACHER]), LMD_MAJORITY,
                      tau=tau, beta=beta)
    assert out.item() == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("tau", [1.0, 3.0])
def test_fedlmd_tf_temperature_scales_the_kl_by_tau_squared(tau):
    beta = 0.7
    log_q = _log_softmax([LMD_STUDENT[0], LMD_STUDENT[2], LMD_STUDENT[3]], tau)
    kl = 0.5 * (math.log(0.5) - log_q[1]) + 0.5 * (math.log(0.5) - log_q[2])  # uniform on {2, 3}
    out = fedlmd_tf_loss(torch.tensor([LMD_STUDENT]), torch.tensor([1]), LMD_MAJORITY, tau=tau, beta=beta)
    assert out.item() == pytest.approx(_ce(LMD_STUDENT, 1) + beta * tau ** 2 * kl, abs=1e-6)


def test_fedlmd_gradients_stay_finite_at_a_high_temperature():
    majority = torch.tensor([True, False, False, False, False])
    student = torch.randn(8, 5, requires_grad=True)
    loss = fedlmd_loss(student, torch.randint(0, 5, (8,)), torch.randn(8, 5), majority, tau=3.0, beta=1.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(student.grad).all()


class _FixedTeacher(torch.nn.Module):
    """A 'global model' whose logits are the first 4 input features (to pin what the loss sees)."""

    def forward(self, x):
        return x[:, :4]


def test_local_loss_factory_builds_the_loss_it_names_with_the_configs_beta_and_tau():
    counts = np.array([50, 0, 0, 50])  # mean 25: majority labels 0 and 3
    beta, tau = 0.3, 2.0
    cfg = LocalConfig(loss="fedlmd", lmd_beta=beta, lmd_tau=tau)
    student = [1.0, 0.0, 2.0, -1.0]
    teacher = [0.0, 1.5, -0.5, 4.0]
    logits, labels, inputs = torch.tensor([student]), torch.tensor([0]), torch.tensor([teacher + [9.0]])
    # y = 0 (a majority label): teacher support {1, 2}, student support {1, 2, 3}, both at tau
    log_q = _log_softmax(student[1:], tau)
    ce = _ce(student, 0)

    tf_fn, name = make_local_loss(cfg, counts, teacher=None)  # round 1: no global model, teacher-free
    assert name.startswith("fedlmd-tf") and "[0, 3]" in name
    kl_uniform = 0.5 * (math.log(0.5) - log_q[0]) + 0.5 * (math.log(0.5) - log_q[1])
    assert tf_fn(logits, labels, inputs).item() == pytest.approx(ce + beta * tau ** 2 * kl_uniform, abs=1e-6)

    lmd_fn, name = make_local_loss(cfg, counts, teacher=_FixedTeacher())
    assert name.startswith("fedlmd (") and "[0, 3]" in name
    t = _softmax(teacher[1:3], tau)
    kl_teacher = t[0] * (math.log(t[0]) - log_q[0]) + t[1] * (math.log(t[1]) - log_q[1])
    assert lmd_fn(logits, labels, inputs).item() == pytest.approx(ce + beta * tau ** 2 * kl_teacher, abs=1e-6)

    tf_cfg = LocalConfig(loss="fedlmd-tf", lmd_beta=beta, lmd_tau=tau)  # teacher-free even with a teacher
    forced_tf, name = make_local_loss(tf_cfg, counts, teacher=_FixedTeacher())
    assert name.startswith("fedlmd-tf")
    assert forced_tf(logits, labels, inputs).item() == pytest.approx(ce + beta * tau ** 2 * kl_uniform, abs=1e-6)

    ce_fn, name = make_local_loss(LocalConfig(loss="ce"), counts, teacher=_FixedTeacher())
    assert name == "ce" and ce_fn(logits, labels, inputs).item() == pytest.approx(ce, abs=1e-6)


def test_unknown_local_loss_is_rejected_by_the_run_config():
    from oneshot_fl.config import ConfigError, from_run_config, merge_overrides

    with pytest.raises(ConfigError, match="local.loss='ldam'.*'fedlmd-tf'"):
        from_run_config(merge_overrides({"local.loss": "ldam"}))
