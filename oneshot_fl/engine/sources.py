"""KD batch sources besides the generator, with the synthesizer interface the KD loop knows
(`synthesize() -> SynthBatch`, `state_dict`, `load_state_dict`):

ProxySynthesizer    unlabelled public images (FedDF's distillation data): one batch per epoch,
                    drawn without replacement, labelled only by the teacher.
HoldoutSynthesizer  wraps any source and keeps a share of every batch out of training, as the
                    held-out split for early stopping (engine/early_stop.py).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from oneshot_fl.data.datasets import to_tensor
from oneshot_fl.engine.synthesizer import SynthBatch
from oneshot_fl.engine.teachers import Teacher

NO_GENERATOR_LOSSES = {"ce": 0.0, "bn": 0.0, "adv": 0.0, "total": 0.0}
LUMA = (0.299, 0.587, 0.114)  # ITU-R 601 weights for RGB -> grey


def convert_images(images: np.ndarray, input_shape: tuple[int, int, int]) -> torch.Tensor:
    """uint8 (N, H, W, C) -> float (N, C', S, S) in [0, 1] with the run's channels and size
    (RGB -> grey by luminance, grey -> RGB by repetition, bilinear resize)."""
    x = to_tensor(images)
    channels, size, _ = input_shape
    if x.shape[1] != channels:
        if x.shape[1] == 3 and channels == 1:
            x = (x * torch.tensor(LUMA).view(1, 3, 1, 1)).sum(dim=1, keepdim=True)
        elif x.shape[1] == 1:
            x = x.expand(-1, channels, -1, -1)
        else:
            raise ValueError(f"cannot convert {x.shape[1]}-channel images to {channels} channels")
    if x.shape[-1] != size or x.shape[-2] != size:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False, antialias=True)
    return x.clamp(0.0, 1.0).contiguous()


class ProxySynthesizer:
    """Public unlabelled images as the distillation set; the teacher labels them once per batch."""

    def __init__(self, teacher: Teacher, images: np.ndarray, input_shape: tuple[int, int, int],
                 batch_size: int, seed: int, device: torch.device):
        if len(images) < batch_size:
            raise ValueError(f"public dataset has {len(images)} images, fewer than one batch ({batch_size})")
        self.teacher, self.images, self.input_shape = teacher, images, input_shape
        self.batch_size, self.device = batch_size, device
        self.rng = torch.Generator().manual_seed(seed)
        self.order = torch.randperm(len(images), generator=self.rng)
        self.position = 0

    def synthesize(self) -> SynthBatch:
        if self.position + self.batch_size > len(self.order):  # a new pass over the public data
            self.order, self.position = torch.randperm(len(self.images), generator=self.rng), 0
        idx = self.order[self.position:self.position + self.batch_size].numpy()
        self.position += self.batch_size
        images = convert_images(self.images[np.sort(idx)], self.input_shape).to(self.device)
        with torch.no_grad():
            logits = self.teacher.predict(images)
        return SynthBatch(images, logits.argmax(dim=1), logits, dict(NO_GENERATOR_LOSSES))

    def state_dict(self) -> dict:
        return {"rng": self.rng.get_state(), "order": self.order, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.rng.set_state(state["rng"])
        self.order, self.position = state["order"], state["position"]


class HoldoutSynthesizer:
    """The first `fraction` of every batch goes to a held-out set (FIFO, at most `max_size`
    samples), the rest to training; a held-out sample is never trained on."""

    def __init__(self, inner, fraction: float, max_size: int):
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"held-out fraction {fraction}: must be in (0, 1)")
        self.inner, self.fraction, self.max_size = inner, fraction, max_size
        self.val_images = torch.empty(0)
        self.val_logits = torch.empty(0)

    def synthesize(self) -> SynthBatch:
        batch = self.inner.synthesize()
        n = len(batch.labels)
        held = min(n - 1, max(1, round(self.fraction * n)))
        images, logits = batch.images.detach().cpu(), batch.teacher_logits.detach().float().cpu()
        if len(self.val_images):
            images_all = torch.cat([self.val_images, images[:held]])
            logits_all = torch.cat([self.val_logits, logits[:held]])
        else:
            images_all, logits_all = images[:held], logits[:held]
        self.val_images, self.val_logits = images_all[-self.max_size:], logits_all[-self.max_size:]
        return SynthBatch(batch.images[held:], batch.labels[held:], batch.teacher_logits[held:], batch.losses)

    def validation(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.val_images, self.val_logits

    def state_dict(self) -> dict:
        return {"inner": self.inner.state_dict(), "val_images": self.val_images, "val_logits": self.val_logits}

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state["inner"])
        self.val_images, self.val_logits = state["val_images"], state["val_logits"]
