"""Client-side augmentation of image batches: the random crop of the zero-padded image and the horizontal flip
that DENSE's code applies to CIFAR-10 clients (torchvision's RandomCrop(32, padding=4) then
RandomHorizontalFlip(0.5), per image).

Here a whole batch is cropped and flipped by one gather, on whatever device holds it, with the offsets and flips
drawn beforehand from a CPU generator (`crop_flip_params`): the same draws give the same images on a CPU and a GPU,
and one image's draws (row offset, column offset, flip) come in the order torchvision's transforms take them from
torch's global generator.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PAD = 4


def crop_flip_params(n: int, generator: torch.Generator, pad: int = PAD) -> tuple[torch.Tensor, torch.Tensor]:
    """(offsets (n, 2): row and column of each crop's corner in the padded image, uniform on 0..2 pad;
    flips (n,): True with probability 1/2)."""
    offsets = torch.randint(0, 2 * pad + 1, (n, 2), generator=generator)
    flips = torch.rand(n, generator=generator) < 0.5
    return offsets, flips


def crop_flip(images: torch.Tensor, offsets: torch.Tensor, flips: torch.Tensor, pad: int = PAD) -> torch.Tensor:
    """(b, C, H, W) images -> the (H, W) window at `offsets` of each image padded by `pad` zeros on every side,
    mirrored left-right where `flips`. Pure indexing: every output value is an input value or 0."""
    b, c, h, w = images.shape
    device = images.device
    offsets, flips = offsets.to(device), flips.to(device)
    padded = F.pad(images, (pad, pad, pad, pad))
    rows = offsets[:, 0, None] + torch.arange(h, device=device)  # (b, H)
    cols = offsets[:, 1, None] + torch.arange(w, device=device)  # (b, W)
    cols = torch.where(flips[:, None], cols.flip(1), cols)
    batch = torch.arange(b, device=device)[:, None, None, None]
    channel = torch.arange(c, device=device)[None, :, None, None]
    return padded[batch, channel, rows[:, None, :, None], cols[:, None, None, :]]
