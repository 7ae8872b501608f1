"""The CIFAR-style ResNet of "Deep Residual Learning for Image Recognition" (He et al., 2016, Sec. 4.2).

Depth 6n + 2: a 3x3 stem of 16 channels, three stages of n basic blocks at 16 / 32 / 64 channels
(stride 2 between stages), global average pooling, one linear layer. n = 1 is ResNet-8 (77,754
parameters on one input channel): a small residual network with BatchNorm that trains in minutes
on 28x28 grey images on a CPU, where ResNet-18 at full resolution does not. The blocks are
torchvision's BasicBlock; shortcuts across a stage change are 1x1 conv + BN (the paper's option B).
`norm="group"` puts GroupNorm (oneshot_fl.models.cnn.group_norm) wherever BN was: the DP variant "resnet8-gn".
"""

from __future__ import annotations

import torch
from torch import nn

from oneshot_fl.models.cnn import norm_layer


class CifarResNet(nn.Module):
    def __init__(self, in_channels: int = 3, image_size: int = 32, num_classes: int = 10, blocks_per_stage: int = 1,
                 norm: str = "batch"):
        super().__init__()
        from torchvision.models.resnet import BasicBlock  # torch._dynamo (seconds): only when a ResNet is built

        make_norm = norm_layer(norm)
        self.stem = nn.Sequential(nn.Conv2d(in_channels, 16, 3, padding=1, bias=False), make_norm(16),
                                  nn.ReLU(inplace=True))
        layers: list[nn.Module] = []
        channels = 16
        for stage, width in enumerate((16, 32, 64)):
            for block in range(blocks_per_stage):
                stride = 2 if stage > 0 and block == 0 else 1
                shortcut = None
                if stride != 1 or channels != width:
                    shortcut = nn.Sequential(nn.Conv2d(channels, width, 1, stride=stride, bias=False),
                                             make_norm(width))
                layers.append(BasicBlock(channels, width, stride=stride, downsample=shortcut, norm_layer=make_norm))
                channels = width
        self.stages = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(64, num_classes)
        if norm == "group":  # the DP variant: Opacus's per-example gradient hooks cannot follow an in-place
            for module in self.modules():  # activation (autograd refuses it); out of place, the same function
                if isinstance(module, nn.ReLU):
                    module.inplace = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(self.pool(self.stages(self.stem(x))), 1))


def resnet8(in_channels: int = 3, image_size: int = 32, num_classes: int = 10, norm: str = "batch") -> nn.Module:
    return CifarResNet(in_channels, image_size, num_classes, blocks_per_stage=1, norm=norm)
