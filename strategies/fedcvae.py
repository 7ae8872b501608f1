"""FedCVAE-Ens (Heinbaugh, Luz-Ricca, Shao, "Data-Free One-Shot Federated Learning Under Very
High Statistical Heterogeneity", ICLR 2023): every client trains
a CVAE and uploads its decoder and label counts; the server draws from each decoder in
proportion to its data size, labels from that client's histogram, and trains a fresh classifier
on the draw with CE. No filtering, no distillation.

Same code path as FedMHO (strategies/decoderfusion.py). Clients train the CVAE of `cvae.arch`;
FedMHO's comparison used CVAE-large on every FedCVAE client (cvae.arch='cvae-large').
"""

from __future__ import annotations

from dataclasses import dataclass

from oneshot_fl.config import knob
from oneshot_fl.engine.decoders import ABSENT_POLICIES, ROUNDINGS, SCHEMES
from strategies.decoderfusion import DecoderFusion, DecoderFusionParams


@dataclass(frozen=True)
class FedCVAEParams(DecoderFusionParams):
    sampling: str = knob("histogram", choices=SCHEMES)  # FedCVAE-Ens: per-client data share and histogram
    absent_classes: str = knob("skip", choices=ABSENT_POLICIES)
    rounding: str = knob("exact", choices=ROUNDINGS)
    keep_ratio: float = knob(1.0, lo=0.0, hi=1.0, lo_open=True)  # FedCVAE does not filter


class FedCVAE(DecoderFusion):
    name = "fedcvae"
    roles = ("decoder",)
    Params = FedCVAEParams

    def client_config(self) -> dict:
        return {"role": "decoder"}  # every client is resource-constrained; node config role still wins
