"""torchvision's ResNet-18 and GoogLeNet adapted to 28/32-pixel inputs (the usual CIFAR stem).

The ImageNet stems (7x7 stride-2 conv + max-pools) shrink a 32px image to 1-2 pixels before the
last stages; replacing them with a 3x3 stride-1 conv and no early pooling keeps the torchvision
bodies intact while giving small images room.
"""

from __future__ import annotations

from torch import nn

# torchvision is imported by the builders, not here: `import torchvision` pulls in torch._dynamo
# (~3 s of CPU), which a process that only validates a config or runs a small CNN never needs.


def resnet18(in_channels: int = 3, image_size: int = 32, num_classes: int = 10) -> nn.Module:
    from torchvision.models import resnet18 as tv_resnet18

    model = tv_resnet18(num_classes=num_classes)
    model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
    model.maxpool = nn.Identity()
    return model


def googlenet(in_channels: int = 3, image_size: int = 32, num_classes: int = 10) -> nn.Module:
    from torchvision.models import GoogLeNet
    from torchvision.models.googlenet import BasicConv2d

    model = GoogLeNet(num_classes=num_classes, aux_logits=False, transform_input=False, init_weights=True)
    model.conv1 = BasicConv2d(in_channels, 64, kernel_size=3, stride=1, padding=1)
    model.maxpool1 = nn.Identity()
    model.maxpool2 = nn.Identity()
    return model
