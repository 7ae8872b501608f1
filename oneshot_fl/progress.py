"""Epoch progress for streamed logs: "ETA mm:ss" from the mean epoch time so far.

Runs are read as streamed logs (`flwr log --stream`, run.log), where progress bars turn into
garbage, so progress is one log line per epoch; this only computes its ETA part.
"""

from __future__ import annotations

import time


def format_seconds(seconds: float) -> str:
    """mm:ss, or h:mm:ss from an hour on."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


class EpochClock:
    """Timer of a loop over epochs `first..total`: `eta(epoch)` after finishing `epoch`."""

    def __init__(self, total: int, first: int = 1):
        self.total, self.first = total, first
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def eta(self, epoch: int) -> str:
        done = epoch - self.first + 1
        mean = self.elapsed() / max(done, 1)
        return f"ETA {format_seconds(mean * max(self.total - epoch, 0))}"
