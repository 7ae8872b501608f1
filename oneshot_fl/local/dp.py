"""Differentially private clients: what a client does to make its one upload (epsilon, delta)-DP, and the
claim the server checks.

A DP client (local.dp.epsilon > 0) releases two things computed from its examples, and both are paid from
the same (epsilon, delta), for add/remove-one-example adjacency:
  dp-sgd              the model (a classifier, or a decoder client's whole CVAE, of which it uploads the decoder:
                      post-processing): DP-SGD (Abadi et al., "Deep Learning with Differential Privacy", CCS 2016:
                      per-example clipping to max-grad-norm C, Gaussian noise of std sigma * C on the summed
                      gradient) through Opacus, with Poisson sampling at rate q as its accountant assumes;
  gaussian-histogram  the label counts: the Gaussian mechanism on the class histogram (L2 sensitivity 1: one
                      example moves one count by 1), noise std sigma_h, rounded to integers and clipped at 0
                      (post-processing, free).
No BatchNorm: its running statistics are statistics of the data outside any mechanism, and DP-SGD needs
per-example gradients, which BatchNorm does not have; DP runs use the GroupNorm variants of the registry
(oneshot_fl.models.registry.DP_VARIANTS). The training metrics (loss, accuracy on the client's data) stay on
the client.

Accounting: one Rényi-DP accountant (Mironov, "Rényi Differential Privacy", CSF 2017; Opacus's
RDPAccountant, with Mironov, Talwar & Zhang's "Rényi Differential Privacy of the Sampled Gaussian
Mechanism" for the subsampled steps) holds both: DP-SGD's (sigma, q, T) and the histogram as one step of
(sigma_h, q = 1). RDP composes by adding the curves over the orders ALPHAS, and the (epsilon, delta)
conversion is paid once for the pair, so the composition costs less than the sum of the two epsilons.

The budget split. The histogram's noise multiplier is fixed first: the smallest sigma_h whose release alone is
(HISTOGRAM_SHARE * epsilon, delta)-DP. Then the training noise multiplier is binary-searched so that the
composed epsilon is at most the target (and within EPSILON_TOLERANCE below it). Why a tenth: the histogram is
what the server reads least (FedAvg's sample weights, reports), and a standalone tenth of the budget keeps its
noise small beside the counts of any client the methods can learn from (sigma_h = 5.0 at epsilon 8, 12.4 at 3,
34 at 1, for delta 1e-5); and composed under RDP its cost is far below that tenth (the Gaussian's curve
alpha / (2 sigma_h^2) is flat beside DP-SGD's at the orders that decide), so training keeps nearly the whole
budget: its noise multiplier is within 1 % of the one it would get alone (tests/unit/test_dp.py checks this).

Randomness. The noise and the Poisson sampling are drawn from generators seeded from the operating system's
entropy (`private_generator`), never from the run seed: the server sets the run seed, and noise it could
regenerate would protect nothing. DP clients are therefore not bit-reproducible. Opacus's secure_mode (a
cryptographic generator, torchcsprng) is not used: torchcsprng is not built for this torch.
"""

from __future__ import annotations

import logging
import math
import secrets
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Callable, Mapping

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from oneshot_fl.config import DPConfig, LocalConfig
from oneshot_fl.data.datasets import Split, to_tensor
from oneshot_fl.local.train import TrainStats
from oneshot_fl.models.registry import dp_problems
from oneshot_fl.progress import EpochClock

log = logging.getLogger(__name__)

ACCOUNTANT = "rdp"
# The Rényi orders the accountant minimises over: Opacus's RDPAccountant.DEFAULT_ALPHAS (1.1 ... 63), then
# larger orders up to 1024. Small epsilons are reached only at large orders (the conversion pays about
# log(1/delta) / (alpha - 1)): with 63 at most, nothing goes below epsilon ~0.1 at delta 1e-5, and the histogram's
# tenth of epsilon 1 needs alpha ~ 200. Pinned here, so that a server with another Opacus recomputes a client's
# epsilon over the same orders.
ALPHAS = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)) + list(range(64, 256, 16))
               + list(range(256, 1025, 128)))
SGD, HISTOGRAM = "dp-sgd", "gaussian-histogram"
MECHANISMS = (SGD, HISTOGRAM)
HISTOGRAM_SHARE = 0.1  # the histogram's release alone is (HISTOGRAM_SHARE * epsilon, delta)-DP (see above)
EPSILON_TOLERANCE = 0.01  # the composed epsilon lands in [(1 - tol) * target, target]
CLAIM_TOLERANCE = 1e-3  # relative: a claimed epsilon must be what its parameters give, within this
MAX_STEPS = 10**9  # a bound on claimed DP-SGD steps (a claim is read from an untrusted upload)
# What a DP upload may carry besides its tensors and the noised histogram: data-independent metrics only
# (accuracy on the public test set is a function of the DP model; the training time reveals the number of
# examples, which the guarantee does not cover: the sample rate batch-size / n does too).
PUBLIC_METRICS = frozenset({"num-examples", "local-test-accuracy", "train-seconds"})
BN_STATISTICS = ("running_mean", "running_var", "num_batches_tracked")
META_PREFIX = "dp-"


# --- the accountant -----------------------------------------------------------------------------------

def epsilon_of(history: list[tuple[float, float, int]], delta: float) -> float:
    """Epsilon at `delta` of a composition of (noise multiplier, sample rate, steps) Gaussian mechanisms
    under Opacus's RDP accountant (sample rate 1: the plain Gaussian mechanism)."""
    from opacus.accountants import RDPAccountant  # Opacus takes seconds to import: only DP code pays for it

    accountant = RDPAccountant()
    accountant.history = [(float(sigma), float(q), int(steps)) for sigma, q, steps in history]
    with warnings.catch_warnings():  # "optimal order is the largest alpha": still a valid (looser) bound; the
        warnings.filterwarnings("ignore", message="Optimal order is the largest alpha")  # searches probe there
        return float(accountant.get_epsilon(delta=delta, alphas=list(ALPHAS)))


def _smallest_sigma(epsilon_at, target: float, label: str) -> float:
    """The smallest noise multiplier (to EPSILON_TOLERANCE) whose epsilon_at(sigma) <= target; epsilon falls
    as sigma grows."""
    low, high = 0.0, 1.0
    at_high = epsilon_at(high)
    while at_high > target:
        low, high = high, 2 * high
        if high > 1e6:
            raise ValueError(f"{label}: no noise multiplier up to 1e6 reaches epsilon {target:g}")
        at_high = epsilon_at(high)
    while at_high < (1 - EPSILON_TOLERANCE) * target and high - low > 1e-9 * high:
        middle = (low + high) / 2
        at_middle = epsilon_at(middle)
        if at_middle <= target:
            high, at_high = middle, at_middle
        else:
            low = middle
    return high


def histogram_noise_multiplier(epsilon: float, delta: float) -> float:
    """sigma_h: the Gaussian mechanism on the label histogram is alone (HISTOGRAM_SHARE * epsilon, delta)-DP."""
    share = HISTOGRAM_SHARE * epsilon
    return _smallest_sigma(lambda s: epsilon_of([(s, 1.0, 1)], delta), share, "label histogram")


def poisson_schedule(num_examples: int, batch_size: int, epochs: int) -> tuple[float, int]:
    """(sample rate q, steps) of DP-SGD as Opacus's accountant counts them. Opacus's Poisson loader samples at
    q0 = 1 / (batches of an ordinary loader of this batch size) and runs int(1 / q0) batches per epoch, which
    floating point makes one fewer than those batches for some counts (93, 99, 105, ...); PrivacyEngine then
    accounts every step at 1 / (its loader's length), so q = 1 / int(1 / q0) >= q0: the claim errs on the
    safe side, and it must be the accountant's q for the server to recompute the same epsilon."""
    if num_examples < 1:
        raise ValueError("DP-SGD needs at least one example")
    batches_per_epoch = int(1 / (1 / math.ceil(num_examples / min(batch_size, num_examples))))
    return 1 / batches_per_epoch, epochs * batches_per_epoch


@dataclass(frozen=True)
class DPGuarantee:
    """A DP upload's claim: (epsilon, delta) under the RDP accountant, and the parameters of its mechanisms,
    from which anyone can recompute epsilon (`recompute`)."""

    epsilon: float
    delta: float
    sgd_noise_multiplier: float
    sample_rate: float
    steps: int
    max_grad_norm: float
    histogram_noise_multiplier: float

    def history(self) -> list[tuple[float, float, int]]:
        return [(self.sgd_noise_multiplier, self.sample_rate, self.steps), (self.histogram_noise_multiplier, 1.0, 1)]

    def recompute(self) -> float:
        return epsilon_of(self.history(), self.delta)

    def to_meta(self) -> dict:
        """The claim as upload meta entries (Flower ConfigRecord values)."""
        return {"dp-epsilon": float(self.epsilon), "dp-delta": float(self.delta), "dp-accountant": ACCOUNTANT,
                "dp-mechanisms": list(MECHANISMS),
                "dp-sgd-noise-multiplier": float(self.sgd_noise_multiplier),
                "dp-sgd-sample-rate": float(self.sample_rate), "dp-sgd-steps": int(self.steps),
                "dp-sgd-max-grad-norm": float(self.max_grad_norm),
                "dp-histogram-noise-multiplier": float(self.histogram_noise_multiplier)}

    def report(self) -> dict:
        """For result.json: the guarantee and each mechanism with its parameters."""
        return {"epsilon": self.epsilon, "delta": self.delta, "accountant": ACCOUNTANT, "adjacency": "add/remove one",
                "mechanisms": [
                    {"name": SGD, "noise_multiplier": self.sgd_noise_multiplier, "sample_rate": self.sample_rate,
                     "sampling": "poisson", "steps": self.steps, "max_grad_norm": self.max_grad_norm},
                    {"name": HISTOGRAM, "noise_multiplier": self.histogram_noise_multiplier, "l2_sensitivity": 1,
                     "post_processing": "rounded, clipped at 0"}]}

    @classmethod
    def from_meta(cls, meta: Mapping[str, object]) -> "DPGuarantee":
        """Parse and check a claim read from an upload's meta record; ValueError names what is wrong: a
        missing or malformed field, a parameter out of range, or an epsilon its parameters do not give."""
        known = set(cls.example_meta())
        unknown = sorted(k for k in meta if k.startswith(META_PREFIX) and k not in known)
        if unknown:
            raise ValueError(f"unknown DP claim field(s) {unknown}")
        missing = sorted(k for k in known if k not in meta)
        if missing:
            raise ValueError(f"incomplete DP claim: missing {missing}")
        if meta["dp-accountant"] != ACCOUNTANT:
            raise ValueError(f"DP accountant {meta['dp-accountant']!r}: this server verifies {ACCOUNTANT!r}")
        if list(meta["dp-mechanisms"]) != list(MECHANISMS):
            raise ValueError(f"DP mechanisms {meta['dp-mechanisms']!r}: a DP upload releases "
                             f"{list(MECHANISMS)}")
        number = {}
        for key in ("dp-epsilon", "dp-delta", "dp-sgd-noise-multiplier", "dp-sgd-sample-rate",
                    "dp-sgd-max-grad-norm", "dp-histogram-noise-multiplier"):
            value = meta[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{key} {value!r} is not a finite number")
            number[key] = float(value)
        steps = meta["dp-sgd-steps"]
        if type(steps) is not int or not 1 <= steps <= MAX_STEPS:
            raise ValueError(f"dp-sgd-steps {steps!r} is not an integer in [1, {MAX_STEPS}]")
        for key in ("dp-epsilon", "dp-sgd-noise-multiplier", "dp-sgd-max-grad-norm", "dp-histogram-noise-multiplier"):
            if number[key] <= 0:
                raise ValueError(f"{key} {number[key]!r} must be > 0")
        if not 0 < number["dp-delta"] < 1:
            raise ValueError(f"dp-delta {number['dp-delta']!r} outside (0, 1)")
        if not 0 < number["dp-sgd-sample-rate"] <= 1:
            raise ValueError(f"dp-sgd-sample-rate {number['dp-sgd-sample-rate']!r} outside (0, 1]")
        claim = cls(epsilon=number["dp-epsilon"], delta=number["dp-delta"],
                    sgd_noise_multiplier=number["dp-sgd-noise-multiplier"],
                    sample_rate=number["dp-sgd-sample-rate"], steps=steps,
                    max_grad_norm=number["dp-sgd-max-grad-norm"],
                    histogram_noise_multiplier=number["dp-histogram-noise-multiplier"])
        actual = claim.recompute()
        if not abs(actual - claim.epsilon) <= CLAIM_TOLERANCE * claim.epsilon:
            raise ValueError(f"the claimed mechanisms give epsilon {actual:.4g} at delta {claim.delta:g} under the "
                             f"{ACCOUNTANT} accountant, not the claimed {claim.epsilon:.4g}")
        return claim

    @classmethod
    def example_meta(cls) -> dict:
        return cls(1.0, 1e-5, 1.0, 0.1, 1, 1.0, 1.0).to_meta()


def plan(num_examples: int, batch_size: int, epochs: int, dp: DPConfig) -> DPGuarantee:
    """The mechanisms' parameters for a client of `num_examples` examples training `epochs` passes of the expected
    batch `batch_size`, and its composed epsilon: sigma_h for the histogram's share, then the smallest training
    noise multiplier that keeps the pair within dp.epsilon."""
    if not dp.enabled:
        raise ValueError("plan: local.dp.epsilon is 0 (DP off)")
    sample_rate, steps = poisson_schedule(num_examples, batch_size, epochs)
    sigma_h = histogram_noise_multiplier(dp.epsilon, dp.delta)

    def composed(sigma: float) -> float:
        return epsilon_of([(sigma, sample_rate, steps), (sigma_h, 1.0, 1)], dp.delta)

    sigma = _smallest_sigma(composed, dp.epsilon, "DP-SGD")
    return DPGuarantee(composed(sigma), dp.delta, sigma, sample_rate, steps, dp.max_grad_norm, sigma_h)


# --- randomness, the histogram ------------------------------------------------------------------------

def private_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator seeded from the operating system's entropy, never from the run seed (the server knows that)."""
    return torch.Generator(device=device).manual_seed(secrets.randbits(63))


def release_histogram(counts: np.ndarray, noise_multiplier: float, generator: torch.Generator) -> np.ndarray:
    """The Gaussian mechanism on the label histogram (L2 sensitivity 1, noise std = noise_multiplier), rounded to
    integers and clipped at 0. A release that rounds to all zeros becomes ones: the server refuses a client that
    holds nothing, and the change reads nothing but the release (post-processing: no privacy cost)."""
    exact = torch.as_tensor(np.asarray(counts), dtype=torch.float64)
    noise = torch.randn(exact.shape, generator=generator, dtype=torch.float64, device=generator.device).cpu()
    released = torch.clamp(torch.round(exact + noise_multiplier * noise), min=0).to(torch.int64).numpy()
    return released if released.sum() > 0 else np.ones_like(released)


# --- DP-SGD -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PrivateTraining:
    stats: TrainStats  # loss and accuracy on the client's own data: logged there, never uploaded
    guarantee: DPGuarantee
    label_counts: np.ndarray  # the released (noised) histogram: what the upload carries


# loss_of(private_model, x, y) -> (each example's loss, shape (len(y),); correct predictions or None)
LossOf = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, int | None]]


class PerExampleLoss(nn.Module):
    """The criterion Opacus's ghost clipping wraps: it is handed each example's loss and reduces it as asked
    (Opacus sets reduction "none" to read the per-example losses, then backpropagates their mean)."""

    reduction = "mean"

    def forward(self, losses: torch.Tensor) -> torch.Tensor:
        return losses if self.reduction == "none" else losses.mean()


def make_private(model: nn.Module, optimizer: torch.optim.Optimizer, loader, noise_multiplier: float,
                 max_grad_norm: float, noise_generator: torch.Generator):
    """Opacus's DP-SGD with Poisson sampling and ghost clipping (Li et al., "Large Language Models Can Be Strong
    Differentially Private Learners", ICLR 2022; Opacus grad_sample_mode "ghost"): the same clipped, noised
    gradient as per-example gradients would give, but each example's gradient norm is computed from the layer's
    activations and output gradients (exactly, for Linear layers; other layers compute their per-example gradients
    one layer at a time) and the clipped sum comes from a second backward pass, so no (batch x parameters) tensor
    is kept. A decoder client's CVAE (0.4 M parameters, mostly Linear) trains ~18x faster than with per-example
    gradients. Returns (engine, private model, DP optimizer, criterion, Poisson loader); `criterion(losses)` on
    each example's loss gives the tensor whose backward() makes the step's clipped gradient."""
    from opacus import PrivacyEngine  # as above: only a DP client pays for Opacus

    engine = PrivacyEngine(accountant=ACCOUNTANT)
    private, dp_optimizer, criterion, dp_loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm, poisson_sampling=True, noise_generator=noise_generator,
        criterion=PerExampleLoss(), grad_sample_mode="ghost")
    return engine, private, dp_optimizer, criterion, dp_loader


def train_private(model: nn.Module, shard: Split, local: LocalConfig, dp: DPConfig, counts: np.ndarray,
                  device: torch.device, label: str = "client", sampler_generator: torch.Generator | None = None,
                  noise_generator: torch.Generator | None = None) -> PrivateTraining:
    """A DP classifier: DP-SGD on cross-entropy with SGD at local.lr / momentum / weight-decay, local.dp.epochs
    passes of the expected batch local.batch-size (dp_sgd), then the Gaussian histogram release."""

    def cross_entropy(private: nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
        logits = private(x)
        return F.cross_entropy(logits, y, reduction="none"), int((logits.argmax(1) == y).sum())

    def sgd(params) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=local.lr, momentum=local.momentum, weight_decay=local.weight_decay)

    return dp_sgd(model, shard, dp, counts, device, optimizer=sgd, batch_size=local.batch_size, epochs=dp.epochs,
                  loss_of=cross_entropy, label=label, sampler_generator=sampler_generator,
                  noise_generator=noise_generator)


def dp_sgd(model: nn.Module, shard: Split, dp: DPConfig, counts: np.ndarray, device: torch.device, *,
           optimizer: Callable[..., torch.optim.Optimizer], batch_size: int, epochs: int, loss_of: LossOf,
           label: str = "client", sampler_generator: torch.Generator | None = None,
           noise_generator: torch.Generator | None = None) -> PrivateTraining:
    """DP-SGD on `shard` (Opacus, Poisson sampling at the rate of `batch_size`, `epochs` passes; `optimizer`
    builds the base optimizer from the parameters, `loss_of(private_model, x, y)` gives each example's loss and
    the number of correct predictions, or None; make_private: ghost clipping), then the Gaussian histogram
    release; the model is trained in place.

    The generators default to `private_generator`s (tests pass seeded ones). The steps Opacus's accountant
    counted must be the plan's, and the composed epsilon of the same accountant is the claim."""
    problems = dp_problems(model)
    if problems:
        raise ValueError(f"{label}: the model cannot train with DP-SGD: {'; '.join(problems)}")
    if len(shard) == 0:
        raise ValueError(f"{label}: empty shard, nothing to train on")
    planned = plan(len(shard), batch_size, epochs, dp)
    sampler_generator = sampler_generator or private_generator()
    noise_generator = noise_generator or private_generator(device)
    model.to(device).train()
    base = optimizer(model.parameters())
    x_all = to_tensor(shard.images)
    y_all = torch.as_tensor(shard.labels, dtype=torch.long)
    loader = DataLoader(TensorDataset(x_all, y_all), batch_size=min(batch_size, len(shard)),
                        generator=sampler_generator)
    log.info("%s: DP-SGD, target (%g, %g)-DP: noise multiplier %.4f, Poisson sample rate %.5f, %d steps, clip %g; "
             "label histogram noise multiplier %.3f", label, dp.epsilon, dp.delta, planned.sgd_noise_multiplier,
             planned.sample_rate, planned.steps, dp.max_grad_norm, planned.histogram_noise_multiplier)
    start, clock = time.perf_counter(), EpochClock(epochs)
    loss_sum = seen = 0.0
    correct: float | None = 0.0
    with warnings.catch_warnings():
        # Opacus's reminder that secure_mode is off (see the module doc), and torch's note that a backward hook
        # fires on a first layer whose input needs no gradient: both expected, once per step.
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        engine, private, dp_optimizer, criterion, dp_loader = make_private(
            model, base, loader, planned.sgd_noise_multiplier, dp.max_grad_norm, noise_generator)
        try:
            for epoch in range(1, epochs + 1):
                loss_sum = seen = 0.0
                correct = 0.0
                for x, y in dp_loader:
                    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                    dp_optimizer.zero_grad(set_to_none=True)
                    losses, hits = loss_of(private, x, y)
                    if not bool(torch.isfinite(losses).all()):
                        raise FloatingPointError(f"{label}: non-finite training loss at epoch {epoch} (lower the "
                                                 "learning rate)")
                    criterion(losses).backward()  # ghost clipping's two passes
                    dp_optimizer.step()  # an empty Poisson batch still steps: noise only, and the accountant counts it
                    loss_sum += float(losses.detach().sum())
                    correct = None if hits is None or correct is None else correct + hits
                    seen += len(y)
                accuracy = "" if correct is None else f"  train acc {correct / max(seen, 1):.4f}"
                log.info("%s: DP epoch %d/%d  loss %.4f%s  (%.1fs, %s)", label, epoch, epochs,
                         loss_sum / max(seen, 1), accuracy, time.perf_counter() - start, clock.eta(epoch))
        finally:
            private._close()  # Opacus's hooks and per-example gradient buffers leave the model
    accountant = engine.accountant
    counted = list(accountant.history)
    if counted != [(planned.sgd_noise_multiplier, planned.sample_rate, planned.steps)]:
        raise RuntimeError(f"{label}: Opacus's accountant counted {counted}, the plan was "
                           f"{(planned.sgd_noise_multiplier, planned.sample_rate, planned.steps)}")
    accountant.history.append((planned.histogram_noise_multiplier, 1.0, 1))  # the histogram: the same accountant
    epsilon = float(accountant.get_epsilon(delta=dp.delta, alphas=list(ALPHAS)))
    if epsilon > dp.epsilon:
        raise RuntimeError(f"{label}: composed epsilon {epsilon:.4f} exceeds local.dp.epsilon={dp.epsilon:g}")
    guarantee = DPGuarantee(**{**asdict(planned), "epsilon": epsilon})
    released = release_histogram(counts, planned.histogram_noise_multiplier, noise_generator)
    seconds = time.perf_counter() - start
    log.info("%s: (%.4f, %g)-DP upload: model (DP-SGD) and label histogram (Gaussian) composed under the %s "
             "accountant", label, epsilon, dp.delta, ACCOUNTANT)
    train_accuracy = float("nan") if correct is None else correct / max(seen, 1)
    stats = TrainStats(epochs, planned.steps, loss_sum / max(seen, 1), train_accuracy, seconds)
    return PrivateTraining(stats, guarantee, released)


def check_upload_is_private(state: Mapping[str, torch.Tensor], metrics: Mapping[str, object]) -> None:
    """ValueError if a DP upload carries what its guarantee does not cover: BN running statistics, or metrics
    computed on the client's data."""
    statistics = [key for key in state if key.endswith(BN_STATISTICS)]
    if statistics:
        raise ValueError(f"DP upload carries BN running statistics ({', '.join(statistics[:3])}), which its "
                         "guarantee does not cover")
    private = sorted(set(metrics) - PUBLIC_METRICS)
    if private:
        raise ValueError(f"DP upload carries metric(s) {private} computed on the client's data, which its "
                         "guarantee does not cover")
