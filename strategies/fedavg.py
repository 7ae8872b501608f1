"""One-shot FedAvg: one parameter average of the client models, BN statistics included."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from oneshot_fl.config import FleetNotSupported, knob
from oneshot_fl.fusion.averaging import HeterogeneousFleetError, average_states
from oneshot_fl.models.registry import build
from oneshot_fl.uploads import Upload
from strategies.base import OneShotStrategy
from strategies.context import FuseContext, FuseResult

log = logging.getLogger("oneshot_fl.strategy")


@dataclass(frozen=True)
class FedAvgParams:
    weighting: str = knob("num-examples", choices=("num-examples", "uniform"))  # DENSE/FedMHO: uniform


class FedAvg(OneShotStrategy):
    name = "fedavg"
    Params = FedAvgParams

    def check_fleet(self) -> None:
        if len(set(self.cfg.client_models)) > 1:
            raise FleetNotSupported(f"fedavg averages parameters and cannot fuse a heterogeneous fleet "
                              f"(client-models={','.join(self.cfg.client_models)}); use a data-free "
                              "method such as fedhydra or dense")

    def fuse(self, uploads: list[Upload], ctx: FuseContext) -> FuseResult:
        archs = sorted({up.arch for up in uploads})
        if len(archs) > 1:
            raise HeterogeneousFleetError(
                f"fedavg cannot average different architectures ({', '.join(archs)}); "
                "use fedhydra, dense or another data-free method for heterogeneous fleets")
        weights = [up.num_examples if self.params.weighting == "num-examples" else 1.0 for up in uploads]
        with ctx.timer.phase("averaging"):
            state = average_states([up.state for up in uploads], weights)
            model = build(archs[0], ctx.input_shape, ctx.num_classes)
            model.load_state_dict(state)
        return FuseResult(model=model.to(ctx.device), arch=archs[0])
