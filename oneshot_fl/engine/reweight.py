"""Co-Boosting's ensemble re-weighting: signed-gradient steps on the client weights of the
weighted-logit teacher, against the generator's targets on the synthetic pool.

Per pool batch (x, y):  w <- w - step * sign(d CE(sum_k w_k f_k(x) / sum_k w_k, y) / d w),
then w is kept within +-1 of its value at the start of the pass and inside [0, 1]
(rong-dai/Co-Boosting, synthesis/coboost.py). step = mu * decay^(epoch - 1).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F

from oneshot_fl.engine.teachers import WeightedLogits


def reweight_step(weights: torch.Tensor, start: torch.Tensor, client_logits: torch.Tensor,
                  labels: torch.Tensor, step: float) -> torch.Tensor:
    """One signed step on (m,) weights from (m, b, c) client logits and (b,) labels."""
    w = weights.detach().clone().requires_grad_(True)
    loss = F.cross_entropy(WeightedLogits(w)(client_logits.detach()), labels)
    (grad,) = torch.autograd.grad(loss, w)
    # The weights cannot all reach 0: the teacher is invariant to scaling w, so sum_k w_k dCE/dw_k = 0
    # and some positive weight always has a gradient <= 0, i.e. does not shrink.
    moved = weights - step * grad.sign()
    return torch.clamp(start + torch.clamp(moved - start, -1.0, 1.0), 0.0, 1.0).detach()


def reweight_pass(weights: torch.Tensor, batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
                  step: float) -> torch.Tensor:
    """One pass over (client logits, labels) batches; the clamp is relative to the pass's start."""
    start = weights.detach().clone()
    for client_logits, labels in batches:
        weights = reweight_step(weights, start, client_logits, labels, step)
    return weights
