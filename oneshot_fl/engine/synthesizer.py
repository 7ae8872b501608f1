"""Generator synthesizer: trains the generator against the teacher (and the student) and hands
out one synthetic batch per epoch with its teacher logits.

Generator loss (DENSE Eq. 5 / FedHydra Eq. 16):
  L_gen = w_ce * CE(teacher(x, y), y)  [optionally hardness-weighted, Co-Boosting]
        + w_bn * L_BN(x)               [client BN statistics, engine/hooks.py]
        + w_adv * -KL(teacher || student)  [optionally masked, engine/losses.py]
Only the generator is updated: teachers are frozen, the student is in eval mode with its
parameters excluded from autograd (its BN statistics are not touched by synthetic batches).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from oneshot_fl.engine.losses import adversarial_loss
from oneshot_fl.engine.teachers import Teacher
from oneshot_fl.fastpath import FLOAT32, FastPath
from oneshot_fl.models.generator import GeneratorSpec, reset_generator


@dataclass(frozen=True)
class GeneratorLoss:
    ce: float = 1.0
    bn: float = 1.0
    adv: float = 1.0
    adv_mask: str = "none"  # none | disagree | agree
    adv_temperature: float = 1.0
    hardness: float = 0.0  # Co-Boosting: CE weighted by (1 - p_y)^hardness; 0 = plain CE


@dataclass
class SynthBatch:
    images: torch.Tensor
    labels: torch.Tensor
    teacher_logits: torch.Tensor
    losses: dict[str, float]


def balanced_labels(batch: int, num_classes: int, rng: torch.Generator) -> torch.Tensor:
    """Each class batch // c times, the remainder drawn at random, then shuffled."""
    labels = torch.arange(num_classes).repeat(batch // num_classes)
    extra = torch.randint(num_classes, (batch - len(labels),), generator=rng)
    labels = torch.cat([labels, extra])
    return labels[torch.randperm(batch, generator=rng)]


class GeneratorSynthesizer:
    def __init__(self, teacher: Teacher, student: nn.Module, spec: GeneratorSpec, loss: GeneratorLoss,
                 num_classes: int, batch_size: int, steps: int, lr: float, seed: int, device: torch.device,
                 reset_each_epoch: bool = False, keep: str = "best", fast: FastPath = FLOAT32):
        self.teacher, self.student, self.spec, self.loss = teacher, student, spec, loss
        self.fast = fast
        self.num_classes, self.batch_size, self.steps, self.lr = num_classes, batch_size, steps, lr
        self.device, self.reset_each_epoch, self.keep = device, reset_each_epoch, keep
        self.seed = seed
        self.rng = torch.Generator().manual_seed(seed)
        self.epoch = 0
        self.generator = fast.prepare(spec.build().to(device))
        self._reset()

    def _reset(self) -> None:
        reset_generator(self.generator, self.seed + self.epoch)
        self.optimizer = torch.optim.Adam(self.generator.parameters(), lr=self.lr, betas=(0.5, 0.999))

    def _ce(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        ce = F.cross_entropy(logits, labels, reduction="none")
        if self.loss.hardness > 0:
            p_y = F.softmax(logits, dim=1).gather(1, labels[:, None]).squeeze(1)
            ce = ce * (1.0 - p_y).detach().pow(self.loss.hardness)
        return ce.mean()

    def synthesize(self) -> SynthBatch:
        """T_G generator steps on one fixed (z, y); returns the lowest-loss batch seen (or the last).

        The forward passes (generator, teachers, student) run under the fast path's autocast; the losses, the
        teachers' aggregation and the BN statistics in float32. The lowest loss, its batch and the loss sums
        are kept on the device (a float64 sum adds the float32 terms exactly as Python floats do) and read once
        per epoch, so no step waits for the GPU."""
        self.epoch += 1
        if self.reset_each_epoch and self.epoch > 1:
            self._reset()
        z = torch.randn(self.batch_size, self.spec.nz, generator=self.rng).to(self.device)
        labels = balanced_labels(self.batch_size, self.num_classes, self.rng).to(self.device)
        was_training = self.student.training
        self.student.eval()
        frozen = [p for p in self.student.parameters() if p.requires_grad]
        for p in frozen:
            p.requires_grad_(False)
        self.generator.train()
        best_loss = torch.full((), float("inf"), device=self.device)
        best_images = best_logits = None
        sums = torch.zeros(4, dtype=torch.float64, device=self.device)  # ce, bn, adv, total
        try:
            for _ in range(self.steps):
                with self.fast.autocast(self.device):  # the teacher aggregates in float32 (Teacher.aggregate)
                    images = self.generator(z)
                    teacher_logits, bn, _ = self.teacher(images, labels)
                    student_logits = self.student(images) if self.loss.adv else None
                ce = self._ce(teacher_logits, labels)
                adv = adversarial_loss(teacher_logits, student_logits.float(), self.loss.adv_mask,
                                       self.loss.adv_temperature) if self.loss.adv else ce.new_zeros(())
                total = self.loss.ce * ce + self.loss.bn * bn + self.loss.adv * adv
                value = total.detach()
                # recorded before the update, as DENSE's code does; a NaN loss is never the lowest
                better = value < best_loss
                best_loss = torch.where(better, value, best_loss)
                if best_images is None:
                    best_images, best_logits = images.detach().float().clone(), teacher_logits.detach().clone()
                else:
                    best_images = torch.where(better, images.detach().float(), best_images)
                    best_logits = torch.where(better, teacher_logits.detach(), best_logits)
                sums += torch.stack([ce.detach(), bn.detach().float(), adv.detach(), value]).double()
                self.optimizer.zero_grad(set_to_none=True)
                total.backward()
                self.optimizer.step()
            if self.keep == "last" or not bool(torch.isfinite(best_loss)):
                with torch.no_grad():
                    images = self.generator(z)
                    best_images, best_logits = images, self.teacher.predict(images, labels)
        finally:
            for p in frozen:
                p.requires_grad_(True)
            self.student.train(was_training)
        means = (sums / self.steps).tolist()
        return SynthBatch(best_images, labels, best_logits, dict(zip(("ce", "bn", "adv", "total"), means)))

    def state_dict(self) -> dict:
        return {"generator": self.generator.state_dict(), "optimizer": self.optimizer.state_dict(),
                "rng": self.rng.get_state(), "epoch": self.epoch, "teacher": self.teacher.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.load_state_dict(state["generator"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.rng.set_state(state["rng"])
        self.epoch = state["epoch"]
        self.teacher.load_state_dict(state["teacher"])
