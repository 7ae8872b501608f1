"""OT fusion (Singh & Jaggi, NeurIPS 2020; sidak/otfusion, weight mode): align every model's neurons
to a reference model layer by layer with optimal transport, then average the aligned models.

Per layer, in forward order (Singh & Jaggi, "Model Fusion via Optimal Transport", Sec. 4, and
sidak/otfusion's weight-based alignment):
  1. the input side of the layer is put into the reference order with the previous layer's map
     (conv: per input channel; conv -> linear: per channel block of the flattened features);
  2. ground cost = Euclidean distance between the rows (out-neurons: weights + bias) of the model
     and of the reference; uniform marginals;
  3. T = exact EMD (a permutation for equal widths) or Sinkhorn; with otfusion's `correction`,
     P = n * T has rows and columns summing to 1;
  4. the output side is mapped, W <- P^T W; the BatchNorm after the layer (weight, bias, running
     mean and variance) moves with its neurons. The classifier's output layer is never permuted.
Supported: plain feed-forward chains of Conv2d / Linear (+ BatchNorm, ReLU, pooling, dropout) whose
forward order is their registration order: cnn2, cnn3, cnn3-bn, lenet, vgg9, vgg9-small. Residual
(ResNet) and branching (GoogLeNet) models and heterogeneous fleets raise UnsupportedModelError.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch
from torch import nn

from oneshot_fl.fusion.averaging import HeterogeneousFleetError, average_states

CHAIN_LEAVES = (nn.Conv2d, nn.Linear, nn.BatchNorm1d, nn.BatchNorm2d, nn.ReLU, nn.LeakyReLU, nn.MaxPool2d,
                nn.AvgPool2d, nn.AdaptiveAvgPool2d, nn.Dropout, nn.Flatten, nn.Identity)


class UnsupportedModelError(ValueError):
    """OT fusion cannot align this model (not a plain chain of conv/linear layers)."""


@dataclass
class Layer:
    """One alignable layer: its weight/bias keys and the keys of the BatchNorm that follows it."""

    kind: str  # conv | linear
    weight: str
    bias: str | None
    out_features: int
    bn: list[str] = field(default_factory=list)


def layer_chain(model: nn.Module, arch: str = "model") -> list[Layer]:
    """The conv/linear layers of a feed-forward chain in forward order, with their BatchNorms."""
    layers: list[Layer] = []
    for name, module in model.named_modules():
        if name == "" or isinstance(module, nn.Sequential):
            continue
        if not isinstance(module, CHAIN_LEAVES):
            raise UnsupportedModelError(
                f"{arch}: OT fusion aligns plain chains of conv/linear layers; {name} is a "
                f"{type(module).__name__} (residual or branching block). Use cnn2, cnn3, cnn3-bn, lenet or vgg9")
        prefix = f"{name}."
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            if isinstance(module, nn.Conv2d) and module.groups != 1:
                raise UnsupportedModelError(f"{arch}: grouped convolution {name} is not supported")
            kind = "conv" if isinstance(module, nn.Conv2d) else "linear"
            out = module.out_channels if kind == "conv" else module.out_features
            layers.append(Layer(kind, prefix + "weight", prefix + "bias" if module.bias is not None else None, out))
        elif isinstance(module, (nn.BatchNorm1d, nn.BatchNorm2d)):
            if not layers or layers[-1].bn or layers[-1].out_features != module.num_features:
                raise UnsupportedModelError(f"{arch}: BatchNorm {name} does not follow a layer of its width")
            layers[-1].bn = [prefix + k for k in ("weight", "bias", "running_mean", "running_var")]
    if not layers:
        raise UnsupportedModelError(f"{arch}: no conv/linear layers to align")
    return layers


def _map_inputs(weight: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """Put the input side of `weight` into the reference order: W[:, j] = sum_i P[i, j] W[:, i]."""
    n_prev = perm.shape[0]
    if weight.dim() == 4:  # conv: (out, in, kh, kw)
        return torch.einsum("oikl,ij->ojkl", weight, perm)
    if weight.shape[1] == n_prev:  # linear after linear
        return weight @ perm
    if weight.shape[1] % n_prev:
        raise UnsupportedModelError(f"a linear layer with {weight.shape[1]} inputs follows {n_prev} channels")
    blocks = weight.reshape(weight.shape[0], n_prev, -1)  # conv -> flatten -> linear: channel-major
    return torch.einsum("oip,ij->ojp", blocks, perm).reshape(weight.shape)


def transport_map(cost: np.ndarray, solver: str = "emd", reg: float = 0.01) -> torch.Tensor:
    """P (n, n) from a cost between the model's neurons (rows) and the reference's (columns),
    uniform marginals, scaled by n (otfusion's correction): rows and columns sum to 1."""
    n, m = cost.shape
    if n != m:
        raise UnsupportedModelError(f"layers of different widths ({n} vs {m}) cannot be aligned one to one")
    import ot  # POT imports scipy.stats (~1.5 s of CPU): only OT fusion pays for it

    a = np.full(n, 1.0 / n)
    if solver == "emd":
        plan = ot.emd(a, a, cost)
    elif solver == "sinkhorn":
        plan = ot.sinkhorn(a, a, cost / max(cost.max(), 1e-12), reg)
    else:
        raise ValueError(f"OT solver {solver!r}: use emd or sinkhorn")
    return torch.as_tensor(plan * n, dtype=torch.float64)


def align(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], chain: Sequence[Layer],
          solver: str = "emd", reg: float = 0.01) -> dict[str, torch.Tensor]:
    """`state` with its hidden neurons moved into the order of `reference`'s (same function for emd)."""
    import ot  # as above

    out = {k: v.clone() for k, v in state.items()}
    perm: torch.Tensor | None = None
    for i, layer in enumerate(chain):
        weight = out[layer.weight].double()
        if perm is not None:
            weight = _map_inputs(weight, perm)
        bias = out[layer.bias].double() if layer.bias else None
        if i == len(chain) - 1:  # the classifier's outputs are the classes: never permuted
            out[layer.weight] = weight.to(state[layer.weight].dtype)
            break
        rows = torch.cat([weight.reshape(len(weight), -1)] + ([bias[:, None]] if bias is not None else []), dim=1)
        ref_w = reference[layer.weight].double()
        ref_rows = torch.cat([ref_w.reshape(len(ref_w), -1)] +
                             ([reference[layer.bias].double()[:, None]] if layer.bias else []), dim=1)
        cost = ot.dist(rows.numpy(), ref_rows.numpy(), metric="euclidean")
        perm = transport_map(cost, solver, reg)
        out[layer.weight] = torch.einsum("ij,i...->j...", perm, weight).to(state[layer.weight].dtype)
        if bias is not None:
            out[layer.bias] = (perm.T @ bias).to(state[layer.bias].dtype)
        for key in layer.bn:
            out[key] = (perm.T @ out[key].double()).to(state[key].dtype)
    return out


@torch.no_grad()
def check_same_function(model: nn.Module, before: dict[str, torch.Tensor], after: dict[str, torch.Tensor],
                        probe: torch.Tensor, arch: str = "model") -> None:
    """An exact (permutation) alignment must not change what the model computes; if it does, the
    model's forward order is not its registration order and the chain assumption is wrong."""
    model.eval()
    model.load_state_dict(before)
    expected = model(probe)
    model.load_state_dict(after)
    got = model(probe)
    if not torch.allclose(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()) + 1e-6):
        raise UnsupportedModelError(f"{arch}: aligning its neurons changed its outputs; its layers do not run "
                                    "in registration order, so OT fusion cannot align it")


def ot_fuse(states: Sequence[dict[str, torch.Tensor]], weights: Sequence[float], model: nn.Module,
            reference: int = 0, solver: str = "emd", reg: float = 0.01, arch: str = "model",
            probe: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Align every state to states[reference], then their weighted average (BN statistics included).
    With `probe` inputs and the exact solver, every alignment is checked to keep the model's outputs."""
    keys = list(states[reference])
    for i, state in enumerate(states):
        if list(state) != keys or any(state[k].shape != states[reference][k].shape for k in keys):
            raise HeterogeneousFleetError(f"OT fusion needs one architecture: model {i} does not have the "
                                          f"layout of the reference model {reference}")
    chain = layer_chain(model, arch)
    aligned = []
    for i, state in enumerate(states):
        if i == reference:
            aligned.append(state)
            continue
        moved = align(state, states[reference], chain, solver, reg)
        if probe is not None and solver == "emd":
            check_same_function(model, state, moved, probe, arch)
        aligned.append(moved)
    return average_states(aligned, weights)
