"""The one distillation loop: each epoch, synthesize a batch into the pool, then train the student
on pool batches against their cached teacher logits; evaluate, log, checkpoint.

Student loss: KL(teacher || student) at temperature T (x T^2, batch mean)
            + beta * CE(student, argmax teacher)     (FedHydra Eq. 19; beta = 0 for DENSE).
Optional, for the methods that need them (defaults keep the plain loop): weight decay, a cosine
learning-rate schedule over the epochs, Adam, gradient-norm clipping, a `kd_transform` that
replaces each KD batch and its teacher logits (Co-Boosting's ODS perturbation), and `early_stop`
(FedDF: stop on held-out synthetic data and keep the best student).
Checkpoints (student, its optimizer, synthesizer state, pool, RNG, history) are written
atomically every `checkpoint_every` epochs; a run that finds a checkpoint with the same
fingerprint resumes from it and ends exactly where an uninterrupted run would. A checkpoint is
read with torch's weights-only loader (tensors and plain containers; a pickled object is refused,
never run) and checked before use; one that fails is ignored with a warning and the run starts fresh.
"""

from __future__ import annotations

import copy
import logging
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from oneshot_fl.engine.early_stop import EarlyStopping
from oneshot_fl.engine.losses import hard_label_ce, kd_loss
from oneshot_fl.engine.pool import SyntheticPool
from oneshot_fl.engine.synthesizer import GeneratorSynthesizer
from oneshot_fl.fastpath import FLOAT32, FastPath
from oneshot_fl.progress import EpochClock
from oneshot_fl.seeding import derive_seed, seeded_global_rng

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillSettings:
    epochs: int
    lr: float
    temperature: float = 1.0
    beta: float = 0.0  # weight of the hard-label CE on the teacher's argmax
    eval_every: int = 5
    checkpoint_every: int = 5
    momentum: float = 0.9
    weight_decay: float = 0.0
    lr_schedule: str = "constant"  # constant | cosine (CosineAnnealingLR over `epochs`, stepped per epoch)
    grad_clip: float = 0.0  # max gradient norm of the student; 0 = no clipping
    optimizer: str = "sgd"  # sgd (momentum) | adam
    # a checkpoint epoch writes only when this many seconds have passed since the last write: on a GPU an epoch
    # takes seconds and the checkpoint (its pool of up to 200 synthetic batches) about as long
    checkpoint_min_interval: float = 0.0

    def lr_at(self, epoch: int) -> float:
        """Learning rate of 1-based `epoch` (computed, so a resumed run needs no scheduler state)."""
        if self.lr_schedule == "cosine":
            return self.lr * 0.5 * (1.0 + math.cos(math.pi * (epoch - 1) / self.epochs))
        return self.lr


# (images, teacher logits, rng) -> (images, teacher logits) of one KD batch
KDTransform = Callable[[torch.Tensor, torch.Tensor, torch.Generator], tuple[torch.Tensor, torch.Tensor]]


def make_optimizer(student: nn.Module, settings: DistillSettings) -> torch.optim.Optimizer:
    if settings.optimizer == "adam":
        return torch.optim.Adam(student.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    if settings.optimizer == "sgd":
        return torch.optim.SGD(student.parameters(), lr=settings.lr, momentum=settings.momentum,
                               weight_decay=settings.weight_decay)
    raise ValueError(f"student optimizer {settings.optimizer!r}: use sgd or adam")


DISTILL_STATE_KEYS = ("epoch", "student", "optimizer", "synthesizer", "pool", "rng", "history", "early_stop")


class Checkpoint:
    """One atomic checkpoint file; `fingerprint` guards against resuming a different run.

    Loaded with weights_only=True: what `save` writes (state dicts, RNG ByteTensors, lists and
    dicts of numbers) loads under it, and a file carrying any other pickled object is refused
    without running it (a run folder may come from elsewhere).
    """

    def __init__(self, path: Path, fingerprint: str):
        self.path, self.fingerprint = Path(path), fingerprint

    def load(self, required: tuple[str, ...] = ()) -> dict | None:
        """The saved state, or None (with a warning) if missing, unsafe, unreadable, of another
        configuration or lacking one of the `required` keys."""
        if not self.path.is_file():
            return None
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - unsafe (UnpicklingError), truncated or foreign files alike
            log.warning("ignoring checkpoint %s: it cannot be loaded safely (%s: %s); starting fresh",
                        self.path, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            return None
        if not isinstance(state, dict) or state.get("fingerprint") != self.fingerprint:
            log.warning("ignoring checkpoint %s: it belongs to another configuration", self.path)
            return None
        missing = [key for key in required if key not in state]
        if missing:
            log.warning("ignoring checkpoint %s: it lacks %s; starting fresh", self.path, ", ".join(missing))
            return None
        return state

    def save(self, state: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        torch.save({**state, "fingerprint": self.fingerprint}, tmp)
        os.replace(tmp, self.path)


def _resume(state: dict, settings: DistillSettings, student: nn.Module, optimizer: torch.optim.Optimizer,
            synthesizer: GeneratorSynthesizer, pool: SyntheticPool, rng: torch.Generator,
            early_stop: EarlyStopping | None, checkpoint: Checkpoint) -> bool:
    """Apply a loaded checkpoint; if any part does not fit, put everything back as it was (a
    fresh start) and say so. True when resumed."""
    epoch, history = state["epoch"], state["history"]
    if type(epoch) is not int or not 1 <= epoch < settings.epochs or not isinstance(history, list):
        log.warning("ignoring checkpoint %s: epoch %r / history do not fit a %d-epoch run; starting fresh",
                    checkpoint.path, epoch, settings.epochs)
        return False
    parts = [(student, "student"), (optimizer, "optimizer"), (synthesizer, "synthesizer"), (pool, "pool")]
    if early_stop is not None:
        parts.append((early_stop, "early_stop"))
    fresh = [copy.deepcopy(part.state_dict()) for part, _ in parts] + [rng.get_state()]
    try:
        for part, key in parts:
            part.load_state_dict(state[key])
        rng.set_state(state["rng"])
    except Exception as exc:  # noqa: BLE001 - shapes, types or keys of a foreign checkpoint
        for (part, _), saved in zip(parts, fresh):
            part.load_state_dict(saved)
        rng.set_state(fresh[-1])
        log.warning("ignoring checkpoint %s: it does not fit this run (%s: %s); starting fresh",
                    checkpoint.path, type(exc).__name__, exc)
        return False
    return True


def distill(student: nn.Module, synthesizer: GeneratorSynthesizer, pool: SyntheticPool, settings: DistillSettings,
            evaluate: Callable[[nn.Module], float], seed: int, checkpoint: Checkpoint | None = None,
            before_epoch: Callable[[int], None] | None = None, label: str = "distill",
            kd_transform: KDTransform | None = None,
            early_stop: EarlyStopping | None = None, fast: FastPath = FLOAT32) -> tuple[list[dict], int]:
    """Train `student` in place; returns (per-epoch history, epoch resumed from or 0). The model
    left in `student` is the final-epoch one (the best test epoch is reported, never selected),
    or with `early_stop` the one with the best held-out synthetic score.

    `fast` (oneshot_fl/fastpath.py; off on a CPU): the student's KD forward under bf16 autocast, the KD loss in
    float32. The KD losses are summed on the device (float64: the sums Python floats of them give) and read
    once per epoch, so no step waits for the GPU."""
    device = next(student.parameters()).device
    optimizer = make_optimizer(student, settings)
    rng = torch.Generator().manual_seed(seed)
    history: list[dict] = []
    first_epoch, resumed_from = 1, 0
    state = checkpoint.load(DISTILL_STATE_KEYS) if checkpoint else None
    if state is not None and _resume(state, settings, student, optimizer, synthesizer, pool, rng, early_stop,
                                     checkpoint):
        history = state["history"]
        resumed_from = state["epoch"]
        first_epoch = resumed_from + 1
        log.info("%s: resuming distillation from epoch %d of %s (epochs 1-%d restored; epoch %d/%d next)", label,
                 resumed_from, checkpoint.path, resumed_from, first_epoch, settings.epochs)
    start = last_save = time.perf_counter()
    clock = EpochClock(settings.epochs, first_epoch)  # a resumed run: mean of the epochs run here
    for epoch in range(first_epoch, settings.epochs + 1):
        if before_epoch is not None:
            before_epoch(epoch)
        t0 = time.perf_counter()
        batch = synthesizer.synthesize()
        pool.add(batch.images, batch.labels, batch.teacher_logits)
        t1 = time.perf_counter()
        student.train()
        for group in optimizer.param_groups:
            group["lr"] = settings.lr_at(epoch)
        kd_sum, steps = torch.zeros((), dtype=torch.float64, device=device), 0
        with seeded_global_rng(derive_seed(seed, "kd-epoch", epoch), device):  # a dropout student
            for images, _, teacher_logits in pool.epoch_batches(rng):
                images, teacher_logits = images.to(device), teacher_logits.to(device)
                if kd_transform is not None:
                    images, teacher_logits = kd_transform(images, teacher_logits, rng)
                with fast.autocast(device):
                    logits = student(images)
                logits = logits.float()
                loss = kd_loss(logits, teacher_logits, settings.temperature)
                if settings.beta:
                    loss = loss + settings.beta * hard_label_ce(logits, teacher_logits)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if settings.grad_clip > 0:
                    nn.utils.clip_grad_norm_(student.parameters(), settings.grad_clip)
                optimizer.step()
                kd_sum += loss.detach().double()
                steps += 1
        kd_mean = float(kd_sum) / max(steps, 1)  # the epoch's one wait for the device
        t2 = time.perf_counter()
        record = {"epoch": epoch, **{f"gen_{k}": v for k, v in batch.losses.items()},
                  "kd_loss": kd_mean, "kd_steps": steps, "pool_size": len(pool),
                  "synthesis_s": t1 - t0, "kd_s": t2 - t1, "accuracy": None}
        stop = False
        if early_stop is not None:
            record.update(early_stop.update(epoch, student))
            stop = early_stop.should_stop
        if epoch % settings.eval_every == 0 or epoch == settings.epochs or stop:
            record["accuracy"] = evaluate(student)
        history.append(record)
        acc = f"  test acc {record['accuracy']:.4f}" if record["accuracy"] is not None else ""
        log.info("%s: epoch %d/%d  gen ce %.3f bn %.3f adv %.3f  kd %.4f (%d steps)%s  [%.0fs, %s]", label, epoch,
                 settings.epochs, batch.losses["ce"], batch.losses["bn"], batch.losses["adv"],
                 record["kd_loss"], steps, acc, time.perf_counter() - start, clock.eta(epoch))
        if stop:
            log.info("%s: early stop at epoch %d (no better held-out score for %d epochs; best epoch %d)",
                     label, epoch, early_stop.patience, early_stop.best_epoch)
            break
        if (checkpoint and epoch % settings.checkpoint_every == 0 and epoch < settings.epochs
                and time.perf_counter() - last_save >= settings.checkpoint_min_interval):
            last_save = time.perf_counter()
            checkpoint.save({"epoch": epoch, "student": student.state_dict(), "optimizer": optimizer.state_dict(),
                             "synthesizer": synthesizer.state_dict(), "pool": pool.state_dict(),
                             "rng": rng.get_state(), "history": history,
                             "early_stop": early_stop.state_dict() if early_stop is not None else None})
    if early_stop is not None:
        early_stop.restore(student)
    return history, resumed_from
