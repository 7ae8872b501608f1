"""DENSE (Zhang et al., NeurIPS 2022): mean-of-logits ensemble, generator with CE + BN +
disagreement-masked adversarial loss, KD of a fresh student ("DENSE: Data-Free One-Shot Federated
Learning", Sec. 2.2 data generation, Eq. 1-4, and Sec. 2.3 model distillation)."""

from __future__ import annotations

from dataclasses import dataclass

from oneshot_fl.config import knob
from oneshot_fl.engine.synthesizer import GeneratorLoss
from oneshot_fl.engine.teachers import MeanLogits
from strategies.datafree import DataFreeDistillation


@dataclass(frozen=True)
class DenseParams:
    lambda_bn: float = knob(1.0, lo=0.0)
    lambda_adv: float = knob(0.5, lo=0.0)  # paper; its README uses 1.0
    adv_mask: str = knob("disagree", choices=("none", "disagree", "agree"))


class Dense(DataFreeDistillation):
    name = "dense"
    Params = DenseParams

    def make_aggregator(self, ensemble, uploads, ctx):
        return MeanLogits(), {}

    def generator_loss(self) -> GeneratorLoss:
        p = self.params
        return GeneratorLoss(ce=1.0, bn=p.lambda_bn, adv=p.lambda_adv, adv_mask=p.adv_mask)
