"""Data-free distillation methods (DENSE, FedHydra, and the ones built on them): the shared fuse.

uploads -> frozen client models -> teacher (ensemble + the method's aggregator) -> generator
synthesizer -> pool -> distill the student -> FuseResult. A method only says how its teacher
combines clients (`make_aggregator`), which generator losses it uses (`generator_loss`) and the
weight of the student's hard-label CE (`student_beta`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from abc import abstractmethod
from typing import Callable, TypeVar

import torch

from oneshot_fl import plots
from oneshot_fl.engine.distill import Checkpoint, DistillSettings, distill
from oneshot_fl.engine.pool import SyntheticPool
from oneshot_fl.engine.synthesizer import GeneratorLoss, GeneratorSynthesizer
from oneshot_fl.engine.teachers import ClientEnsemble, MeanLogits, Teacher
from oneshot_fl.data.datasets import DATASETS, to_tensor
from oneshot_fl.evaluation import evaluate_logits
from oneshot_fl.models.generator import GeneratorSpec
from oneshot_fl.models.registry import build
from oneshot_fl.uploads import Upload
from strategies.base import OneShotStrategy
from strategies.context import FuseContext, FuseResult

log = logging.getLogger("oneshot_fl.strategy")
Stage = TypeVar("Stage")


def client_models(uploads: list[Upload], ctx: FuseContext) -> list[torch.nn.Module]:
    models = []
    for up in uploads:
        model = build(up.arch, ctx.input_shape, ctx.num_classes)
        model.load_state_dict(up.state)
        models.append(model.to(ctx.device).eval())
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
def teacher_accuracies(ensemble: ClientEnsemble, aggregators: dict[str, tuple], ctx: FuseContext,
                       batch_size: int = 512) -> dict[str, float]:
    """Test accuracy of several teachers over one ensemble: {name: (aggregator, oracle_labels)} -> {name: acc}.

    The client models run once per test batch and every aggregator combines the same logits (on
    CIFAR-10 the clients' forward over the test set is minutes on a CPU; FedHydra's paper mode asks for three
    teachers). Without `oracle_labels` a teacher answers without labels (label-routed SA uses its
    label-free weights); with it, routed by the true test labels: a diagnostic of the teacher a
    label-routed student learns from on synthetic data (whose labels are known), never a deployable model."""
    out: dict[str, list[torch.Tensor]] = {name: [] for name in aggregators}
    for first in range(0, len(ctx.test), batch_size):
        x = to_tensor(ctx.test.images[first:first + batch_size]).to(ctx.device)
        labels = torch.as_tensor(ctx.test.labels[first:first + batch_size]).long().to(ctx.device)
        client_logits = ensemble.logits(x)
        for name, (aggregator, oracle_labels) in aggregators.items():
            out[name].append(aggregator(client_logits, labels if oracle_labels else None).float().cpu())
    return {name: evaluate_logits(torch.cat(logits), ctx.test.labels, ctx.num_classes).accuracy
            for name, logits in out.items()}


def teacher_accuracy(teacher: Teacher, ctx: FuseContext, batch_size: int = 512, oracle_labels: bool = False) -> float:
    """Test accuracy of one teacher (see `teacher_accuracies`)."""
    return teacher_accuracies(teacher.ensemble, {"teacher": (teacher.aggregator, oracle_labels)}, ctx,
                              batch_size)["teacher"]


class DataFreeDistillation(OneShotStrategy):
    """Base of the generator-based data-free methods."""

    uploads_fingerprint: str | None = None  # `fingerprint` of the uploads being fused (set by `fuse`)

    @abstractmethod
    def make_aggregator(self, ensemble: ClientEnsemble, uploads: list[Upload], ctx: FuseContext):
        """How the teacher combines the (m, b, c) client logits (may run a stage such as MS)."""

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
        self.uploads_fingerprint = self.fingerprint(uploads)
        ensemble = ClientEnsemble(client_models(uploads, ctx), [up.arch for up in uploads],
                                  no_bn_note=self.bn_prior_note(uploads))
        try:
            aggregator = self.make_aggregator(ensemble, uploads, ctx)
            teacher = Teacher(ensemble, aggregator)
            # ensemble_accuracy: the teacher the student distils from, as it answers without labels
            teachers = {"ensemble_accuracy": (aggregator, False)}
            if getattr(aggregator, "needs_labels", False):
                teachers["teacher_label_routed_oracle_accuracy"] = (aggregator, True)
            if not isinstance(aggregator, MeanLogits):
                teachers["mean_ensemble_accuracy"] = (MeanLogits(), False)
            metrics = teacher_accuracies(ensemble, teachers, ctx)
            log.info("%s teacher accuracy on the test set: %s", self.name,
                     ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
            arch = cfg.global_arch
            student = self.init_student(arch, uploads, ctx)
            synthesizer = self.make_synthesizer(teacher, student, ctx)
            pool = SyntheticPool(dcfg.pool, dcfg.pool_max_batches, dcfg.kd_steps, dcfg.synth_batch)
            settings = self.distill_settings()
            checkpoint = Checkpoint(ctx.run_dir / "checkpoints" / "distill.pt", self.uploads_fingerprint)
            extras = self.distill_extras(teacher, synthesizer, pool, ctx)
            with ctx.timer.phase("distillation"):
                history, resumed_from = distill(
                    student, synthesizer, pool, settings, lambda m: ctx.evaluate(m).accuracy,
                    seed=ctx.seed("kd"), checkpoint=checkpoint, before_epoch=self.before_epoch,
                    label=self.name, **extras)
            images, labels = pool.last(20 * ctx.num_classes * 4)
            plots.sample_grid(images, labels, ctx.num_classes, ctx.run_dir / "synthetic_samples.png",
                              title=f"{self.name}: synthetic samples of the last pool batches, one row per class",
                              class_names=DATASETS[cfg.dataset].class_names)
            accuracies = [h["accuracy"] for h in history if h["accuracy"] is not None]
            best = max(range(len(history)), key=lambda i: history[i]["accuracy"] or -1.0)
            metrics.update({"accuracy_best": max(accuracies), "best_epoch": history[best]["epoch"],
                            "student_arch": arch, "resumed_from_epoch": resumed_from, **self.extra_metrics()})
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
        return student.to(ctx.device)

    def make_synthesizer(self, teacher: Teacher, student: torch.nn.Module, ctx: FuseContext):
        """Where the KD batches come from: the generator trained against teacher and student."""
        dcfg = self.cfg.distill
        channels, size, _ = ctx.input_shape
        spec = GeneratorSpec(dcfg.nz, dcfg.ngf, size, channels)
        return GeneratorSynthesizer(
            teacher, student, spec, self.generator_loss(), ctx.num_classes, dcfg.synth_batch,
            dcfg.generator_steps, dcfg.lr_generator, ctx.seed("generator"), ctx.device,
            reset_each_epoch=dcfg.reset_generator)

    def distill_settings(self) -> DistillSettings:
        """The student's optimisation (methods with their own KD schedule override it)."""
        dcfg = self.cfg.distill
        return DistillSettings(epochs=dcfg.epochs, lr=dcfg.lr_student, temperature=dcfg.temperature,
                               beta=self.student_beta(), eval_every=dcfg.eval_every,
                               checkpoint_every=dcfg.eval_every, lr_schedule=dcfg.lr_schedule)

    def distill_extras(self, teacher: Teacher, synthesizer, pool: SyntheticPool, ctx: FuseContext) -> dict:
        """Extra arguments of the KD loop (`kd_transform`, `early_stop`); none by default."""
        return {}

    def extra_metrics(self) -> dict:
        """Method-specific entries for result.json's `global` block (after distillation)."""
        return {}

    def before_epoch(self, epoch: int) -> None:
        """Per-epoch hook for methods that adapt their teacher during distillation (Co-Boosting)."""
