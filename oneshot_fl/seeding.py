"""One seed for the whole run; every consumer derives its own stream from it by name."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator

import torch


def derive_seed(seed: int, *names: object) -> int:
    """A stable 63-bit seed for (seed, names...), equal in every process (unlike hash())."""
    text = "/".join([str(seed), *map(str, names)])
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1


def torch_generator(seed: int, *names: object, device: str | torch.device = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(derive_seed(seed, *names))
    return gen


@contextlib.contextmanager
def seeded_global_rng(seed: int, device: torch.device) -> Iterator[None]:
    """Run a block with torch's global RNG seeded with `seed`, restored afterwards. Dropout and other
    layers draw from the global RNG, which no generator argument reaches: unseeded, a model with
    dropout (GoogLeNet, VGG) trains differently in every process."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
