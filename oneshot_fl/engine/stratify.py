"""FedHydra's Model Stratification (Bai et al., "FedHydra: A Unified Solution to Diverse Heterogeneities in
One-Shot Federated Learning", Sec. 3.2, Alg. 2, Eqs. 1-7), batched over classes.

For every client k and class j a freshly initialised generator is trained for T_G steps on one
fixed noise batch labelled j, with cross-entropy through client k only; the loss is recorded
before each update and turned into a competence score u_kj. For a fixed class the generator init
and the noise are the same for every client (seed = f(class)), so the cross-client comparison that
U_r normalises is paired.

Scores (`score`):
  paper     Eq. 2, u = (max L - min L) / (min L + eps). Unbounded: once a client's logit margin
            passes ~19 its CE is exactly 0 in float32 and u jumps to ~max/eps, so ties between
            confident clients are decided by their initial loss, not by how much of j they know.
  prob-auc  u = mean_t exp(-L_t), the geometric-mean probability the client gives class j along
            the generator's run (the area under its probability curve), in float64. Bounded in
            (0, 1], finite when the CE reaches 0, and larger the sooner a client is convinced.
            With `stop_loss` a run stops once its CE is below it (p > exp(-stop_loss)) and the
            remaining steps count at that loss: the score moves by less than 1 - exp(-stop_loss).

U is stored (c, m): row = class, column = client.
  U_r[j, k] = u_kj / sum_k' u_k'j   rows sum to 1 over clients (which clients to trust for j)
  U_c[j, k] = u_kj / sum_j' u_kj'   columns sum to 1 over classes (what client k is good at)
A zero row falls back to 1/m, a zero column to 1/c.

Each run's last generator output (`keep_samples` images per pair) is kept: the peer check
(engine/trust.py) shows a client's class-j images to the other clients.

`stratify` trains the generators of all (client, class) pairs as one vectorised call
(torch.func.vmap over stacked generator weights; Adam is element-wise, so one Adam over the
stack is m x c independent Adams); `stratify_sequential` is the plain m x c loop it is checked against.
Both stop each pair at the same step, so they give the same U up to rounding: FedHydra runs the batched
one on GPUs, where it is faster, and the loop on CPUs, where the loop is (benchmarks/results/scale.md).
"""

from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, replace_all_batch_norm_modules_, stack_module_state, vmap

from oneshot_fl.models.generator import GeneratorSpec, reset_generator
from oneshot_fl.progress import EpochClock
from oneshot_fl.seeding import derive_seed

log = logging.getLogger(__name__)
EPS = 1e-8
CHECK_EVERY = 5  # the batched MS looks whether every pair has stopped once per this many steps


@dataclass
class Stratification:
    u: torch.Tensor  # (c, m) raw relative loss ranges
    u_r: torch.Tensor  # (c, m) rows sum to 1
    u_c: torch.Tensor  # (c, m) columns sum to 1
    losses: torch.Tensor  # (m, c, T) the recorded CE curves (early-stopped runs padded with their last loss)
    seconds: float = 0.0
    score: str = "paper"
    samples: torch.Tensor | None = None  # (m, c, s, C, H, W) each run's last generator output
    steps_run: torch.Tensor | None = None  # (m, c) generator updates each run made before it stopped

    def as_dict(self) -> dict:
        out = {"score": self.score, "u": self.u.tolist(), "u_r": self.u_r.tolist(), "u_c": self.u_c.tolist(),
               "seconds": self.seconds}
        if self.steps_run is not None:
            out["steps_run"] = self.steps_run.T.tolist()  # (c, m), as U
        return out


def relative_range(losses: torch.Tensor) -> torch.Tensor:
    """Eq. 2 over the last axis: (max - min) / (min + eps), as the paper writes it (float32)."""
    hi, lo = losses.max(dim=-1).values, losses.min(dim=-1).values
    return (hi - lo) / (lo + EPS)


def mean_probability(losses: torch.Tensor) -> torch.Tensor:
    """Bounded score over the last axis: mean_t exp(-L_t), computed in float64."""
    return torch.exp(-losses.double()).mean(dim=-1).float()


SCORES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"paper": relative_range, "prob-auc": mean_probability}


def normalise(u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eqs. 4-7 with the uniform fallbacks: u (c, m) -> (U_r, U_c)."""
    c, m = u.shape
    row = u.sum(dim=1, keepdim=True)
    col = u.sum(dim=0, keepdim=True)
    u_r = torch.where(row > 0, u / row.clamp_min(EPS), torch.full_like(u, 1.0 / m))
    u_c = torch.where(col > 0, u / col.clamp_min(EPS), torch.full_like(u, 1.0 / c))
    return u_r, u_c


def _class_start(spec: GeneratorSpec, cls: int, batch: int, seed: int, device) -> tuple[nn.Module, torch.Tensor]:
    """The shared start of every client's run for class `cls`: generator init and noise."""
    class_seed = derive_seed(seed, "ms", cls)
    generator = reset_generator(spec.build(), class_seed).to(device)
    noise = torch.randn(batch, spec.nz, generator=torch.Generator().manual_seed(class_seed)).to(device)
    return generator, noise


def _adam(params, lr: float) -> torch.optim.Adam:
    return torch.optim.Adam(params, lr=lr, betas=(0.5, 0.999))


def stratify_sequential(models: Sequence[nn.Module], num_classes: int, spec: GeneratorSpec, steps: int,
                        batch: int, lr: float, seed: int, device: torch.device, score: str = "paper",
                        stop_loss: float = 0.0, keep_samples: int = 0) -> Stratification:
    """Reference implementation: m x c independent generator trainings (the default on CPUs)."""
    start = time.perf_counter()
    clock = EpochClock(num_classes)
    m = len(models)
    losses = torch.zeros(m, num_classes, steps)
    steps_run = torch.full((m, num_classes), steps, dtype=torch.long)
    samples = [[None] * num_classes for _ in range(m)]
    for cls in range(num_classes):
        for k, model in enumerate(models):
            generator, noise = _class_start(spec, cls, batch, seed, device)
            target = torch.full((batch,), cls, dtype=torch.long, device=device)
            optimizer = _adam(generator.parameters(), lr)
            for t in range(steps):
                loss = F.cross_entropy(model(generator(noise)), target)
                losses[k, cls, t] = loss.detach()
                if stop_loss > 0 and float(loss.detach()) < stop_loss:  # convinced: the rest would add ~exp(-loss) each
                    losses[k, cls, t + 1:] = losses[k, cls, t]
                    steps_run[k, cls] = t
                    break
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
            if keep_samples:
                with torch.no_grad():
                        # the full batch: the generator's BN uses the batch statistics it trained with
                    samples[k][cls] = generator(noise)[:keep_samples].cpu()
        _progress(clock, cls + 1, "classes")
    kept = torch.stack([torch.stack(row) for row in samples]) if keep_samples else None
    return _result(losses, time.perf_counter() - start, score, kept, steps_run)


def _progress(clock: EpochClock, done: int, unit: str) -> None:
    log.info("stratification: %d/%d %s done (%.0fs, %s)", done, clock.total, unit, clock.elapsed(), clock.eta(done))


def stratify(models: Sequence[nn.Module], num_classes: int, spec: GeneratorSpec, steps: int, batch: int,
             lr: float, seed: int, device: torch.device, clients_per_call: int = 0, score: str = "paper",
             stop_loss: float = 0.0, keep_samples: int = 0) -> Stratification:
    """Batched implementation: the generators of all (client, class) pairs of a chunk of clients
    train as one vmapped call; each client model sees its c x b images in one forward. A pair stops
    exactly where `stratify_sequential` stops it (its CE below `stop_loss`): its losses are padded from
    that step and its images kept from it, and its CE leaves the summed loss, so the other pairs' updates
    are untouched (each generator's gradient comes from its own pair only) and the result is the
    sequential one up to floating-point rounding, on any device."""
    start = time.perf_counter()
    m, c = len(models), num_classes
    keep_samples = min(keep_samples, batch)  # as the loop's slice of its batch
    clock = EpochClock(m)
    losses = torch.zeros(m, c, steps)
    steps_run = torch.full((m, c), steps, dtype=torch.long)
    samples = []
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
        # the chunk's bookkeeping lives on the device and is read once at the end (and every CHECK_EVERY
        # steps, to stop when every pair has): no step waits for the GPU
        running = torch.ones(len(clients), c, dtype=torch.bool, device=device)
        curves = torch.zeros(len(clients), c, steps, device=device)
        last = torch.zeros(len(clients), c, device=device)
        stopped_at = torch.full((len(clients), c), steps, dtype=torch.long, device=device)
        kept = torch.zeros(len(clients), c, keep_samples, spec.channels, spec.image_size, spec.image_size,
                           device=device)
        for t in range(steps):
            images = vmap(generate)(params, noise).reshape(len(clients), c, batch,
                                                           spec.channels, spec.image_size, spec.image_size)
            per_class = torch.stack([F.cross_entropy(models[k](images[j].flatten(0, 1)), target,
                                                     reduction="none").view(c, batch).mean(dim=1)
                                     for j, k in enumerate(clients)])  # (clients, c)
            values = per_class.detach()
            # a stopped pair's curve keeps its stopping loss (as stratify_sequential pads it)
            last = torch.where(running, values, last)
            curves[:, :, t] = last
            done = running & (values < stop_loss) if stop_loss > 0 else torch.zeros_like(running)
            stopped_at = torch.where(done, t, stopped_at)
            if keep_samples:
                kept = torch.where(done[:, :, None, None, None, None], images[:, :, :keep_samples].detach(), kept)
            running = running & ~done
            if (t + 1) % CHECK_EVERY == 0 and not bool(running.any()):
                curves[:, :, t + 1:] = last[:, :, None]
                break
            # a stopped pair's CE leaves the sum: the others' updates are untouched
            total = (per_class * running.to(per_class)).sum()
            optimizer.zero_grad(set_to_none=True)
            total.backward()
            optimizer.step()
        if keep_samples:
            with torch.no_grad():
                final = vmap(generate)(params, noise)[:, :keep_samples].reshape(
                    len(clients), c, keep_samples, spec.channels, spec.image_size, spec.image_size)
            kept = torch.where(running[:, :, None, None, None, None], final, kept)
            samples.append(kept.cpu())
        losses[clients] = curves.cpu()
        steps_run[clients] = stopped_at.cpu()
        _progress(clock, clients[-1] + 1, "clients")
    kept_all = torch.cat(samples) if keep_samples else None
    return _result(losses, time.perf_counter() - start, score, kept_all, steps_run)


def _result(losses: torch.Tensor, seconds: float, score: str = "paper", samples: torch.Tensor | None = None,
            steps_run: torch.Tensor | None = None) -> Stratification:
    if score not in SCORES:
        raise ValueError(f"stratification score {score!r}: use {' or '.join(SCORES)}")
    u = SCORES[score](losses).T.contiguous()  # (c, m)
    u_r, u_c = normalise(u)
    return Stratification(u=u, u_r=u_r, u_c=u_c, losses=losses, seconds=seconds, score=score, samples=samples,
                          steps_run=steps_run)
