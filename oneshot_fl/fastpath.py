"""The fast path of a CUDA device: bf16 autocast, data held on the device, channels-last models.

Which parts are on is decided by the device and the run config's gpu.* knobs (`FastPath.for_device`): on a CPU
every part is off and the float32 code runs as before, bit for bit. Every part also runs on a CPU when asked
explicitly (CPU autocast has bfloat16), which is how the tests compare it with the float32 path.

What bf16 covers: the forward passes of training steps (client SGD, generator steps, the student's KD steps) and
the backward passes through them. What stays float32, and why:
  - parameters, gradients and the optimizers' state (autocast casts copies for the matmuls and convolutions only);
  - BatchNorm's running statistics and the BN-statistics loss (its hook reads the layer input in float32);
  - every loss and the logits it reads (softmax, log-softmax and KL of near-equal distributions lose their
    small differences in 8 mantissa bits), and the aggregation of the teachers' logits (FedHydra's SA weights);
  - Model Stratification (its runs stop at a CE of 0.01, which bf16 rounding would move across pairs);
  - evaluation: a reported accuracy is the float32 model's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn


@dataclass(frozen=True)
class FastPath:
    """Which parts of the fast path a process runs (all off: the float32 path)."""

    bf16: bool = False  # autocast(bfloat16) around training forwards
    device_data: bool = False  # shards, test set and synthetic pool live on the compute device
    channels_last: bool = False  # models (and so their activations) in NHWC layout

    @classmethod
    def for_device(cls, device: torch.device, gpu_cfg) -> "FastPath":
        """The parts the run config's gpu.* knobs (a GPUConfig) turn on, on a CUDA device; nothing on a CPU."""
        if device.type != "cuda":
            return cls()
        return cls(bf16=gpu_cfg.bf16, device_data=gpu_cfg.device_data, channels_last=gpu_cfg.channels_last)

    @property
    def on(self) -> bool:
        return self.bf16 or self.device_data or self.channels_last

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """bfloat16 autocast for a training forward where bf16 is on, else a no-op context."""
        if not self.bf16:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=torch.bfloat16)

    def prepare(self, model: nn.Module) -> nn.Module:
        """A model in this path's layout (channels-last where on; the layout changes strides, never values)."""
        return model.to(memory_format=torch.channels_last) if self.channels_last else model

    def describe(self) -> str:
        parts = [name for name, on in (("bf16 autocast", self.bf16), ("device-held data", self.device_data),
                                       ("channels-last", self.channels_last)) if on]
        return ", ".join(parts) if parts else "off (float32, host data)"

    def as_dict(self) -> dict:
        return {"bf16": self.bf16, "device_data": self.device_data, "channels_last": self.channels_last}


FLOAT32 = FastPath()  # every part off: the float32 path with host data


class HeldImages:
    """uint8 images (N, H, W, C) held on a device; `batch(index)` gives float32 (b, C, H, W) in [0, 1], the values
    and layout `oneshot_fl.data.datasets.to_tensor` gives on the host (a permuted view cast to float, then / 255).
    A quarter of the float32 copy's memory, and no host-to-device copy per step."""

    def __init__(self, images: np.ndarray, device: torch.device):
        self.images = torch.from_numpy(np.ascontiguousarray(images)).to(device)
        self.device = self.images.device

    def __len__(self) -> int:
        return len(self.images)

    def batch(self, index) -> torch.Tensor:
        return self.images[index].permute(0, 3, 1, 2).float().div_(255.0)
