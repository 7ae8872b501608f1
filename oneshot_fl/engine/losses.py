"""Losses shared by the data-free methods (one definition each)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def kl_per_sample(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """KL(softmax(t/T) || softmax(s/T)) for each row, shape (b,)."""
    log_p = F.log_softmax(teacher_logits / temperature, dim=1)
    log_q = F.log_softmax(student_logits / temperature, dim=1)
    return (log_p.exp() * (log_p - log_q)).sum(dim=1)


KD_REDUCTIONS = ("batchmean", "mean")


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0,
            reduction: str = "batchmean") -> torch.Tensor:
    """Distillation loss: KL(teacher || student) at temperature T, times T^2.

    reduction "batchmean": summed over classes, averaged over the batch (the textbook KL);
    "mean": averaged over every element, i.e. batchmean / C, as PyTorch's KLDivLoss() default
    computes it (FedMHO's code; its effective KD weight is 1/C of the stated one).
    """
    if reduction not in KD_REDUCTIONS:
        raise ValueError(f"kd reduction {reduction!r}: use {' or '.join(KD_REDUCTIONS)}")
    loss = kl_per_sample(teacher_logits, student_logits, temperature).mean() * temperature ** 2
    return loss / student_logits.shape[1] if reduction == "mean" else loss


def adversarial_loss(teacher_logits: torch.Tensor, student_logits: torch.Tensor, mask: str = "none",
                     temperature: float = 1.0) -> torch.Tensor:
    """-KL(teacher || student) at temperature T, times T^2, averaged over the whole batch (masked
    rows count as 0, as in DENSE).

    The T^2 factor keeps the term's gradient scale independent of T, as the KD loss does; Co-Boosting
    (Dai et al., "Enhancing one-shot federated learning through data and ensemble co-boosting",
    ICLR 2024) uses T=3 and its released code scales this KL by T^2. At T=1 (DENSE, FedHydra) the
    factor is 1.
    mask: "none" (FedHydra Eq. 15, Co-Boosting), "disagree" (DENSE: only where the argmaxes
    differ), "agree".
    """
    kl = kl_per_sample(teacher_logits, student_logits, temperature) * temperature ** 2
    if mask != "none":
        disagree = teacher_logits.argmax(1) != student_logits.argmax(1)
        kl = kl * (disagree if mask == "disagree" else ~disagree).float()
    return -kl.mean()


def hard_label_ce(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """CE of the student on the teacher's argmax labels (FedHydra Eq. 18)."""
    return F.cross_entropy(student_logits, teacher_logits.argmax(dim=1))
