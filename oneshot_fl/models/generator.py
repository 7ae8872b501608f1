"""The DENSE / FedHydra generator: noise -> image in [0, 1] (FedHydra paper Sec. 4.1.3 "Models"; DENSE
(Zhang et al., NeurIPS 2022) Sec. 2.2 and its code).

Linear(nz -> 2ngf x s/4 x s/4) -> BN -> up x2 -> conv3 -> BN -> LeakyReLU -> up x2 -> conv3 -> BN
-> LeakyReLU -> conv3 -> Sigmoid. Two x2 upsamplings, so 28px (7 -> 28) and 32px (8 -> 32) both
work; nz = 256, ngf = 64 gives the papers' 1,834,305 parameters at 28x28x1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class Generator(nn.Module):
    def __init__(self, nz: int = 256, ngf: int = 64, image_size: int = 28, channels: int = 1):
        super().__init__()
        if image_size % 4:
            raise ValueError(f"image size {image_size} must be divisible by 4")
        self.nz, self.init_size = nz, image_size // 4
        self.project = nn.Linear(nz, 2 * ngf * self.init_size ** 2)
        self.body = nn.Sequential(
            nn.BatchNorm2d(2 * ngf),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(2 * ngf, 2 * ngf, 3, padding=1, bias=False),
            nn.BatchNorm2d(2 * ngf),
            nn.LeakyReLU(0.2),
            nn.Upsample(scale_factor=2),
            nn.Conv2d(2 * ngf, ngf, 3, padding=1, bias=False),
            nn.BatchNorm2d(ngf),
            nn.LeakyReLU(0.2),
            nn.Conv2d(ngf, channels, 3, padding=1),
            nn.Sigmoid(),
        )

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.project(z).view(z.shape[0], -1, self.init_size, self.init_size)
        return self.body(h)


@dataclass(frozen=True)
class GeneratorSpec:
    """Everything needed to build a generator: noise size, width, output size and channels."""

    nz: int
    ngf: int
    image_size: int
    channels: int

    def build(self) -> Generator:
        return Generator(self.nz, self.ngf, self.image_size, self.channels)


def reset_generator(generator: Generator, seed: int) -> Generator:
    """DENSE's initialisation: conv/linear weights N(0, 0.02), bias 0; BN gamma N(1, 0.02), beta 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in generator.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                module.weight.copy_(torch.randn(module.weight.shape, generator=gen) * 0.02)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.BatchNorm2d):
                module.weight.copy_(1.0 + torch.randn(module.weight.shape, generator=gen) * 0.02)
                module.bias.zero_()
                module.reset_running_stats()
    return generator
