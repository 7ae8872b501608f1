"""BN-statistics loss (DeepInversion / DENSE Eq. 3) through forward hooks on client BN layers.

For a synthetic batch fed through client k, each BatchNorm layer l compares the per-channel
batch mean and biased variance of its *input* with its running statistics:
  r_l = ||mu_l(x) - running_mean_l||_2 + ||var_l(x) - running_var_l||_2   (unsquared norms)
L_BN = (1 / |K_BN|) * sum_{k in K_BN} sum_l r_{k,l}, averaged over the clients that have BN.
Hooks are registered once per run and always removed (DENSE's code stacks new hooks every epoch).
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator, Sequence

import torch
from torch import nn

log = logging.getLogger(__name__)


class BNStatsHook:
    """Forward hook on one BN layer; `.loss` holds the statistic distance of the last forward."""

    def __init__(self, module: nn.modules.batchnorm._BatchNorm):
        self.module = module
        self.loss: torch.Tensor | None = None
        self.enabled = True
        self.handle = module.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output) -> None:
        if not self.enabled:  # a forward that only wants logits (evaluation, KD targets): skip the statistics
            self.loss = None
            return
        x = inputs[0].float()  # a bf16-autocast forward hands BN a bf16 input: its statistics are taken in float32
        dims = [0] + list(range(2, x.dim()))  # all but the channel axis
        mean = x.mean(dim=dims)
        var = x.var(dim=dims, unbiased=False)
        self.loss = torch.norm(mean - module.running_mean, 2) + torch.norm(var - module.running_var, 2)

    def remove(self) -> None:
        self.handle.remove()


class BNStatsLoss:
    """Hooks on every BN layer of every model; `value()` is L_BN of the last forward of each model."""

    def __init__(self, models: Sequence[nn.Module], warn: bool = True):
        self.per_model = [[BNStatsHook(m) for m in model.modules()
                           if isinstance(m, nn.modules.batchnorm._BatchNorm)] for model in models]
        if warn and not any(self.per_model):  # a teacher bank says it once for the whole fleet (warn=False here)
            log.warning("no client model has BatchNorm layers: the BN-statistics loss is 0")

    @property
    def active(self) -> bool:
        return any(self.per_model)

    def value(self) -> torch.Tensor:
        losses = [sum(h.loss for h in hooks) for hooks in self.per_model if hooks and hooks[0].loss is not None]
        if not losses:
            return torch.zeros(())
        return torch.stack(losses).mean()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards inside the block compute no BN statistics (work that only wants logits: on a CPU the
        statistics are a sizeable share of a CNN3 forward)."""
        hooks = [hook for per_model in self.per_model for hook in per_model]
        for hook in hooks:
            hook.enabled = False
        try:
            yield
        finally:
            for hook in hooks:
                hook.enabled = True

    def remove(self) -> None:
        for hooks in self.per_model:
            for hook in hooks:
                hook.remove()
        self.per_model = []


@contextmanager
def bn_stats_loss(models: Sequence[nn.Module]) -> Iterator[BNStatsLoss]:
    """Attach BN hooks for the duration of a block; they are removed even on errors."""
    loss = BNStatsLoss(models)
    try:
        yield loss
    finally:
        loss.remove()
