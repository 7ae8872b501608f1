"""FedHydra (Bai, Song, Wu et al.; newer version): Model Stratification, then SA-guided data-free
distillation (HASA). Spec: reference/fedhydra.md.

MS (stage 1) measures, for every client k and class j, how much a fresh generator's CE through
client k alone falls in T_G steps; U_r / U_c say whom to trust for which class. SA (Eqs. 8-11)
weights every client's logits with them, for the generator's CE and for the student's KL + beta
hard-label CE (Eq. 19).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from oneshot_fl import plots
from oneshot_fl.config import knob
from oneshot_fl.engine.stratify import Stratification, stratify, stratify_sequential
from oneshot_fl.engine.synthesizer import GeneratorLoss
from oneshot_fl.engine.teachers import StratifiedAggregation
from oneshot_fl.models.generator import GeneratorSpec
from oneshot_fl.results import write_json
from strategies.datafree import DataFreeDistillation

log = logging.getLogger("oneshot_fl.strategy")


@dataclass(frozen=True)
class FedHydraParams:
    ms_steps: int = knob(30, lo=1)  # T_G of each (client, class) stratification run
    ms_batch: int = knob(0, lo=0)  # noise batch of each run; 0 = distill.synth-batch
    ms_batched: str = knob("auto", choices=("auto", "yes", "no"))  # vmapped MS (auto: on GPUs)
    lambda_bn: float = knob(1.0, lo=0.0)
    lambda_adv: float = knob(1.0, lo=0.0)
    beta: float = knob(1.0, lo=0.0)
    sa_space: str = knob("logits", choices=("logits", "probs"))
    adv_mask: str = knob("none", choices=("none", "disagree", "agree"))


class FedHydra(DataFreeDistillation):
    name = "fedhydra"
    Params = FedHydraParams

    def make_aggregator(self, ensemble, uploads, ctx):
        with ctx.timer.phase("stratification"):
            result = self.stratify(ensemble, ctx)
        write_json(ctx.run_dir / "stratification.json", {
            **result.as_dict(), "clients": [f"p{up.partition_id} {up.arch}" for up in uploads]})
        for key, title in (("u_r", "U_r: whom to trust for each class (rows sum to 1)"),
                           ("u_c", "U_c: what each client is good at (columns sum to 1)")):
            plots.heatmap(getattr(result, key).numpy(), ctx.run_dir / f"stratification_{key}.png", title,
                          "client", "class")
        log.info("stratification done in %.1fs; U_r diagonal mass per client: %s", result.seconds,
                 [round(float(v), 3) for v in result.u_r.max(dim=0).values])
        return StratifiedAggregation(result.u_r, result.u_c, self.params.sa_space)

    def stratify(self, ensemble, ctx) -> Stratification:
        p, dcfg = self.params, self.cfg.distill
        channels, size, _ = ctx.input_shape
        spec = GeneratorSpec(dcfg.nz, dcfg.ngf, size, channels)
        batched = p.ms_batched == "yes" or (p.ms_batched == "auto" and ctx.device.type == "cuda")
        run = stratify if batched else stratify_sequential
        return run(ensemble.models, ctx.num_classes, spec, p.ms_steps, p.ms_batch or dcfg.synth_batch,
                   dcfg.lr_generator, ctx.seed("stratification"), ctx.device)

    def generator_loss(self) -> GeneratorLoss:
        p = self.params
        return GeneratorLoss(ce=1.0, bn=p.lambda_bn, adv=p.lambda_adv, adv_mask=p.adv_mask)

    def student_beta(self) -> float:
        return self.params.beta
