"""FedHydra's Model Stratification (Alg. 2, Eqs. 1-7), batched over classes.

For every client k and class j a freshly initialised generator is trained for T_G steps on one
fixed noise batch labelled j, with cross-entropy through client k only; the loss is recorded
before each update and u_kj = (max L - min L) / (min L + eps) (Eq. 2). For a fixed class the
generator init and the noise are the same for every client (seed = f(class)), so the cross-client
comparison that U_r normalises is paired (reference/fedhydra.md D3).

U is stored (c, m): row = class, column = client.
  U_r[j, k] = u_kj / sum_k' u_k'j   rows sum to 1 over clients (which clients to trust for j)
  U_c[j, k] = u_kj / sum_j' u_kj'   columns sum to 1 over classes (what client k is good at)
A zero row falls back to 1/m, a zero column to 1/c.

`stratify` trains the generators of all (client, class) pairs as one vectorised call
(torch.func.vmap over stacked generator weights; Adam is element-wise, so one Adam over the
stack is m x c independent Adams); `stratify_sequential` is the plain m x c loop it is checked against.
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, replace_all_batch_norm_modules_, stack_module_state, vmap

from oneshot_fl.models.generator import GeneratorSpec, reset_generator
from oneshot_fl.seeding import derive_seed

log = logging.getLogger(__name__)
EPS = 1e-8


@dataclass
class Stratification:
    u: torch.Tensor  # (c, m) raw relative loss ranges
    u_r: torch.Tensor  # (c, m) rows sum to 1
    u_c: torch.Tensor  # (c, m) columns sum to 1
    losses: torch.Tensor  # (m, c, T) the recorded CE curves
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"u": self.u.tolist(), "u_r": self.u_r.tolist(), "u_c": self.u_c.tolist(),
                "seconds": self.seconds}


def relative_range(losses: torch.Tensor) -> torch.Tensor:
    """Eq. 2 over the last axis: (max - min) / (min + eps)."""
    hi, lo = losses.max(dim=-1).values, losses.min(dim=-1).values
    return (hi - lo) / (lo + EPS)


def normalise(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eqs. 4-7 with the uniform fallbacks: u (c, m) -> (U_r, U_c)."""
    c, m = u.shape
    row = u.sum(dim=1, keepdim=True)
    col = u.sum(dim=0, keepdim=True)
    u_r = torch.where(row > 0, u / row.clamp_min(EPS), torch.full_like(u, 1.0 / m))
    u_c = torch.where(col > 0, u / col.clamp_min(EPS), torch.full_like(u, 1.0 / c))
    return u_r, u_c


def _class_start(spec: GeneratorSpec, cls: int, batch: int, seed: int, device) -> tuple[Generator, torch.Tensor]:
    """The shared start of every client's run for class `cls`: generator init and noise."""
    class_seed = derive_seed(seed, "ms", cls)
    generator = reset_generator(spec.build(), class_seed).to(device)
    noise = torch.randn(batch, spec.nz, generator=torch.Generator().manual_seed(class_seed)).to(device)
    return generator, noise


def _adam(params, lr: float) -> torch.optim.Adam:
    return torch.optim.Adam(params, lr=lr, betas=(0.5, 0.999))


def stratify_sequential(models: Sequence[nn.Module], num_classes: int, spec: GeneratorSpec, steps: int,
                        batch: int, lr: float, seed: int, device: torch.device) -> Stratification:
    """Reference implementation: m x c independent generator trainings."""
    start = time.perf_counter()
    losses = torch.zeros(len(models), num_classes, steps)
    for cls in range(num_classes):
        for k, model in enumerate(models):
            generator, noise = _class_start(spec, cls, batch, seed, device)
            target = torch.full((batch,), cls, dtype=torch.long, device=device)
            optimizer = _adam(generator.parameters(), lr)
            for t in range(steps):
                loss = F.cross_entropy(model(generator(noise)), target)
                losses[k, cls, t] = loss.detach()
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
    return _result(losses, time.perf_counter() - start)


def stratify(models: Sequence[nn.Module], num_classes: int, spec: GeneratorSpec, steps: int, batch: int,
             lr: float, seed: int, device: torch.device, clients_per_call: int = 0) -> Stratification:
    """Batched implementation: the generators of all (client, class) pairs of a chunk of clients
    train as one vmapped call; each client model sees its c x b images in one forward."""
    start = time.perf_counter()
    m, c = len(models), num_classes
    losses = torch.zeros(m, c, steps)
    starts = [_class_start(spec, cls, batch, seed, device) for cls in range(c)]
    base = replace_all_batch_norm_modules_(copy.deepcopy(starts[0][0])).to("meta")  # BN: batch statistics only
    class_noise = torch.stack([z for _, z in starts])  # (c, b, nz)
    target = torch.arange(c, device=device).repeat_interleave(batch)

    def generate(params, z):
        return functional_call(base, (params,), (z,))

    chunk = clients_per_call or m
    for first in range(0, m, chunk):
        clients = list(range(first, min(first + chunk, m)))
        params, _ = stack_module_state([starts[cls][0] for _ in clients for cls in range(c)])
        params = {name: p.detach().clone().requires_grad_(True) for name, p in params.items()}
        noise = class_noise.repeat(len(clients), 1, 1)  # (clients x c, b, nz)
        optimizer = _adam(params.values(), lr)  # element-wise: one Adam over the stack = independent Adams
        for t in range(steps):
            images = vmap(generate)(params, noise).reshape(len(clients), c * batch,
                                                         spec.channels, spec.image_size, spec.image_size)
            total = 0.0
            for j, k in enumerate(clients):
                per_class = F.cross_entropy(models[k](images[j]), target, reduction="none").view(c, batch).mean(dim=1)
                losses[k, :, t] = per_class.detach().cpu()
                total = total + per_class.sum()  # each generator's gradient comes from its own pair only
            optimizer.zero_grad(set_to_none=True)
            total.backward()
            optimizer.step()
        log.info("stratification: clients %d-%d of %d done (%.1fs)", clients[0] + 1, clients[-1] + 1, m,
                 time.perf_counter() - start)
    return _result(losses, time.perf_counter() - start)


def _result(losses: torch.Tensor, seconds: float) -> Stratification:
    u = relative_range(losses).T.contiguous()  # (c, m)
    u_r, u_c = normalise(u)
    return Stratification(u=u, u_r=u_r, u_c=u_c, losses=losses, seconds=seconds)
