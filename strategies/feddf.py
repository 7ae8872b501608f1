"""FedDF (Lin et al., NeurIPS 2020): ensemble distillation of the client models into a student
initialised from their FedAvg ("Ensemble Distillation for Robust Model Fusion in Federated Learning",
Algorithm 1; data-free here by default: a CE-only generator replaces the unlabelled public data).

- teacher: the mean of the client logits; KL at distill.temperature (1 by default), no hard-label CE;
- distillation data (feddf.source): `generator` = DENSE's generator trained with CE only (no BN or
  adversarial term; the data-free reading of FedDF used by DENSE and FedHydra), or `dataset` =
  unlabelled images of another dataset from the data directory (FedDF's original setting);
- student: FedAvg of the uploads (sample-weighted) when every client has the server's architecture,
  from scratch otherwise (heterogeneous fleets); Adam 1e-3 with cosine annealing (FedDF code);
- early stopping: a share of every distillation batch is held out; training stops after `patience`
  epochs without a lower held-out KL to the teacher and the best student is kept (FedDF validates
  on labelled data, which a data-free server does not have).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from oneshot_fl.config import ConfigError, knob, resolve_data_dir
from oneshot_fl.data.datasets import DATASETS, load_split
from oneshot_fl.engine.early_stop import EarlyStopping
from oneshot_fl.engine.sources import HoldoutSynthesizer, ProxySynthesizer
from oneshot_fl.engine.synthesizer import GeneratorLoss
from oneshot_fl.engine.teachers import MeanLogits
from oneshot_fl.fusion.averaging import average_states
from oneshot_fl.models.registry import build
from strategies.datafree import DataFreeDistillation

log = logging.getLogger("oneshot_fl.strategy")

MAX_HELD_OUT = 2048  # samples kept in the held-out split (FIFO)


@dataclass(frozen=True)
class FedDFParams:
    source: str = knob("generator", choices=("generator", "dataset"))
    public_dataset: str = knob("")  # source=dataset: a dataset name of the data directory
    val_fraction: float = knob(0.2, lo=0.0, hi=0.9)
    patience: int = knob(10, lo=0)  # epochs; 0 = no early stopping
    optimizer: str = knob("adam", choices=("adam", "sgd"))
    lr: float = knob(1e-3, lo=0.0, lo_open=True)
    lr_schedule: str = knob("cosine", choices=("cosine", "constant"))
    init: str = knob("fedavg", choices=("fedavg", "scratch"))


class FedDF(DataFreeDistillation):
    name = "feddf"
    Params = FedDFParams

    def check_fleet(self) -> None:
        p = self.params
        if p.source != "dataset":
            return
        if not p.public_dataset:
            raise ConfigError("feddf.source='dataset' needs feddf.public-dataset (a dataset of the data "
                              f"directory other than {self.cfg.dataset!r}, e.g. 'fmnist' for mnist runs)")
        if p.public_dataset not in DATASETS:
            raise ConfigError(f"feddf.public-dataset={p.public_dataset!r} is not a known dataset; choose one "
                              f"of: {', '.join(DATASETS)}")
        if p.public_dataset == self.cfg.dataset:
            raise ConfigError(f"feddf.public-dataset={p.public_dataset!r} is the clients' own dataset; the "
                              "distillation data must be public data the clients did not train on")

    @property
    def early_stopping(self) -> bool:
        return self.params.patience > 0 and self.params.val_fraction > 0

    def make_aggregator(self, ensemble, uploads, ctx):
        return MeanLogits(), {}

    def generator_loss(self) -> GeneratorLoss:
        return GeneratorLoss(ce=1.0, bn=0.0, adv=0.0)

    def init_student(self, arch, uploads, ctx):
        if self.params.init == "fedavg" and all(up.arch == arch for up in uploads):
            student = build(arch, ctx.input_shape, ctx.num_classes)
            student.load_state_dict(average_states([up.state for up in uploads], [up.num_examples for up in uploads]))
            self.init_kind = "fedavg"
            self.init_accuracy = ctx.evaluate(student.to(ctx.device)).accuracy
            log.info("feddf: student starts from the FedAvg model (test accuracy %.4f)", self.init_accuracy)
            return student.to(ctx.device)
        self.init_kind, self.init_accuracy = "scratch", None
        why = ("feddf.init=scratch" if self.params.init == "scratch"
               else "the clients do not all have the server's architecture")
        log.info("feddf: student %s starts from scratch (%s)", arch, why)
        return super().init_student(arch, uploads, ctx)

    def make_synthesizer(self, teacher, student, ctx):
        p, dcfg = self.params, self.cfg.distill
        if p.source == "generator":
            source = super().make_synthesizer(teacher, student, ctx)
        else:
            public = load_split(p.public_dataset, "train", str(resolve_data_dir(self.cfg)), self.cfg.download)
            log.info("feddf: distilling on %d unlabelled %s images", len(public), p.public_dataset)
            source = ProxySynthesizer(teacher, public.images, ctx.input_shape, dcfg.synth_batch,
                                      ctx.seed("public-data"), ctx.device)
        return HoldoutSynthesizer(source, p.val_fraction, MAX_HELD_OUT) if self.early_stopping else source

    def distill_settings(self):
        p = self.params
        return dataclasses.replace(super().distill_settings(), optimizer=p.optimizer, lr=p.lr,
                                   lr_schedule=p.lr_schedule)

    def distill_extras(self, teacher, synthesizer, pool, ctx) -> dict:
        if not self.early_stopping:
            return {}
        return {"early_stop": EarlyStopping(synthesizer.validation, self.params.patience)}

    def fuse(self, uploads, ctx):
        result = super().fuse(uploads, ctx)
        last = result.history[-1] if result.history else {}
        result.metrics.update({"student_init": self.init_kind, "init_accuracy": self.init_accuracy,
                               "source": self.params.source, "epochs_run": last.get("epoch"),
                               "val_best_epoch": last.get("val_best_epoch")})
        return result
