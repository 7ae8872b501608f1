"""Co-Boosting (Dai et al., ICLR 2024): DENSE's pipeline with harder samples and a better ensemble,
boosting each other every epoch ("Enhancing One-Shot Federated Learning Through Data and Ensemble
Co-Boosting"; code: rong-dai/Co-Boosting).

- generator: hardness-weighted CE, mean_i (1 - p_i[y_i])^hs CE_i, plus the unmasked adversarial KL
  at T = 3 (BN loss off by default, as in the code);
- ensemble: weighted logits, sum_k w_k f_k / sum_k w_k, w = 1/K at first; from the second epoch on,
  one signed-gradient step per pool batch on CE(ensemble, generator target) (engine/reweight.py);
- KD: every batch is ODS-perturbed (engine/ods.py) and the teacher re-scored on the perturbed
  images with the current weights; KL at T = 4, SGD with weight decay 1e-4, cosine schedule over
  the epochs, student gradient norm clipped at 10.
Deviations (shared engine): fixed z (not optimised), balanced targets, no generator gradient clip;
the re-weighting runs before the epoch's synthesis (the code: just after it), over the same pool.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from dataclasses import dataclass

import torch

from oneshot_fl.config import knob
from oneshot_fl.engine.distill import Checkpoint
from oneshot_fl.engine.ods import ods_perturb
from oneshot_fl.engine.reweight import reweight_pass
from oneshot_fl.engine.synthesizer import GeneratorLoss
from oneshot_fl.engine.teachers import WeightedLogits
from strategies.datafree import DataFreeDistillation, teacher_accuracy

log = logging.getLogger("oneshot_fl.strategy")


@dataclass(frozen=True)
class CoBoostingParams:
    lambda_ce: float = knob(1.0, lo=0.0)  # ohg
    lambda_bn: float = knob(0.0, lo=0.0)  # bn (code default 0)
    lambda_adv: float = knob(1.0, lo=0.0)  # adv
    adv_temperature: float = knob(3.0, lo=0.0, lo_open=True)
    hardness: float = knob(1.0, lo=0.0)  # hs
    mu: float = knob(0.01, lo=0.0)
    mu_decay: float = knob(0.99, lo=0.0, hi=1.0)  # wdc
    reweight_passes: int = knob(1, lo=0)  # wa_steps; 0 = keep the uniform ensemble
    ods_eps: float = knob(4.0, lo=0.0)  # in 1/255 of [0, 1] inputs; 0 = no ODS
    kd_temperature: float = knob(4.0, lo=0.0, lo_open=True)
    weight_decay: float = knob(1e-4, lo=0.0)
    lr_schedule: str = knob("cosine", choices=("cosine", "constant"))
    grad_clip: float = knob(10.0, lo=0.0)


class CoBoosting(DataFreeDistillation):
    name = "coboosting"
    Params = CoBoostingParams

    def make_aggregator(self, ensemble, uploads, ctx):
        self.ensemble, self.fuse_ctx = ensemble, ctx  # before_epoch gets only the epoch number
        self.aggregator = WeightedLogits(torch.full((len(ensemble),), 1.0 / len(ensemble)))
        self.weight_history = [{"epoch": 0, "weights": self.aggregator.weights.tolist()}]
        self.final_ensemble_accuracy = None
        self._logit_cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._weights_file = Checkpoint(ctx.run_dir / "checkpoints" / "coboosting_weights.pt",
                                        self.fingerprint(uploads))
        self._saved: dict[int, torch.Tensor] = {}
        self._last_epoch = 0
        return self.aggregator, {}  # the weights' course is reported after distillation (fuse)

    def generator_loss(self) -> GeneratorLoss:
        p = self.params
        return GeneratorLoss(ce=p.lambda_ce, bn=p.lambda_bn, adv=p.lambda_adv, adv_mask="none",
                             adv_temperature=p.adv_temperature, hardness=p.hardness)

    def distill_settings(self):
        p = self.params
        return dataclasses.replace(super().distill_settings(), temperature=p.kd_temperature,
                                   weight_decay=p.weight_decay, lr_schedule=p.lr_schedule, grad_clip=p.grad_clip)

    def distill_extras(self, teacher, synthesizer, pool, ctx) -> dict:
        self.teacher, self.pool = teacher, pool
        return {"kd_transform": self.perturb}

    def perturb(self, images: torch.Tensor, teacher_logits: torch.Tensor, rng: torch.Generator):
        """ODS step, then the teacher's logits on what the student will see (current weights)."""
        if self.params.ods_eps > 0:
            images = ods_perturb(lambda x: self.teacher(x)[0], images, self.params.ods_eps / 255.0, rng)
        return images, self.teacher.predict(images)

    def before_epoch(self, epoch: int) -> None:
        if epoch > 1 and self._last_epoch != epoch - 1:
            self._resume_weights(epoch - 1)
        self._last_epoch = epoch
        if epoch > 1 and self.params.reweight_passes:  # the code starts at its second epoch
            step = self.params.mu * self.params.mu_decay ** (epoch - 1)
            weights = self.aggregator.weights
            for _ in range(self.params.reweight_passes):
                weights = reweight_pass(weights, self._pool_logits(epoch), step)
            self.aggregator.weights = weights
            self.weight_history.append({"epoch": epoch, "weights": weights.tolist()})
            log.info("coboosting: epoch %d client weights %s", epoch, [round(w, 4) for w in weights.tolist()])
        self._saved[epoch] = self.aggregator.weights.clone()
        self._weights_file.save({"weights": self._saved})
        if epoch == self.cfg.distill.epochs:
            self.final_ensemble_accuracy = teacher_accuracy(self.teacher, self.fuse_ctx)

    def _pool_logits(self, epoch: int):
        """(client logits, generator targets) per pool batch, shuffled; client logits are cached
        per stored batch (the clients are frozen), so each pool image costs one pass in total."""
        live = {id(images): (images, labels) for images, labels in zip(self.pool.images, self.pool.labels)}
        self._logit_cache = {k: v for k, v in self._logit_cache.items() if k in live}
        order = list(live)
        random.Random(self.fuse_ctx.seed("reweight", epoch)).shuffle(order)
        device = self.fuse_ctx.device
        for key in order:
            images, labels = live[key]
            if key not in self._logit_cache:
                self._logit_cache[key] = (images, self.ensemble.logits(images.float().to(device)).cpu())
            yield self._logit_cache[key][1], labels

    def _resume_weights(self, epoch: int) -> None:
        state = self._weights_file.load()
        if state is None or epoch not in state["weights"]:
            raise RuntimeError(f"coboosting: resuming at epoch {epoch + 1} but its client weights were not "
                               f"saved in {self._weights_file.path}; delete the run's checkpoints to start over")
        self._saved = {e: w for e, w in state["weights"].items() if e <= epoch}
        self.aggregator.weights = self._saved[epoch].clone()
        log.info("coboosting: resumed client weights of epoch %d", epoch)

    def fuse(self, uploads, ctx):
        result = super().fuse(uploads, ctx)
        result.metrics.update({"client_weights": self.aggregator.weights.tolist(),
                               "weighted_ensemble_accuracy_final": self.final_ensemble_accuracy,
                               "weight_history": self.weight_history})
        return result
