"""Test-set evaluation of a classifier (top-1 accuracy, per-class accuracy, loss)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from oneshot_fl.data.datasets import Split, to_tensor
from oneshot_fl.fastpath import HeldImages


@dataclass(frozen=True)
class Evaluation:
    accuracy: float
    loss: float
    per_class_accuracy: list[float]

    def as_dict(self) -> dict:
        return {"accuracy": self.accuracy, "loss": self.loss, "per_class_accuracy": self.per_class_accuracy}


@torch.no_grad()
def predict_logits(model: nn.Module, images: np.ndarray | HeldImages, device: torch.device,
                   batch_size: int = 512) -> torch.Tensor:
    """Logits of `model` (eval mode, float32) on uint8 images (or images held on the device), on the CPU; the
    batches' logits are gathered on the device and copied back once."""
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, len(images), batch_size):
        if isinstance(images, HeldImages):
            x = images.batch(slice(start, start + batch_size))
        else:
            x = to_tensor(images[start:start + batch_size]).to(device)
        out.append(model(x).float())
    model.train(was_training)
    return torch.cat(out).cpu() if out else torch.empty(0)


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
             batch_size: int = 512, held: HeldImages | None = None) -> Evaluation:
    """`held`: the test images already on the device (the fast path), used in place of test.images."""
    images = test.images if held is None else held
    return evaluate_logits(predict_logits(model, images, device, batch_size), test.labels, num_classes)
