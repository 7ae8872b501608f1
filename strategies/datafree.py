"""Data-free distillation methods (DENSE, FedHydra, and the ones built on them): the shared fuse.

uploads -> frozen client models -> teacher (ensemble + the method's aggregator) -> generator
synthesizer -> pool -> distill the student -> FuseResult. A method only says how its teacher
combines clients (`make_aggregator`, which returns what that stage reports beside the aggregator), which
generator losses it uses (`generator_loss`) and the weight of the student's hard-label CE (`student_beta`).
The student's schedule is distill.pool and distill.lr-schedule ("" = the method's: config.distill_schedule).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from abc import abstractmethod
from contextlib import ExitStack, nullcontext
from typing import Any, Callable, TypeVar

import numpy as np
import torch

from oneshot_fl import plots
from oneshot_fl.engine.distill import Checkpoint, DistillSettings, distill
from oneshot_fl.engine.pool import SyntheticPool
from oneshot_fl.engine.synthesizer import GeneratorLoss, GeneratorSynthesizer
from oneshot_fl.engine.teachers import ClientEnsemble, MeanLogits, Teacher
from oneshot_fl.config import distill_schedule
from oneshot_fl.data.datasets import DATASETS, to_tensor
from oneshot_fl.evaluation import evaluate_logits
from oneshot_fl.models.generator import GeneratorSpec
from oneshot_fl.models.registry import build
from oneshot_fl.uploads import Upload
from strategies.base import OneShotStrategy
from strategies.context import FuseContext, FuseResult

log = logging.getLogger("oneshot_fl.strategy")
# the fast path checkpoints the distillation at most once a minute (benchmarks/results/cost_model.md: at the paper
# preset a checkpoint, with its pool of 200 synthetic batches, costs seconds, and an epoch on a GPU about as much)
FAST_CHECKPOINT_INTERVAL_S = 60.0
Stage = TypeVar("Stage")


def client_models(uploads: list[Upload], ctx: FuseContext) -> list[torch.nn.Module]:
    models = []
    for up in uploads:
        model = build(up.arch, ctx.input_shape, ctx.num_classes)
        model.load_state_dict(up.state)
        models.append(ctx.fast.prepare(model.to(ctx.device)).eval())
    return models


def uploads_digest(uploads: list[Upload]) -> str:
    """What the uploads hold (partition, architecture, every tensor), not which node sent them: a re-run
    simulation gives its SuperNodes new ids, and the same uploads must still resume their checkpoint."""
    digest = hashlib.sha256()
    for up in uploads:
        digest.update(f"{up.partition_id}/{up.arch}".encode())
        for key in sorted(up.state):
            digest.update(up.state[key].contiguous().numpy().tobytes())
    return digest.hexdigest()


@torch.no_grad()
def client_test_logits(ensemble: ClientEnsemble, ctx: FuseContext, batch_size: int = 512) -> torch.Tensor:
    """(m, n, c) float32 logits of every client in the bank on the test set, on the CPU: one pass of the clients (on
    CIFAR-10 minutes on a CPU) that the teachers' accuracies and the report's per-client recall both read."""
    held, out = ctx.held_test, []
    for first in range(0, len(ctx.test), batch_size):
        window = slice(first, first + batch_size)
        x = held.batch(window) if held is not None else to_tensor(ctx.test.images[window]).to(ctx.device)
        out.append(ensemble.logits(x).float().cpu())
    return torch.cat(out, dim=1)


def per_class_recall(client_logits: torch.Tensor, labels: np.ndarray) -> torch.Tensor:
    """(c, m): the share of the test images of class j that client k calls j (nan for a class without images)."""
    y = torch.as_tensor(labels, dtype=torch.long)
    predicted = client_logits.argmax(dim=2)  # (m, n)
    return torch.stack([(predicted[:, y == j] == j).float().mean(dim=1) if bool((y == j).any())
                        else torch.full((client_logits.shape[0],), float("nan"))
                        for j in range(client_logits.shape[2])])


@torch.no_grad()
def teacher_accuracies(ensemble: ClientEnsemble, aggregators: dict[str, tuple], ctx: FuseContext,
                       batch_size: int = 512, client_logits: torch.Tensor | None = None) -> dict[str, float]:
    """Test accuracy of several teachers over one ensemble: {name: (aggregator, oracle_labels)} -> {name: acc}.

    Every aggregator combines the same client logits, batch by batch (`client_logits`: the bank's, from
    `client_test_logits`; without them the clients run here, once per test batch). Without `oracle_labels` a teacher
    answers without labels (label-routed SA uses its label-free weights); with it, routed by the true test labels: a
    diagnostic of the teacher a label-routed student learns from on synthetic data (whose labels are known), never a
    deployable model."""
    if client_logits is None:
        client_logits = client_test_logits(ensemble, ctx, batch_size)
    out: dict[str, list[torch.Tensor]] = {name: [] for name in aggregators}
    with ExitStack() as still:  # a teacher with running statistics is scored as it stands, without moving them
        for aggregator, _ in aggregators.values():
            still.enter_context(aggregator.frozen() if hasattr(aggregator, "frozen") else nullcontext())
        for first in range(0, len(ctx.test), batch_size):
            window = slice(first, first + batch_size)
            batch = client_logits[:, window].to(ctx.device)
            labels = torch.as_tensor(ctx.test.labels[window]).long().to(ctx.device)
            for name, (aggregator, oracle_labels) in aggregators.items():
                out[name].append(aggregator(batch, labels if oracle_labels else None).float())
    return {name: evaluate_logits(torch.cat(logits).cpu(), ctx.test.labels, ctx.num_classes).accuracy
            for name, logits in out.items()}


def teacher_accuracy(teacher: Teacher, ctx: FuseContext, batch_size: int = 512, oracle_labels: bool = False) -> float:
    """Test accuracy of one teacher (see `teacher_accuracies`)."""
    return teacher_accuracies(teacher.ensemble, {"teacher": (teacher.aggregator, oracle_labels)}, ctx,
                              batch_size)["teacher"]


class DataFreeDistillation(OneShotStrategy):
    """Base of the generator-based data-free methods."""

    uploads_fingerprint: str | None = None  # `fingerprint` of the uploads being fused (set by `fuse`)

    @abstractmethod
    def make_aggregator(self, ensemble: ClientEnsemble, uploads: list[Upload], ctx: FuseContext) -> tuple[Any, dict]:
        """How the teacher combines the (m, b, c) client logits (may run a stage such as MS), and what that stage
        reports for result.json's `global` block ({} when nothing)."""

    def test_report(self, report: dict, recall: torch.Tensor, uploads: list[Upload], ctx: FuseContext) -> None:
        """Add to the aggregation's report what the central test set says of it: `recall` (c, m) is each client's
        per-class test recall. Report only: the teacher is built before this runs. Nothing by default."""

    @abstractmethod
    def generator_loss(self) -> GeneratorLoss:
        ...

    def student_beta(self) -> float:
        return 0.0

    def fingerprint(self, uploads: list[Upload]) -> str:
        keys = {k: v for k, v in sorted(self.cfg.flat.items())
                if k.startswith(("distill.", f"{self.name}.")) or k in ("seed", "server-model", "method")}
        return hashlib.sha256((json.dumps(keys, sort_keys=True) + uploads_digest(uploads)).encode()).hexdigest()

    def cached_stage(self, name: str, kind: type[Stage], ctx: FuseContext, compute: Callable[[], Stage]) -> Stage:
        """A pre-distillation stage's result (`kind`: a dataclass of tensors, numbers, strings, None), computed once
        per run: saved as checkpoints/<name>.pt right after it is computed, keyed by the fingerprint of the
        distillation checkpoint (the uploads and the method's settings), and loaded instead by a resumed run
        (the log says so). A file of another configuration, or one that cannot be read safely, is ignored with a
        warning (engine.distill.Checkpoint) and the stage runs again. Outside `fuse` (a stage called on its own)
        there is no fingerprint, and nothing is cached."""
        if self.uploads_fingerprint is None:
            return compute()
        checkpoint = Checkpoint(ctx.run_dir / "checkpoints" / f"{name}.pt", self.uploads_fingerprint)
        fields = tuple(field.name for field in dataclasses.fields(kind))
        state = checkpoint.load(required=fields)
        if state is not None:
            log.info("%s: %s reused from %s (saved by the interrupted run); not computed again", self.name, name,
                     checkpoint.path)
            return kind(**{field: state[field] for field in fields})
        value = compute()
        checkpoint.save({field: getattr(value, field) for field in fields})
        return value

    def fuse(self, uploads: list[Upload], ctx: FuseContext) -> FuseResult:
        cfg, dcfg = self.cfg, self.cfg.distill
        if ctx.fast.on:
            log.info("%s: fast path on %s: %s", self.name, ctx.device, ctx.fast.describe())
        self.uploads_fingerprint = self.fingerprint(uploads)
        ensemble = ClientEnsemble(client_models(uploads, ctx), [up.arch for up in uploads],
                                  no_bn_note=self.bn_prior_note(uploads))
        try:
            # every client on the test set once, before any leaves the bank: the report's per-client recall and the
            # teachers' accuracies read it; the method itself never does
            test_logits = client_test_logits(ensemble, ctx)
            aggregator, report = self.make_aggregator(ensemble, uploads, ctx)
            self.test_report(report, per_class_recall(test_logits, ctx.test.labels), uploads, ctx)
            teacher = Teacher(ensemble, aggregator)
            # ensemble_accuracy: the teacher the student distils from, as it answers without labels
            teachers = {"ensemble_accuracy": (aggregator, False)}
            if getattr(aggregator, "needs_labels", False):
                teachers["teacher_label_routed_oracle_accuracy"] = (aggregator, True)
            if not isinstance(aggregator, MeanLogits):
                teachers["mean_ensemble_accuracy"] = (MeanLogits(), False)
            metrics = teacher_accuracies(ensemble, teachers, ctx, client_logits=test_logits[ensemble.indices])
            log.info("%s teacher accuracy on the test set: %s", self.name,
                     ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            arch = cfg.global_arch
            student = self.init_student(arch, uploads, ctx)
            synthesizer = self.make_synthesizer(teacher, student, ctx)
            pool = SyntheticPool(distill_schedule(cfg)[0], dcfg.pool_max_batches, dcfg.kd_steps, dcfg.synth_batch,
                                 device=ctx.device if ctx.fast.device_data else "cpu")
            settings = self.distill_settings()
            checkpoint = Checkpoint(ctx.run_dir / "checkpoints" / "distill.pt", self.uploads_fingerprint)
            extras = self.distill_extras(teacher, synthesizer, pool, ctx)
            with ctx.timer.phase("distillation"):
                history, resumed_from = distill(
                    student, synthesizer, pool, settings, lambda m: ctx.evaluate(m).accuracy,
                    seed=ctx.seed("kd"), checkpoint=checkpoint, before_epoch=self.before_epoch,
                    label=self.name, fast=ctx.fast, **extras)
            images, labels = pool.last(20 * ctx.num_classes * 4)
            plots.sample_grid(images, labels, ctx.num_classes, ctx.run_dir / "synthetic_samples.png",
                              title=f"{self.name}: synthetic samples of the last pool batches, one row per class",
                              class_names=DATASETS[cfg.dataset].class_names)
            if getattr(aggregator, "adapts", False):  # the teacher moved with the synthetic batches: as it ended
                metrics["ensemble_accuracy_start"] = metrics["ensemble_accuracy"]
                metrics["ensemble_accuracy"] = teacher_accuracies(ensemble, {"teacher": (aggregator, False)}, ctx,
                                                                  client_logits=test_logits[ensemble.indices])["teacher"]
                log.info("%s teacher accuracy at the end of distillation: %.4f (start %.4f)", self.name,
                         metrics["ensemble_accuracy"], metrics["ensemble_accuracy_start"])
            accuracies = [h["accuracy"] for h in history if h["accuracy"] is not None]
            best = max(range(len(history)), key=lambda i: history[i]["accuracy"] or -1.0)
            metrics.update({"accuracy_best": max(accuracies), "best_epoch": history[best]["epoch"],
                            "student_arch": arch, "resumed_from_epoch": resumed_from,
                            "fast_path": ctx.fast.as_dict(), **report})
            return FuseResult(model=student, arch=arch, metrics=metrics, history=history)
        finally:
            ensemble.close()

    def bn_prior_note(self, uploads: list[Upload]) -> str:
        """The one log line for a fleet of differentially private uploads, which carry no BN statistics: the
        generator's BN-statistics prior is off (its term is 0: no teacher has a BN layer to hook), every other
        term as configured. "" for other fleets (the ensemble's own warning covers a fleet without BN)."""
        private = [up for up in uploads if up.dp is not None]
        if not private:
            return ""
        worst = max(up.dp.epsilon for up in private)
        return (f"{self.name}: BN-statistics prior off: the {len(private)} differentially private uploads "
                f"(epsilon <= {worst:.3g}) carry no BN statistics (GroupNorm teachers), so the generator's BN term "
                f"(weight {self.generator_loss().bn:g}) is 0; its other terms as configured")

    def init_student(self, arch: str, uploads: list[Upload], ctx: FuseContext) -> torch.nn.Module:
        """A fresh seeded student; in multi-round mode the previous global model (FedHydra D14)."""
        student = build(arch, ctx.input_shape, ctx.num_classes, seed=ctx.seed("student"))
        if ctx.previous_model is not None:
            student.load_state_dict(ctx.previous_model.state_dict())
        return ctx.fast.prepare(student.to(ctx.device))

    def make_synthesizer(self, teacher: Teacher, student: torch.nn.Module, ctx: FuseContext):
        """Where the KD batches come from: the generator trained against teacher and student."""
        dcfg = self.cfg.distill
        channels, size, _ = ctx.input_shape
        spec = GeneratorSpec(dcfg.nz, dcfg.ngf, size, channels)
        return GeneratorSynthesizer(
            teacher, student, spec, self.generator_loss(), ctx.num_classes, dcfg.synth_batch,
            dcfg.generator_steps, dcfg.lr_generator, ctx.seed("generator"), ctx.device,
            reset_each_epoch=dcfg.reset_generator, fast=ctx.fast)

    def distill_settings(self) -> DistillSettings:
        """The student's optimisation (methods with their own KD schedule override it)."""
        dcfg = self.cfg.distill
        return DistillSettings(epochs=dcfg.epochs, lr=dcfg.lr_student, temperature=dcfg.temperature,
                               beta=self.student_beta(), eval_every=dcfg.eval_every,
                               checkpoint_every=dcfg.eval_every, lr_schedule=distill_schedule(self.cfg)[1],
                               checkpoint_min_interval=FAST_CHECKPOINT_INTERVAL_S if self.ctx.fast.on else 0.0)

    def distill_extras(self, teacher: Teacher, synthesizer, pool: SyntheticPool, ctx: FuseContext) -> dict:
        """Extra arguments of the KD loop (`kd_transform`, `early_stop`); none by default."""
        return {}

    def before_epoch(self, epoch: int) -> None:
        """Per-epoch hook for methods that adapt their teacher during distillation (Co-Boosting)."""
