"""What a server method works with: FuseContext (config, device, central test set, run folder) in, FuseResult
(the global model and what the method measured) out; `make_context` sets one up for a run. Rejection: an upload
the server refused, or a node that sent none."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from torch import nn

from oneshot_fl.config import RunConfig, resolve_data_dir
from oneshot_fl.data.datasets import DATASETS, Split, load_split, test_subset
from oneshot_fl.devices import pick_device
from oneshot_fl.evaluation import Evaluation, evaluate
from oneshot_fl.fastpath import FastPath, HeldImages
from oneshot_fl.results import PhaseTimer
from oneshot_fl.run_folder import check_run_dir_free, run_dir_of
from oneshot_fl.seeding import derive_seed


@dataclass
class FuseContext:
    """What a server algorithm may use: config, device, the central test set, the run folder."""

    cfg: RunConfig
    device: torch.device
    num_classes: int
    input_shape: tuple[int, int, int]
    test: Split
    run_dir: Path
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    round: int = 1  # multi-round mode: the global round this fuse belongs to
    previous_model: nn.Module | None = None  # multi-round mode, rounds >= 2: the last global model

    @property
    def fast(self) -> FastPath:
        """The fast path of this device and the run's gpu.* knobs (all off on a CPU)."""
        return FastPath.for_device(self.device, self.cfg.gpu)

    @cached_property
    def held_test(self) -> HeldImages | None:
        """The test images on the device, on the fast path (copied once, read by every evaluation)."""
        return HeldImages(self.test.images, self.device) if self.fast.device_data else None

    def evaluate(self, model: nn.Module) -> Evaluation:
        return evaluate(model, self.test, self.num_classes, self.device, self.cfg.eval.batch_size, self.held_test)

    def seed(self, *names: object) -> int:
        # round 1 keeps the one-shot streams; later rounds draw fresh ones
        return derive_seed(self.cfg.seed, *(names if self.round == 1 else ("round", self.round, *names)))


@dataclass
class FuseResult:
    """A server algorithm's output: the global model plus whatever it measured on the way."""

    model: nn.Module
    arch: str
    metrics: dict[str, Any] = field(default_factory=dict)  # e.g. ensemble_accuracy, accuracy_best
    history: list[dict] = field(default_factory=list)  # per distillation epoch


@dataclass
class Rejection:
    """An upload the server refused, or a node it heard nothing from, and why."""

    node_id: int
    reason: str
    role: str = ""  # set when the upload was of a known role this method cannot use (the quorum message counts them)


def make_context(cfg: RunConfig, run_dir: Path | None = None) -> FuseContext:
    """Run folder + central test set + device: everything `fuse` gets besides the uploads. The
    folder is only named here (and refused if it holds a finished run or files no run wrote); `serve` creates it."""
    info = DATASETS[cfg.dataset]
    run_dir = run_dir_of(cfg, run_dir)
    check_run_dir_free(run_dir)
    test = load_split(cfg.dataset, "test", str(resolve_data_dir(cfg)), cfg.download)
    test = test_subset(test, cfg.eval.test_samples, derive_seed(cfg.seed, "test-subset"))
    return FuseContext(cfg=cfg, device=pick_device(), num_classes=info.num_classes,
                       input_shape=info.input_shape, test=test, run_dir=run_dir)
