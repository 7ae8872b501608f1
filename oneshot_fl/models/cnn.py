"""The papers' small client CNNs (DENSE / FedHydra code), sized for 28px or 32px inputs."""

from __future__ import annotations

import math

import torch
from torch import nn


def group_norm(channels: int) -> nn.GroupNorm:
    """GroupNorm in place of BatchNorm2d(channels), for differentially private clients (DP-SGD needs
    per-example gradients, and BatchNorm mixes the examples of a batch; its running statistics are
    data statistics too). The groups are the ones Opacus's own BatchNorm replacement
    (ModuleValidator.fix) picks: gcd(32, channels), Wu & He's ("Group Normalization", ECCV 2018) G = 32
    where the layer is that wide, one channel per group in narrower layers."""
    return nn.GroupNorm(math.gcd(32, channels), channels)


def norm_layer(norm: str):
    """channels -> normalisation module: "batch" (BatchNorm2d) or "group" (group_norm)."""
    if norm == "batch":
        return nn.BatchNorm2d
    if norm == "group":
        return group_norm
    raise ValueError(f"unknown normalisation {norm!r}: use batch or group")


class CNN2(nn.Module):
    """Two-layer CNN with BN ("CNNMnist"): [conv5-BN-ReLU-pool] x 2 -> FC. 29,034 params on 28x28x1.

    `norm="group"` is the DP variant (registered as "cnn2-gn"): GroupNorm, same parameter count, no buffers."""

    def __init__(self, in_channels: int = 1, image_size: int = 28, num_classes: int = 10, norm: str = "batch"):
        super().__init__()
        make_norm = norm_layer(norm)
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 5, padding=2), make_norm(16), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, padding=2), make_norm(32), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(32 * (image_size // 4) ** 2, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class CNN3(nn.Module):
    """Three-layer CNN ("CNNCifar"): conv3 128 x 3, two max-pools, FC. BN after each conv optional.

    The papers' version has no BN, which makes the BN-statistics loss inert; `batch_norm=True`
    is the variant the data-free methods can use (registered as "cnn3-bn"), `norm="group"` its DP
    variant ("cnn3-gn": GroupNorm after each conv).
    """

    def __init__(self, in_channels: int = 3, image_size: int = 32, num_classes: int = 10,
                 batch_norm: bool = False, norm: str = "batch"):
        super().__init__()
        make_norm = norm_layer(norm)
        normalised = batch_norm or norm != "batch"

        def block(cin: int) -> list[nn.Module]:
            layers: list[nn.Module] = [nn.Conv2d(cin, 128, 3)]
            if normalised:
                layers.append(make_norm(128))
            return layers + [nn.ReLU()]

        self.features = nn.Sequential(
            *block(in_channels), nn.MaxPool2d(2), *block(128), nn.MaxPool2d(2), *block(128),
        )
        side = ((image_size - 2) // 2 - 2) // 2 - 2  # 32 -> 4, 28 -> 3
        self.classifier = nn.Linear(128 * side * side, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class LeNet5(nn.Module):
    """LeNet-5: conv5 6 - avgpool - conv5 16 - avgpool - FC 120 - FC 84 - FC C (no BN).

    28px inputs get the classic padding of 2 so both sizes reach the 16x5x5 feature map.
    """

    def __init__(self, in_channels: int = 1, image_size: int = 32, num_classes: int = 10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5, padding=(32 - image_size) // 2), nn.ReLU(), nn.AvgPool2d(2),
            nn.Conv2d(6, 16, 5), nn.ReLU(), nn.AvgPool2d(2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(16 * 5 * 5, 120), nn.ReLU(), nn.Linear(120, 84), nn.ReLU(), nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class VGG9(nn.Module):
    """FedMHO's VGG-9 (no BN): 4 conv layers (64-128-256-256), adaptive 7x7 pool, FC 4096-4096-C.

    `width` scales every layer (1.0 = the paper's 69 M parameters; smaller for CPU runs).
    """

    def __init__(self, in_channels: int = 1, image_size: int = 28, num_classes: int = 10, width: float = 1.0):
        super().__init__()
        c = [max(1, int(round(v * width))) for v in (64, 128, 256, 256, 4096)]
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, c[0], 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c[0], c[1], 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(c[1], c[2], 3, padding=1), nn.ReLU(),
            nn.Conv2d(c[2], c[3], 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(7),
        )
        self.classifier = nn.Sequential(
            nn.Linear(c[3] * 49, c[4]), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(c[4], c[4]), nn.ReLU(), nn.Dropout(0.5),
            nn.Linear(c[4], num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))
