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


def test_temperature_scales_the_kl_by_tau_squared_and_gradients_stay_finite():
    majority = torch.tensor([True, False, False, False, False])
    student = torch.randn(8, 5, requires_grad=True)
    teacher = torch.randn(8, 5)
    labels = torch.randint(0, 5, (8,))
    loss = fedlmd_loss(student, labels, teacher, majority, tau=3.0, beta=1.0)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(student.grad).all()


def test_local_loss_factory_falls_back_to_teacher_free_without_a_global_model():
    counts = np.array([50, 0, 0, 50])
    cfg = LocalConfig(loss="fedlmd", lmd_beta=0.3)
    _, name = make_local_loss(cfg, counts, teacher=None)
    assert name.startswith("fedlmd-tf") and "[0, 3]" in name
    teacher = torch.nn.Linear(4, 4)
    loss_fn, name = make_local_loss(cfg, counts, teacher=teacher)
    assert name.startswith("fedlmd (")
    x, y = torch.randn(6, 4), torch.tensor([0, 3, 0, 3, 0, 3])
    assert torch.isfinite(loss_fn(torch.randn(6, 4), y, x))


def test_unknown_local_loss_is_rejected_by_the_run_config():
    from oneshot_fl.config import ConfigError, from_run_config, merge_overrides

    with pytest.raises(ConfigError, match="local.loss='ldam'.*'fedlmd-tf'"):
        from_run_config(merge_overrides({"local.loss": "ldam"}))
