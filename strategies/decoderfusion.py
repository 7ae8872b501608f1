"""Methods that train the global model on data drawn from uploaded CVAE decoders: the shared fuse
of the FedMHO family (FedMHO paper Sec. 4.2.2-4.4) and FedCVAE-Ens (Heinbaugh et al., ICLR 2023).

uploads -> start model (FedMHO: uniform FedAvg of the sufficient clients' classifiers, Eq. 4;
FedCVAE: a fresh model) -> DecoderSynthesizer (plan from the label counts, draw, filter) ->
teacher logits on the synthetic set, computed once (none / mean of the classifier clients /
the frozen start model) -> train_on_synthetic -> FuseResult. A method says how it starts
(`start_model`) and what teaches (`teacher_logits`); its paper defaults are its section's table in
oneshot_fl.paper_settings.PAPER_FUSION.

Every run also says how well the decoders' samples carry their classes: a cnn2 fitted on half the central
test split (the only real images a data-free server holds; it only measures) classifies the synthetic set,
and result.json gets `decoder_samples` (kept / drawn accuracy, per class, per decoder) beside
`synthetic_samples.png` (a row per class, the decoders in turn, each row labelled with its score).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
from torch import nn

from oneshot_fl import plots
from oneshot_fl.config import ConfigError, knob
from oneshot_fl.data.datasets import DATASETS, to_tensor
from oneshot_fl.engine.decoders import (ABSENT_POLICIES, ROUNDINGS, SCHEMES, DecoderSynthesizer, SyntheticSet,
                                        spread_by_source)
from oneshot_fl.engine.supervised import SupervisedSettings, fit_sample_scorer, score_samples, train_on_synthetic
from oneshot_fl.engine.teachers import ClientEnsemble, MeanLogits, Teacher
from oneshot_fl.models.cvae import build_decoder
from oneshot_fl.models.registry import build
from oneshot_fl.paper_settings import PAPER_FUSION
from oneshot_fl.uploads import Upload
from strategies.base import OneShotStrategy
from strategies.context import FuseContext, FuseResult
from strategies.datafree import client_models, teacher_accuracy

log = logging.getLogger("oneshot_fl.strategy")
SAMPLES_SHOWN = 10  # samples per class in synthetic_samples.png


@dataclass(frozen=True)
class DecoderFusionParams:
    """Generation, filtering and training knobs shared by every decoder-based method."""

    synthetic_samples: int = knob(6000, lo=1)  # N_syn drawn before filtering
    sampling: str = knob("squared", choices=SCHEMES)
    absent_classes: str = knob("uniform", choices=ABSENT_POLICIES)  # squared sampling only
    rounding: str = knob("exact", choices=ROUNDINGS)
    keep_ratio: float = knob(0.8, lo=0.0, hi=1.0, lo_open=True)  # R_th; 1 = no filtering
    epochs: int = knob(-1, lo=-1)  # -1 = the paper's value for the dataset
    lr: float = knob(0.0, lo=0.0)  # Adam; 0 = the paper's value for the dataset
    batch_size: int = knob(64, lo=1)
    eval_every: int = knob(1, lo=1)

    def __post_init__(self):
        if self.epochs == 0:
            raise ConfigError("epochs=0 after the preset: use -1 for the paper's value or a positive count")


def decoders_of(uploads: list[Upload], ctx: FuseContext) -> list[nn.Module]:
    decoders = []
    for up in uploads:
        decoder = build_decoder(up.arch, ctx.input_shape, ctx.num_classes, int(up.extra["latent-dim"]))
        decoder.load_state_dict(up.state)
        decoders.append(decoder.to(ctx.device).eval())
    return decoders


class DecoderFusion(OneShotStrategy):
    """Base of FedMHO (-MD, -SD) and FedCVAE-Ens."""

    Params = DecoderFusionParams
    synthesizer_class: ClassVar[type[DecoderSynthesizer]] = DecoderSynthesizer  # a benchmark may vary the filter

    def start_model(self, classifiers: list[Upload], ctx: FuseContext, metrics: dict) -> tuple[nn.Module, bool]:
        """The model fusion starts from, and whether it carries the classifier clients' knowledge."""
        arch = self.cfg.global_arch
        return build(arch, ctx.input_shape, ctx.num_classes, seed=ctx.seed("global-init")), False

    def teacher_logits(self, images: torch.Tensor, ensemble: ClientEnsemble | None, start: nn.Module,
                       informed: bool, ctx: FuseContext, metrics: dict) -> torch.Tensor | None:
        """Soft targets of the synthetic set (None: CE only). `ensemble`: the classifier clients."""
        return None

    def supervised_settings(self) -> SupervisedSettings:
        p = self.params
        epochs, lr = PAPER_FUSION[self.section or self.name][self.cfg.dataset]  # the paper's, for -1 / 0
        return SupervisedSettings(epochs=p.epochs if p.epochs > 0 else epochs, lr=p.lr or lr,
                                  batch_size=p.batch_size, eval_every=p.eval_every)

    def fuse(self, uploads: list[Upload], ctx: FuseContext) -> FuseResult:
        classifiers = [up for up in uploads if up.role == "classifier"]
        decoder_uploads = [up for up in uploads if up.role == "decoder"]
        metrics: dict = {"classifier_clients": len(classifiers), "decoder_clients": len(decoder_uploads)}
        with ctx.timer.phase("initialisation"):
            model, informed = self.start_model(classifiers, ctx, metrics)
            model = model.to(ctx.device)
            metrics["init_accuracy"] = ctx.evaluate(model).accuracy
        log.info("%s: start model %s, test accuracy %.4f", self.name, metrics.get("init", "fresh"),
                 metrics["init_accuracy"])
        ensemble = None
        if classifiers:  # the classifier clients' mean-logit ensemble: reported, and -md's teacher
            ensemble = ClientEnsemble(client_models(classifiers, ctx), [up.arch for up in classifiers])
        try:
            if ensemble is not None:
                metrics["ensemble_accuracy"] = teacher_accuracy(Teacher(ensemble, MeanLogits()), ctx)
            return self._fuse_decoders(decoder_uploads, ensemble, model, informed, ctx, metrics)
        finally:
            if ensemble is not None:
                ensemble.close()

    def _fuse_decoders(self, decoder_uploads: list[Upload], ensemble: ClientEnsemble | None, model: nn.Module,
                       informed: bool, ctx: FuseContext, metrics: dict) -> FuseResult:
        p, arch = self.params, self.cfg.global_arch
        if not decoder_uploads:  # not covered by the papers: nothing to generate from, the start model is the result
            log.warning("%s: no decoder uploads; the global model is the start model", self.name)
            metrics["fusion"] = "skipped: no decoder uploads"
            return FuseResult(model=model, arch=arch, metrics=metrics)

        counts = np.stack([up.label_counts for up in decoder_uploads])
        synthesizer = self.synthesizer_class(decoders_of(decoder_uploads, ctx), counts, p.synthetic_samples,
                                         p.sampling, p.absent_classes, p.rounding, p.keep_ratio,
                                         ctx.seed("decoder-sampling"), ctx.device)
        with ctx.timer.phase("generation"):
            drawn = synthesizer.draw()
        with ctx.timer.phase("filtering"):
            kept, dropped = synthesizer.filter(drawn)
        self.describe_synthetic(synthesizer.plan, drawn, kept, dropped, ctx, metrics)

        with ctx.timer.phase("teacher_logits"):
            teacher = self.teacher_logits(kept.images, ensemble, model, informed, ctx, metrics)
        settings = self.supervised_settings()
        metrics.update({"fusion_epochs": settings.epochs, "fusion_lr": settings.lr,
                        "fusion_kd": teacher is not None and settings.kd_weight > 0})
        with ctx.timer.phase("fusion"):
            history = train_on_synthetic(model, kept.images, kept.labels, teacher, settings,
                                         lambda m: ctx.evaluate(m).accuracy, ctx.seed("fusion"), label=self.name)
        accuracies = [h["accuracy"] for h in history if h["accuracy"] is not None]
        metrics["accuracy_best"] = max(accuracies)
        return FuseResult(model=model, arch=arch, metrics=metrics, history=history)

    def describe_synthetic(self, plan: np.ndarray, drawn: SyntheticSet, kept: SyntheticSet, dropped: SyntheticSet,
                           ctx: FuseContext, metrics: dict) -> None:
        """Counts into the metrics, the real-data scorer's verdict on the samples (`decoder_samples`), one sample
        grid per class for the kept samples (each row with its score) and for the dropped ones."""
        per_class = np.bincount(kept.labels.numpy(), minlength=ctx.num_classes).tolist()
        metrics["synthetic"] = {"plan": plan.tolist(), "drawn": len(drawn), "kept": len(kept),
                                "kept_per_class": per_class}
        log.info("%s: drew %d synthetic samples, kept %d (per class %s)", self.name, len(drawn), len(kept), per_class)
        scores = self.score_samples(drawn, kept, plan.shape[0], ctx)
        if scores is not None:
            metrics["decoder_samples"] = scores
        class_names = DATASETS[ctx.cfg.dataset].class_names
        shown = spread_by_source(kept, SAMPLES_SHOWN)
        title = f"{self.name}: kept synthetic samples (decoder outputs, decoders in turn), one row per class"
        if scores is not None:
            plots.scored_sample_grid(kept.images[shown], kept.labels[shown], ctx.num_classes,
                                     scores["kept_per_class"], ctx.run_dir / "synthetic_samples.png",
                                     per_class=SAMPLES_SHOWN, title=title, class_names=class_names,
                                     scorer="a cnn2 fitted on real test images")
        else:
            plots.sample_grid(kept.images[shown], kept.labels[shown], ctx.num_classes,
                              ctx.run_dir / "synthetic_samples.png", per_class=SAMPLES_SHOWN, title=title,
                              class_names=class_names)
        if len(dropped):
            plots.sample_grid(dropped.images, dropped.labels, ctx.num_classes,
                              ctx.run_dir / "synthetic_dropped.png",
                              title=f"{self.name}: dropped synthetic samples (filtered out), one row per class",
                              class_names=class_names)

    def score_samples(self, drawn: SyntheticSet, kept: SyntheticSet, decoders: int, ctx: FuseContext) -> dict | None:
        """How well the decoders' samples carry their classes: the share a classifier fitted on real images (half
        the central test split; oneshot_fl.engine.supervised says why that is no leak) assigns to the class each
        sample was drawn for; overall, per class, per decoder, for the kept and the drawn set. None without a test
        split to fit it on."""
        test = ctx.test
        if test is None or len(test) < 2 * ctx.num_classes or len(kept) == 0:
            return None
        with ctx.timer.phase("sample_scoring"):
            real = to_tensor(test.images)
            scorer, about = fit_sample_scorer(real, torch.as_tensor(test.labels, dtype=torch.long), ctx.num_classes,
                                              ctx.seed("sample-scorer"), ctx.device)
            on_kept = score_samples(scorer, kept.images, kept.labels, ctx.num_classes)
            on_drawn = score_samples(scorer, drawn.images, drawn.labels, ctx.num_classes)
            per_decoder = []
            for k in range(decoders):  # None: the decoder has no kept sample
                mine = kept.sources == k
                per_decoder.append(score_samples(scorer, kept.images[mine], kept.labels[mine],
                                                 ctx.num_classes)["accuracy"])
        log.info("%s: a %s fitted on %d real test images (%.4f on the %d held out) recognises %.4f of the kept "
                 "synthetic samples (%.4f of the drawn ones)", self.name, about["arch"], about["fitted_on"],
                 about["held_out_accuracy"], len(test) - about["fitted_on"], on_kept["accuracy"], on_drawn["accuracy"])
        return {"scorer": about, "kept_accuracy": on_kept["accuracy"], "kept_per_class": on_kept["per_class"],
                "drawn_accuracy": on_drawn["accuracy"], "drawn_per_class": on_drawn["per_class"],
                "kept_per_decoder": per_decoder}
