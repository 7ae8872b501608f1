"""Architecture registry: name -> builder(in_channels, image_size, num_classes).

Clients send an architecture name with their weights; the server rebuilds every model from
(name, input shape, classes) through this registry, and checks uploads against the shapes it
expects (computed on the meta device, so no memory is spent on big models).
"""

from __future__ import annotations

from functools import lru_cache, partial
from typing import Callable

import torch
from torch import nn

from oneshot_fl.data.datasets import DATASETS
from oneshot_fl.devices import compute_memory_format
from oneshot_fl.errors import ConfigError
from oneshot_fl.seeding import seeded_global_rng
from oneshot_fl.models.cnn import CNN2, CNN3, VGG9, LeNet5
from oneshot_fl.models.resnet_cifar import resnet8
from oneshot_fl.models.torchvision_nets import googlenet, resnet18

Builder = Callable[[int, int, int], nn.Module]

ARCHITECTURES: dict[str, Builder] = {
    "cnn2": CNN2,
    "cnn2-gn": partial(CNN2, norm="group"),  # DP variants (-gn): GroupNorm where BN was, see DP_VARIANTS
    "cnn3": CNN3,
    "cnn3-bn": partial(CNN3, batch_norm=True),
    "cnn3-gn": partial(CNN3, norm="group"),
    "lenet": LeNet5,
    "resnet8": resnet8,  # small residual net for 28px grey fleets on CPU
    "resnet8-gn": partial(resnet8, norm="group"),
    "resnet18": resnet18,
    "googlenet": googlenet,
    "vgg9": VGG9,
    "vgg9-small": partial(VGG9, width=0.25),  # FedMHO's VGG-9 at 1/4 width, for CPU runs
}


# The named DP variant of each BatchNorm architecture: DP-SGD clips per-example gradients, which BatchNorm
# (it mixes the examples of a batch) does not have, and BN running statistics are statistics of the client's
# data. A differentially private client trains the variant; nothing swaps one for the other silently
# (check_dp_arch names the variant when a DP run asks for a BN architecture).
DP_VARIANTS: dict[str, str] = {"cnn2": "cnn2-gn", "cnn3-bn": "cnn3-gn", "resnet8": "resnet8-gn"}


def check_arch(name: str, where: str = "architecture") -> str:
    if name not in ARCHITECTURES:
        raise ConfigError(f"{where}={name!r} is not a known architecture; choose one of: "
                          f"{', '.join(ARCHITECTURES)}")
    return name


def build(name: str, input_shape: tuple[int, int, int], num_classes: int, seed: int | None = None) -> nn.Module:
    """A fresh model; with `seed`, initialisation is reproducible (same seed, same weights)."""
    check_arch(name)
    channels, height, width = input_shape
    if height != width or height not in (28, 32):
        raise ValueError(f"{name}: input {input_shape} not supported (28x28 or 32x32 images)")
    if seed is None:
        model = ARCHITECTURES[name](channels, height, num_classes)
    else:
        with seeded_global_rng(seed, torch.device("cpu")):  # models are built on the CPU
            model = ARCHITECTURES[name](channels, height, num_classes)
    return model.to(memory_format=compute_memory_format())


@lru_cache(maxsize=64)
def expected_state(name: str, input_shape: tuple[int, int, int],
                   num_classes: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """state_dict key -> (shape, dtype) of an architecture, without allocating its weights."""
    with torch.device("meta"):
        model = build(name, input_shape, num_classes)
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def parameter_bytes(state: dict[str, torch.Tensor]) -> int:
    """Raw bytes of a state dict's tensors (what an upload must carry at least)."""
    return sum(t.numel() * t.element_size() for t in state.values())


def check_dp_arch(arch: str, where: str = "model", dataset: str | None = None, default: bool = False) -> str:
    """`arch` if Opacus can train it with per-example gradients (ModuleValidator.validate), else ConfigError
    naming its DP variant: a BatchNorm architecture is never swapped for it silently. `where` names the setting
    that chose `arch` (model, client-models entry, node-archs entry, node config arch)."""
    shape = DATASETS[dataset].input_shape if dataset else (1, 28, 28)
    with torch.device("meta"):  # the layers only: no memory for the weights
        problems = dp_problems(build(arch, shape, 10))
    if not problems:
        return arch
    what = f"{where} {arch!r}" + (f" (the default for {dataset})" if default and dataset else "")
    reason = "; ".join(sorted({problem.split(".")[0] for problem in problems}))  # Opacus's first sentence
    if arch in DP_VARIANTS:
        variant = DP_VARIANTS[arch]
        example = f", e.g. model='{variant}'" if where == "model" else ""
        fix = f"use its DP variant {variant!r} instead (GroupNorm in place of BatchNorm{example})"
    else:
        usable = [*DP_VARIANTS.values(), "cnn3", "lenet", "vgg9-small"]
        fix = f"no DP variant of {arch!r} is registered; choose one of {', '.join(usable)}"
    raise ConfigError(f"{what} cannot train with differential privacy (local.dp.epsilon > 0): {reason}; {fix}")


def dp_problems(model: nn.Module) -> list[str]:
    """What Opacus's ModuleValidator finds that DP-SGD cannot train (e.g. BatchNorm), one line each."""
    from opacus.validators import ModuleValidator  # Opacus takes seconds to import: only DP runs pay for it

    return [str(error) for error in ModuleValidator.validate(model, strict=False)]
