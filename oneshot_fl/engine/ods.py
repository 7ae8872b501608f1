"""Output-diversified sampling (ODS; Tashiro et al. 2020), Co-Boosting's perturbation of KD batches.

x' = x + eps * sign(grad_x sum(w * softmax(teacher(x) / T))),  w ~ U(-1, 1)^(B x C)
A random direction in the teacher's output space, pulled back to one signed input step: the
student then sees inputs near the teacher's decision regions it would otherwise rarely visit.
Co-Boosting: eps = 8/255 in its [-1, 1] input space (4/255 on [0, 1] inputs), T = 4.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

ODS_TEMPERATURE = 4.0  # fixed in Co-Boosting's KD loop (softmax(teacher / 4))


def ods_perturb(teacher: Callable[[torch.Tensor], torch.Tensor], images: torch.Tensor, eps: float,
                rng: torch.Generator, temperature: float = ODS_TEMPERATURE) -> torch.Tensor:
    """One ODS step on `images` (no clipping to the input range, as in Co-Boosting)."""
    x = images.detach().clone().requires_grad_(True)
    logits = teacher(x)
    direction = (torch.rand(logits.shape, generator=rng) * 2.0 - 1.0).to(logits)
    objective = (direction * F.softmax(logits / temperature, dim=1)).sum()
    (grad,) = torch.autograd.grad(objective, x)
    return (x + eps * grad.sign()).detach()
