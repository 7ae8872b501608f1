"""Test-set evaluation of a classifier (top-1 accuracy, per-class accuracy, loss)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from oneshot_fl.data.datasets import Split, to_tensor


@dataclass(frozen=True)
class Evaluation:
    accuracy: float
    loss: float
    per_class_accuracy: list[float]

    def as_dict(self) -> dict:
        return {"accuracy": self.accuracy, "loss": self.loss, "per_class_accuracy": self.per_class_accuracy}


@torch.no_grad()
def predict_logits(model: nn.Module, images: np.ndarray, device: torch.device, batch_size: int = 512) -> torch.Tensor:
    """Logits of `model` (eval mode) on uint8 images, on the CPU."""
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, len(images), batch_size):
        x = to_tensor(images[start:start + batch_size]).to(device)
        out.append(model(x).float().cpu())
    model.train(was_training)
    return torch.cat(out) if out else torch.empty(0)


def evaluate_logits(logits: torch.Tensor, labels: np.ndarray, num_classes: int) -> Evaluation:
    y = torch.as_tensor(labels, dtype=torch.long)
    pred = logits.argmax(dim=1)
    per_class = []
    for c in range(num_classes):
        mask = y == c
        per_class.append(float((pred[mask] == c).float().mean()) if mask.any() else float("nan"))
    return Evaluation(
        accuracy=float((pred == y).float().mean()),
        loss=float(F.cross_entropy(logits, y)),
        per_class_accuracy=per_class,
    )


def evaluate(model: nn.Module, test: Split, num_classes: int, device: torch.device,
             batch_size: int = 512) -> Evaluation:
    return evaluate_logits(predict_logits(model, test.images, device, batch_size), test.labels, num_classes)
