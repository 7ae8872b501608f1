"""OT fusion baseline (Singh & Jaggi 2020, weight mode): every client model aligned to a reference
client with optimal transport, layer by layer, then averaged (oneshot_fl/fusion/ot.py). Needs one
architecture that is a plain conv/linear chain; refuses other fleets before any client trains."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from oneshot_fl.config import FleetNotSupported, knob
from oneshot_fl.fusion.averaging import HeterogeneousFleetError
from oneshot_fl.fusion.ot import UnsupportedModelError, layer_chain, ot_fuse
from oneshot_fl.models.registry import build
from oneshot_fl.uploads import Upload
from strategies.base import OneShotStrategy
from strategies.context import FuseContext, FuseResult

log = logging.getLogger("oneshot_fl.strategy")

PROBE_SAMPLES = 8  # random inputs for the check that exact alignments keep each model's outputs


@dataclass(frozen=True)
class OTParams:
    reference: str = knob("first", choices=("first", "largest"))
    solver: str = knob("emd", choices=("emd", "sinkhorn"))
    sinkhorn_reg: float = knob(0.01, lo=0.0, lo_open=True)
    weighting: str = knob("num-examples", choices=("num-examples", "uniform"))


class OTFusion(OneShotStrategy):
    name = "ot"
    Params = OTParams

    def check_fleet(self) -> None:
        archs = self.cfg.client_archs
        if len(archs) > 1:
            raise FleetNotSupported(f"ot aligns and averages parameters and cannot fuse a heterogeneous fleet "
                              f"(client-models={','.join(self.cfg.client_models)}); use a data-free method "
                              "such as fedhydra, dense, coboosting or feddf")
        arch = archs.pop()
        try:
            layer_chain(build(arch, self.ctx.input_shape, self.ctx.num_classes), arch)
        except UnsupportedModelError as exc:
            raise FleetNotSupported(f"ot cannot fuse {arch} models: {exc}") from None

    def fuse(self, uploads: list[Upload], ctx: FuseContext) -> FuseResult:
        archs = sorted({up.arch for up in uploads})
        if len(archs) > 1:
            raise HeterogeneousFleetError(f"ot cannot align different architectures ({', '.join(archs)}); "
                                          "use a data-free method for heterogeneous fleets")
        p, arch = self.params, archs[0]
        reference = 0 if p.reference == "first" else max(range(len(uploads)), key=lambda i: uploads[i].num_examples)
        weights = [up.num_examples if p.weighting == "num-examples" else 1.0 for up in uploads]
        model = build(arch, ctx.input_shape, ctx.num_classes)
        probe = torch.rand((PROBE_SAMPLES, *ctx.input_shape), generator=torch.Generator().manual_seed(ctx.seed("ot")))
        with ctx.timer.phase("alignment"):
            state = ot_fuse([up.state for up in uploads], weights, model, reference, p.solver, p.sinkhorn_reg,
                            arch, probe)
            model.load_state_dict(state)
        log.info("ot: %d %s models aligned to p%d (%s) and averaged", len(uploads), arch,
                 uploads[reference].partition_id, p.solver)
        return FuseResult(model=model.to(ctx.device), arch=arch,
                          metrics={"reference_partition": uploads[reference].partition_id, "solver": p.solver})
