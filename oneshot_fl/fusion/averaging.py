"""Parameter averaging (one-shot FedAvg; FedMHO's global initialisation)."""

from __future__ import annotations

from typing import Sequence

import torch


class HeterogeneousFleetError(ValueError):
    """Parameter averaging needs every model to have the same architecture."""


def average_states(states: Sequence[dict[str, torch.Tensor]], weights: Sequence[float]) -> dict[str, torch.Tensor]:
    """Weighted mean of state dicts, BN running statistics included.

    Integer buffers (BN's num_batches_tracked) get the rounded weighted mean, so the result
    stays a valid state dict of the same dtypes.
    """
    if not states:
        raise ValueError("nothing to average")
    keys = list(states[0])
    for i, state in enumerate(states[1:], start=1):
        if list(state) != keys or any(state[k].shape != states[0][k].shape for k in keys):
            raise HeterogeneousFleetError(f"model {i} does not have the layout of model 0")
    w = torch.as_tensor(weights, dtype=torch.float64)
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError(f"averaging weights must be non-negative with a positive sum, got {list(weights)}")
    w = w / w.sum()
    averaged = {}
    for key in keys:
        stacked = torch.stack([s[key].to(torch.float64) for s in states])
        mean = torch.tensordot(w, stacked, dims=1)
        dtype = states[0][key].dtype
        averaged[key] = mean.round().to(dtype) if not dtype.is_floating_point else mean.to(dtype)
    return averaged
