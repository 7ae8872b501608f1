"""Teachers: the frozen client models and the ways their logits are combined.

ClientEnsemble runs every client model on a batch and returns all logits, shape (m, b, c), plus
the BN-statistics loss of that forward. Clients of the same architecture run as one vectorised
call (torch.func.functional_call + vmap over stacked weights); mixed fleets loop per group.
Aggregators combine (m, b, c) logits into the teacher's (b, c):
  MeanLogits                 DENSE Eq. 1 (also the "AE" baseline of FedHydra)
  WeightedLogits             Co-Boosting's learnable client weights
  StratifiedAggregation      FedHydra Eqs. 8-11: P[i,j] = sum_k U_r[y_i,k] U_c[j,k] P_k[i,j] (paper),
                             or per output class: P[i,j] = sum_k U_r[j,k] P_k[i,j]
"""

from __future__ import annotations

import copy
import logging
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
from torch import nn
from torch.func import functional_call, stack_module_state, vmap

from oneshot_fl.engine.hooks import BNStatsLoss


def freeze(model: nn.Module) -> nn.Module:
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def _has_bn(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


class _LoopGroup:
    """Models run one after the other (mixed architectures, or where vmap does not pay off)."""

    def __init__(self, models: Sequence[nn.Module]):
        self.models = list(models)
        self.bn = BNStatsLoss(self.models, warn=False)  # ClientEnsemble says once when no client has BN

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.stack([model(x) for model in self.models])
        bn = torch.stack([sum(h.loss for h in hooks) if hooks else x.new_zeros(())
                          for hooks in self.bn.per_model])
        return logits, bn

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        with self.bn.paused():
            return torch.stack([model(x) for model in self.models])

    def to(self, device) -> "_LoopGroup":
        self.models = [m.to(device) for m in self.models]
        return self

    def remove_hooks(self) -> None:
        self.bn.remove()

    def hook_count(self) -> int:
        return sum(len(m._forward_hooks) for model in self.models for m in model.modules())


class _StackedGroup:
    """Models of one architecture as one call: functional_call + vmap over stacked weights.
    The BN losses are computed inside the vmapped call and returned with the logits.

    Under bf16 autocast the call runs on bf16 copies of the weights and the input: vmap's batched convolution
    does not pass through autocast (it would stay float32) and its BatchNorm takes one dtype, so here the
    running statistics the BN layers normalise with, and the BN-statistics loss compares against, are the
    bf16-rounded ones (relative 2^-9); the loss itself is still computed in float32 (engine/hooks.py)."""

    def __init__(self, models: Sequence[nn.Module]):
        self.base = freeze(copy.deepcopy(models[0])).to("meta")
        for module in self.base.modules():  # a deep copy would carry the original's hooks along
            module._forward_hooks.clear()
        params, buffers = stack_module_state(list(models))
        self.params = {k: v.detach() for k, v in params.items()}
        self.buffers = {k: v.detach() for k, v in buffers.items()}
        self.bn = BNStatsLoss([self.base], warn=False)
        self._cast: tuple[torch.dtype, dict, dict] | None = None  # the weights in the autocast dtype, made once

    def _weights(self, x: torch.Tensor) -> tuple[dict, dict, torch.Tensor]:
        """(params, buffers, input) for this call: the float32 ones, or their autocast-dtype copies."""
        device_type = x.device.type
        if not torch.is_autocast_enabled(device_type):
            return self.params, self.buffers, x
        dtype = torch.get_autocast_dtype(device_type)
        if self._cast is None or self._cast[0] != dtype:
            self._cast = (dtype, {k: v.to(dtype) for k, v in self.params.items()},
                          {k: v.to(dtype) if v.is_floating_point() else v for k, v in self.buffers.items()})
        return self._cast[1], self._cast[2], x.to(dtype)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hooks = self.bn.per_model[0]

        def one(params, buffers, inputs):
            out = functional_call(self.base, (params, buffers), (inputs,))
            bn = sum(h.loss for h in hooks) if hooks else out.new_zeros((), dtype=torch.float32)
            return out, bn

        logits, bn = vmap(one, in_dims=(0, 0, None))(*self._weights(x))
        for hook in hooks:  # drop the vmapped intermediates
            hook.loss = None
        return logits, bn

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        def one(params, buffers, inputs):
            return functional_call(self.base, (params, buffers), (inputs,))

        with self.bn.paused():
            return vmap(one, in_dims=(0, 0, None))(*self._weights(x))

    def to(self, device) -> "_StackedGroup":
        self.params = {k: v.to(device) for k, v in self.params.items()}
        self.buffers = {k: v.to(device) for k, v in self.buffers.items()}
        self._cast = None
        return self

    def remove_hooks(self) -> None:
        self.bn.remove()

    def hook_count(self) -> int:
        return sum(len(m._forward_hooks) for m in self.base.modules())


def _stack(logits: Sequence[torch.Tensor]) -> torch.Tensor:
    """The clients' logits as one (m, b, c) tensor; under autocast architectures may answer in different dtypes
    (bf16 from a final linear layer, float32 after an op autocast keeps in float32): then all in float32."""
    dtypes = {t.dtype for t in logits}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    return torch.stack([t.to(dtype) for t in logits])


class ClientEnsemble:
    """The frozen client models (eval mode) as one teacher bank.

    `forward(x)` -> (logits (m, b, c) in upload order, BN loss averaged over the clients that
    have BN layers). `vectorize`: run each architecture group as one vmapped call ("auto": on
    GPUs only; on CPUs the plain loop measured faster, see benchmarks/). `bn_cap` > 0: a client's
    BN loss counts for at most bn_cap x the median client's (that step, no gradient above it), so
    one client with wild BN statistics (weights scaled up, random) cannot take the generator over.
    `keep_only(kept)` drops clients from the bank (FedHydra's expelled clients). A bank without any BN
    layer says once that the BN loss is 0: `no_bn_note` (the method's words, e.g. why there are none) or a
    plain warning.
    """

    def __init__(self, models: Sequence[nn.Module], archs: Sequence[str], vectorize: bool | str = "auto",
                 bn_cap: float = 0.0, no_bn_note: str = ""):
        self.bn_cap = bn_cap
        self.models = [freeze(m) for m in models]
        self.indices = list(range(len(self.models)))  # each bank member's place in the upload order
        self.archs = list(archs)
        device = next(self.models[0].parameters()).device
        self.vectorize = device.type == "cuda" if vectorize == "auto" else bool(vectorize)
        self._build_runners()
        if not any(self.has_bn):
            if no_bn_note:
                logging.getLogger(__name__).info(no_bn_note)
            else:
                logging.getLogger(__name__).warning("no client model has BatchNorm: the BN loss is 0")

    def _build_runners(self) -> None:
        groups: dict[str, list[int]] = {}
        for i, arch in enumerate(self.archs):
            groups.setdefault(arch, []).append(i)
        self.groups = list(groups.values())
        self.runners = [_StackedGroup([self.models[i] for i in g]) if self.vectorize and len(g) > 1
                        else _LoopGroup([self.models[i] for i in g]) for g in self.groups]
        self.has_bn = [_has_bn(m) for m in self.models]

    def keep_only(self, kept: torch.Tensor) -> None:
        """Keep the clients where `kept` (m,) is True, in upload order; the others leave the bank (their hooks
        removed): every later forward, logits and BN loss alike, is the one an ensemble of the kept clients gives."""
        if not bool(kept.any()):
            raise ValueError("keep_only: at least one client must stay in the ensemble")
        self.close()
        self.models = [m for m, keep in zip(self.models, kept.tolist()) if keep]
        self.archs = [a for a, keep in zip(self.archs, kept.tolist()) if keep]
        self.indices = [i for i, keep in zip(self.indices, kept.tolist()) if keep]
        self._build_runners()

    def __len__(self) -> int:
        return len(self.models)

    @property
    def device(self) -> torch.device:
        return next(self.models[0].parameters()).device

    def to(self, device) -> "ClientEnsemble":
        self.models = [m.to(device) for m in self.models]
        self.runners = [r.to(device) for r in self.runners]
        return self

    def _in_upload_order(self, per_group: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """One value per architecture group, stacked over its clients -> one value per client, in upload order."""
        out: list[torch.Tensor | None] = [None] * len(self.models)
        for group, values in zip(self.groups, per_group):
            for j, i in enumerate(group):
                out[i] = values[j]
        return out

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        outputs = [runner(x) for runner in self.runners]
        logits = self._in_upload_order([out for out, _ in outputs])
        bn = self._in_upload_order([group_bn for _, group_bn in outputs])
        with_bn = [b for b, has in zip(bn, self.has_bn) if has]
        return _stack(logits), self.combine_bn(torch.stack(with_bn)) if with_bn else x.new_zeros(())

    def combine_bn(self, per_client: torch.Tensor) -> torch.Tensor:
        """The mean of the clients' BN losses, each at most bn_cap x their median (when bn_cap > 0)."""
        if self.bn_cap > 0:
            per_client = torch.minimum(per_client, self.bn_cap * per_client.detach().median())
        return per_client.mean()

    __call__ = forward

    @torch.no_grad()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """(m, b, c) logits in upload order, without the BN statistics (evaluation, KD targets)."""
        return _stack(self._in_upload_order([runner.logits(x) for runner in self.runners]))

    @contextmanager
    def bn_paused(self) -> Iterator[None]:
        """The client models answer without computing BN statistics inside the block: for the work
        that calls them directly and needs no BN loss (Model Stratification, the peer check)."""
        with ExitStack() as stack:
            for runner in self.runners:
                stack.enter_context(runner.bn.paused())
            yield

    def close(self) -> None:
        """Remove every hook this ensemble registered."""
        for runner in self.runners:
            runner.remove_hooks()

    def hook_count(self) -> int:
        """Forward hooks left on the client models and stacked copies (0 after close())."""
        return sum(r.hook_count() for r in self.runners)


# --- aggregators: (m, b, c) client logits [+ labels] -> (b, c) teacher logits ----------------

class MeanLogits:
    """DENSE's ensemble: the plain mean of the client logits."""

    needs_labels = False

    def __call__(self, client_logits: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return client_logits.mean(dim=0)


class WeightedLogits:
    """sum_k w_k P_k / sum_k w_k with a weight vector (Co-Boosting re-weights it every epoch)."""

    needs_labels = False

    def __init__(self, weights: torch.Tensor):
        self.weights = weights

    def __call__(self, client_logits: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        w = self.weights.to(client_logits)
        return torch.einsum("k,kbc->bc", w, client_logits) / w.sum()


class StratifiedAggregation:
    """FedHydra's SA (Eqs. 8-11) as one einsum, routed by the sample's label or by the output class.

    U_r, U_c: (c, m).
    route="label" (paper): P[i,j] = sum_k U_r[y_i,k] U_c[j,k] P_k[i,j]. The inter-model weights
      follow the sample's label y_i; without labels (test data) they are the uniform-prior average
      of U_r's rows (no label leakage). When one client owns class y (2c/c splits) the teacher of a
      y-sample is that client alone, so it has no opinion on the classes the client never saw.
    route="class": P[i,j] = sum_k U_r[j,k] P_k[i,j]. Every output class j is scored by the clients
      competent on j, whatever the sample's label: the teacher is label-free (the same on
      synthetic and test data), a y-sample that another class's owner claims scores high on that
      class too, so the generator's CE asks for samples the whole fleet recognises as y.
    space="logits" (paper) weights raw logits, so a client with larger logits dominates; space="calibrated"
    weights each client's logits standardised over the batch (`calibrate`): what separates the owner of an
    input's class from a client that never saw it (the energy signal of out-of-distribution detection, which
    is what tells the owners apart when each class has one, 2c/c) is that the owner answers the input more
    strongly than it answers its typical input, and clients differ in offset and scale (a batch's teacher
    outputs then depend on the rest of the batch, as BN statistics do).
    """

    ROUTES = ("label", "class")
    SPACES = ("logits", "calibrated")

    def __init__(self, u_r: torch.Tensor, u_c: torch.Tensor, space: str = "logits", route: str = "label",
                 calibration: Calibration | RunningCalibration | None = None):
        if space not in self.SPACES:
            raise ValueError(f"sa space {space!r}: use logits or calibrated")
        if route not in self.ROUTES:
            raise ValueError(f"sa route {route!r}: use label or class")
        self.u_r, self.u_c, self.space, self.route = u_r, u_c, space, route
        self.calibration = calibration  # the calibrated space's statistics; None: each batch's own
        self.needs_labels = route == "label"

    @property
    def adapts(self) -> bool:
        """Whether the teacher's answers move during distillation (running calibration statistics)."""
        return isinstance(self.calibration, RunningCalibration)

    @contextmanager
    def frozen(self) -> Iterator[None]:
        """Running statistics stand still inside the block (evaluation on the test set)."""
        with self.calibration.frozen() if self.adapts else nullcontext():
            yield

    def state_dict(self) -> dict:
        return {"calibration": self.calibration.state_dict()} if self.adapts else {}

    def load_state_dict(self, state: dict) -> None:
        if self.adapts:
            self.calibration.load_state_dict(state["calibration"])

    def __call__(self, client_logits: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        u_r, u_c = self.u_r.to(client_logits), self.u_c.to(client_logits)
        stats = None
        if self.space == "calibrated" and self.calibration is not None:
            stats = (self.calibration.use(client_logits) if isinstance(self.calibration, RunningCalibration)
                     else self.calibration)
        heard = u_r.sum(dim=0) > 0  # a client without weight (FedHydra's expelled) has no say, not even in the
        if bool(heard.any()) and not bool(heard.all()):  # fleet statistics that calibrate reads
            client_logits, u_r, u_c = client_logits[heard], u_r[:, heard], u_c[:, heard]
            stats = None if stats is None else stats.subset(heard)
        values = calibrate(client_logits, stats) if self.space == "calibrated" else client_logits
        if self.route == "class":
            return torch.einsum("ck,kbc->bc", u_r, values)
        v = u_r.mean(dim=0).expand(client_logits.shape[1], -1) if labels is None else u_r[labels]  # (b, m)
        return torch.einsum("bk,ck,kbc->bc", v, u_c, values)


CALIBRATION_FLOOR = 0.1  # a client's top-logit spread counts as at least this x the fleet's median spread


@dataclass
class Calibration:
    """Each client's mean and spread of its top logit over a reference set of inputs, (m,) each: the scale
    `calibrate` puts each client's logits on."""

    mean: torch.Tensor
    spread: torch.Tensor

    @classmethod
    def of(cls, client_logits: torch.Tensor) -> "Calibration":
        """The statistics of (m, n, c) logits over their n inputs (detached, float32; spread 0 where n = 1)."""
        top = client_logits.detach().float().amax(dim=2)  # (m, n)
        spread = top.std(dim=1) if top.shape[1] > 1 else torch.zeros(top.shape[0], device=top.device)
        return cls(top.mean(dim=1), spread)

    def subset(self, keep: torch.Tensor) -> "Calibration":
        return Calibration(self.mean[keep.to(self.mean.device)], self.spread[keep.to(self.spread.device)])

    def blend(self, other: "Calibration", momentum: float) -> "Calibration":
        """(1 - momentum) x these statistics + momentum x the other's, as BN's running statistics move."""
        return Calibration(torch.lerp(self.mean, other.mean.to(self.mean), momentum),
                           torch.lerp(self.spread, other.spread.to(self.spread), momentum))


class RunningCalibration:
    """Calibration statistics kept across the batches the teacher answers, as BN keeps running statistics: a
    batch is standardised with the statistics of the batches before it (the first with `initial`, or its own
    where none is given) and then folded in with `momentum`. Inside `frozen()` nothing moves (evaluation)."""

    def __init__(self, momentum: float = 0.1, initial: Calibration | None = None):
        self.momentum, self.stats, self.updating = momentum, initial, True

    def use(self, client_logits: torch.Tensor) -> Calibration:
        batch = Calibration.of(client_logits)
        current = self.stats if self.stats is not None else batch
        if self.updating:
            self.stats = current.blend(batch, self.momentum)
        return current

    @contextmanager
    def frozen(self) -> Iterator[None]:
        was, self.updating = self.updating, False
        try:
            yield
        finally:
            self.updating = was

    def state_dict(self) -> dict:
        return {} if self.stats is None else {"mean": self.stats.mean.cpu(), "spread": self.stats.spread.cpu()}

    def load_state_dict(self, state: dict) -> None:
        self.stats = Calibration(state["mean"], state["spread"]) if state else None


def calibrate(client_logits: torch.Tensor, stats: Calibration | None = None) -> torch.Tensor:
    """(m, b, c) logits, each client's standardised by the statistics of its top logit:
    (z_k - mean max_j z_k) / std max_j z_k, over a reference set (`stats`) or, without one, over the batch.

    What tells the owner of an input's class from a client that never saw that class is relative,
    not absolute, confidence: the owner answers the input more strongly than it answers its typical
    input. Clients differ in offset and scale (one trained on fewer classes or for longer answers
    everything more loudly; a poisoner may scale its weights up), so each client's logits are put on
    its own scale first: a client x10 comes back to exactly its original. The statistics are
    detached (the generator cannot lower its loss by moving them); a spread is floored at
    CALIBRATION_FLOOR x the fleet's median, so a client that answers every input alike (a constant
    model) is not blown up; where the median is 0 too, logits are only shifted. A single input without
    reference statistics has no batch statistics either: each client's logits are then only shifted by their own
    top logit."""
    if stats is None:
        if client_logits.shape[1] < 2:
            return client_logits - client_logits.detach().amax(dim=2, keepdim=True)
        stats = Calibration.of(client_logits)
    mean, spread = stats.mean.to(client_logits), stats.spread.to(client_logits)
    spread = torch.maximum(spread, CALIBRATION_FLOOR * spread.median())
    spread = torch.where(spread > 0, spread, torch.ones_like(spread))  # no client's top logit varies: shift only
    return (client_logits - mean[:, None, None]) / spread[:, None, None]


class Teacher:
    """A client ensemble plus an aggregator: teacher(x, y) -> ((b, c) logits, bn_loss, (m, b, c)).

    The aggregation always runs in float32 (`aggregate`): under a bf16-autocast forward the clients' logits
    come back in bf16, and SA's weights and calibration would otherwise be applied in 8 mantissa bits."""

    def __init__(self, ensemble: ClientEnsemble, aggregator):
        self.ensemble, self.aggregator = ensemble, aggregator

    def __call__(self, x: torch.Tensor, labels: torch.Tensor | None = None):
        client_logits, bn_loss = self.ensemble(x)
        return self.aggregate(client_logits, labels), bn_loss, client_logits

    def state_dict(self) -> dict:
        """What of the teacher moves during distillation (an aggregator's running statistics), for checkpoints."""
        return self.aggregator.state_dict() if hasattr(self.aggregator, "state_dict") else {}

    def load_state_dict(self, state: dict) -> None:
        if hasattr(self.aggregator, "load_state_dict"):
            self.aggregator.load_state_dict(state)

    def aggregate(self, client_logits: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """(m, b, c) client logits -> (b, c) teacher logits, in float32 outside any autocast."""
        with torch.autocast(client_logits.device.type, enabled=False):
            return self.aggregator(client_logits.float(), labels)

    @torch.no_grad()
    def predict(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        return self.aggregator(self.ensemble.logits(x), labels)
