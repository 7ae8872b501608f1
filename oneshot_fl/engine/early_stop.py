"""Early stopping on held-out synthetic data (FedDF's validation-based stopping, made data-free).

Every epoch the student is scored against the teacher on the held-out set: KL(teacher || student)
at temperature 1, batch mean (lower is better). The held-out set may grow while distillation
runs (it is filled from the synthetic batches), so the best student so far is re-scored on the
same set before the comparison: "better" always means better on identical data. After
`patience` epochs without improvement the loop stops; `restore` puts the best student back.
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

from oneshot_fl.engine.losses import kd_loss

# () -> (images, teacher logits) of the held-out set, possibly empty
Validation = Callable[[], tuple[torch.Tensor, torch.Tensor]]


@torch.no_grad()
def held_out_scores(model: nn.Module, images: torch.Tensor, teacher_logits: torch.Tensor,
                    batch_size: int = 512) -> tuple[float, float]:
    """(KL(teacher || model), top-1 agreement with the teacher) on the held-out set."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    kl_sum, agree = 0.0, 0.0
    for first in range(0, len(images), batch_size):
        x = images[first:first + batch_size].to(device)
        t = teacher_logits[first:first + batch_size].to(device)
        s = model(x)
        kl_sum += float(kd_loss(s, t)) * len(x)
        agree += float((s.argmax(1) == t.argmax(1)).sum())
    model.train(was_training)
    return kl_sum / len(images), agree / len(images)


class EarlyStopping:
    def __init__(self, validation: Validation, patience: int):
        if patience < 1:
            raise ValueError(f"patience {patience}: must be >= 1 (leave early stopping out to never stop)")
        self.validation, self.patience = validation, patience
        self.best_state: dict[str, torch.Tensor] | None = None
        self.best_epoch = 0
        self.bad_epochs = 0
        self._scorer: nn.Module | None = None  # a second model instance to score the best state

    @property
    def should_stop(self) -> bool:
        return self.bad_epochs >= self.patience

    def update(self, epoch: int, student: nn.Module) -> dict:
        """Score this epoch's student; returns the values to log in the epoch's history record."""
        images, teacher_logits = self.validation()
        if len(images) == 0:
            return {}
        kl, agreement = held_out_scores(student, images, teacher_logits)
        best_kl = float("inf")
        if self.best_state is not None:
            if self._scorer is None:
                self._scorer = copy.deepcopy(student)
            self._scorer.load_state_dict(self.best_state)
            best_kl = held_out_scores(self._scorer, images, teacher_logits)[0]
        if kl < best_kl:
            self.best_state = {k: v.detach().clone() for k, v in student.state_dict().items()}
            self.best_epoch, self.bad_epochs = epoch, 0
        else:
            self.bad_epochs += 1
        return {"val_kl": kl, "val_agreement": agreement, "val_size": len(images), "val_best_epoch": self.best_epoch}

    def restore(self, student: nn.Module) -> None:
        if self.best_state is not None:
            student.load_state_dict(self.best_state)

    def state_dict(self) -> dict:
        return {"best_state": self.best_state, "best_epoch": self.best_epoch, "bad_epochs": self.bad_epochs}

    def load_state_dict(self, state: dict | None) -> None:
        if state:
            self.best_state, self.best_epoch = state["best_state"], state["best_epoch"]
            self.bad_epochs = state["bad_epochs"]
