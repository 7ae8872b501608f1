"""The synthetic pool: generated batches with their labels and cached teacher logits.

Teachers are frozen and synthetic images are not augmented, so each batch's teacher logits are
computed once, at synthesis time, and reused by every distillation step (no teacher passes in KD).
Policies (which batches feed the student each epoch):
  paper    only this epoch's batch, one student step (Alg. 1 of DENSE / FedHydra, literally)
  growing  every batch ever made, one shuffled pass per epoch (DENSE's code; cost grows as T^2)
  capped   the last `max_batches` batches (FIFO); `kd_steps` random batches per epoch
"""

from __future__ import annotations

from typing import Iterator

import torch


class SyntheticPool:
    """`device`: where the batches are kept (the CPU, or the GPU on the fast path: the KD steps then copy
    nothing); a checkpoint's batches are moved there when loaded."""

    def __init__(self, policy: str, max_batches: int, kd_steps: int, batch_size: int,
                 device: torch.device | str = "cpu"):
        if policy not in ("paper", "growing", "capped"):
            raise ValueError(f"pool policy {policy!r}: use paper, growing or capped")
        self.policy, self.max_batches, self.kd_steps, self.batch_size = policy, max_batches, kd_steps, batch_size
        self.device = torch.device(device)
        self.images: list[torch.Tensor] = []  # float16: half the memory, ample precision for [0, 1]
        self.labels: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []

    def __len__(self) -> int:
        return sum(len(y) for y in self.labels)

    def add(self, images: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor) -> None:
        self.images.append(images.detach().to(self.device, torch.float16))
        self.labels.append(labels.detach().to(self.device))
        self.logits.append(teacher_logits.detach().float().to(self.device))
        if self.policy == "capped" and len(self.images) > self.max_batches:
            del self.images[0], self.labels[0], self.logits[0]

    def epoch_batches(self, rng: torch.Generator) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(images, labels, teacher logits) batches for one epoch of student training."""
        if not self.images:
            return
        if self.policy == "paper":
            yield self.images[-1].float(), self.labels[-1], self.logits[-1]
            return
        images, labels, logits = torch.cat(self.images), torch.cat(self.labels), torch.cat(self.logits)
        n = len(labels)
        # the indices are drawn on the CPU (the rng's stream) and copied without waiting for the device
        if self.policy == "growing":
            order = torch.randperm(n, generator=rng).to(self.device, non_blocking=True)
            for first in range(0, n, self.batch_size):
                idx = order[first:first + self.batch_size]
                yield images[idx].float(), labels[idx], logits[idx]
            return
        for _ in range(self.kd_steps):
            idx = torch.randperm(n, generator=rng)[:self.batch_size].to(self.device, non_blocking=True)
            yield images[idx].float(), labels[idx], logits[idx]

    def state_dict(self) -> dict:
        return {"images": self.images, "labels": self.labels, "logits": self.logits}

    def load_state_dict(self, state: dict) -> None:
        self.images, self.labels, self.logits = ([t.to(self.device) for t in state[key]]
                                                 for key in ("images", "labels", "logits"))

    def last(self, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Up to `count` of the most recent images and labels (for sample grids)."""
        images = torch.cat(self.images[::-1]).float()[:count]
        labels = torch.cat(self.labels[::-1])[:count]
        return images.cpu(), labels.cpu()
