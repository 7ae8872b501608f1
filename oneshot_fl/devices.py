"""Device and thread choice: cuda when present, CPU otherwise."""

from __future__ import annotations

import os

import torch


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def compute_memory_format() -> torch.memory_format:
    """The layout models are built in: channels-last on CPUs, NCHW on GPUs.

    Channels-last weights make every convolution (and the activations after it) run in NHWC whatever layout the
    input has. On a CPU thread that made teacher forwards 1.2-1.9x and synthesis steps 1.1-2.2x faster and
    training up to 1.5x (GoogLeNet; LeNet's training step alone 0.8-1.0x); on an H100 in float32 it was
    0.87-1.10x at the tables' batches and mixed at batch 256 (benchmarks/results/memory_format.md). Values and
    state_dict shapes do not depend on it, only strides.
    """
    return torch.channels_last if pick_device().type == "cpu" else torch.contiguous_format


def set_threads(threads: int = 0, concurrent_processes: int = 1) -> int:
    """Set torch intra-op threads: `threads` if given, else cores / concurrent processes.

    Several Ray actors on a small machine each defaulting to all cores oversubscribe it badly.
    """
    if threads <= 0:
        threads = max(1, (os.cpu_count() or 1) // max(1, concurrent_processes))
    torch.set_num_threads(threads)
    return threads
