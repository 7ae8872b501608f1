"""Local training losses: cross-entropy and FedLMD's label-masking distillation
(Lu et al., "Federated Learning with Label-Masking Distillation", ACM MM 2023: Sec. 4.2, and Sec. 4.3 for
the teacher-free FedLMD-Tf).

FedLMD (Lu et al., ACM MM 2023), for a client with label counts n_y:
  majority labels  Y_maj = { y : n_y > n / C }                  (the code's rule, strict)
  teacher          softmax(z_g / tau) over labels outside Y_maj and != y (the global model g)
  student          softmax(z_k / tau) over labels != y
  loss             CE(z_k, y) + beta * tau^2 * (1/B) sum_rows KL(teacher || student)
FedLMD-Tf replaces the teacher by the uniform distribution on the same support (its Eq. 8 with the
recommended fix: y is masked too and the target is renormalised). Rows whose teacher support is
empty (every other label a majority label) contribute 0, so the KL stays finite.
"""

from __future__ import annotations

import copy
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from oneshot_fl.config import LocalConfig
from oneshot_fl.local.train import LocalLoss, cross_entropy_loss

MASKED = -1e4  # masked logits: exp() underflows to 0 without the inf - inf NaNs of -inf


def majority_labels(label_counts: np.ndarray | torch.Tensor) -> torch.Tensor:
    """bool (C,): labels the client holds more than its mean count of (n_y > n / C)."""
    counts = torch.as_tensor(np.asarray(label_counts), dtype=torch.float64)
    return counts > counts.sum() / len(counts)


def teacher_masks(labels: torch.Tensor, majority: torch.Tensor, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(teacher mask, student mask), each (B, C), True = masked: teacher masks Y_maj and y, the student y."""
    own = F.one_hot(labels, num_classes).bool()
    return own | majority.to(labels.device)[None, :], own


def _masked_kl(target: torch.Tensor, target_mask: torch.Tensor, student_logits: torch.Tensor,
               student_mask: torch.Tensor, tau: float) -> torch.Tensor:
    """(1/B) sum over rows with a non-empty target support of KL(target || masked student softmax)."""
    valid = (~target_mask).any(dim=1)
    log_q = F.log_softmax(student_logits.masked_fill(student_mask, MASKED) / tau, dim=1)
    # 0 log 0 = 0 on the masked labels (target 0 there; where the student is masked too, log q is finite)
    terms = torch.where(target > 0, target * (torch.log(target.clamp_min(1e-30)) - log_q), torch.zeros_like(log_q))
    return (terms.sum(dim=1) * valid).sum() / len(target)


def fedlmd_loss(student_logits: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor,
                majority: torch.Tensor, tau: float = 1.0, beta: float = 1.0) -> torch.Tensor:
    """FedLMD Eq. 5: CE + beta * tau^2 * KL(masked teacher || masked student)."""
    t_mask, s_mask = teacher_masks(labels, majority, student_logits.shape[1])
    target = F.softmax(teacher_logits.detach().masked_fill(t_mask, MASKED) / tau, dim=1).masked_fill(t_mask, 0.0)
    kl = _masked_kl(target, t_mask, student_logits, s_mask, tau)
    return F.cross_entropy(student_logits, labels) + beta * tau ** 2 * kl


def fedlmd_tf_loss(student_logits: torch.Tensor, labels: torch.Tensor, majority: torch.Tensor,
                   tau: float = 1.0, beta: float = 1.0) -> torch.Tensor:
    """FedLMD-Tf Eq. 7: CE + beta * tau^2 * KL(uniform over the minority labels != y || masked student)."""
    t_mask, s_mask = teacher_masks(labels, majority, student_logits.shape[1])
    support = (~t_mask).float()
    target = support / support.sum(dim=1, keepdim=True).clamp_min(1.0)
    kl = _masked_kl(target, t_mask, student_logits, s_mask, tau)
    return F.cross_entropy(student_logits, labels) + beta * tau ** 2 * kl


def frozen_copy(model: nn.Module) -> nn.Module:
    teacher = copy.deepcopy(model).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def make_local_loss(cfg: LocalConfig, label_counts: np.ndarray, teacher: nn.Module | None) -> tuple[LocalLoss, str]:
    """The loss_fn(logits, labels, inputs) for train_local and a short description of it.

    fedlmd needs `teacher` (the global model the client started from); without one (round 1 of a
    run) it falls back to FedLMD-Tf, or to the random init when local.lmd-round1 = "init" (then the
    caller passes that init as `teacher`).
    """
    if cfg.loss == "ce":
        return cross_entropy_loss, "ce"
    majority = majority_labels(label_counts)
    tau, beta = cfg.lmd_tau, cfg.lmd_beta
    if cfg.loss == "fedlmd-tf" or teacher is None:
        def tf_loss(logits, labels, inputs):
            return fedlmd_tf_loss(logits, labels, majority, tau, beta)
        return tf_loss, f"fedlmd-tf (majority labels {majority.nonzero().flatten().tolist()})"

    def lmd_loss(logits, labels, inputs):
        with torch.no_grad():
            teacher_logits = teacher(inputs)
        return fedlmd_loss(logits, labels, teacher_logits, majority, tau, beta)
    return lmd_loss, f"fedlmd (majority labels {majority.nonzero().flatten().tolist()})"
