"""Device and thread choice: cuda when present, CPU otherwise."""

from __future__ import annotations

import os

import torch


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def set_threads(threads: int = 0, concurrent_processes: int = 1) -> int:
    """Set torch intra-op threads: `threads` if given, else cores / concurrent processes.

    Several Ray actors on a small machine each defaulting to all cores oversubscribe it badly.
    """
    if threads <= 0:
        threads = max(1, (os.cpu_count() or 1) // max(1, concurrent_processes))
    torch.set_num_threads(threads)
    return threads
