"""Logging for the core package: one handler on the "oneshot_fl" logger, set up by the apps."""

from __future__ import annotations

import logging
import sys


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever sys.stderr is when a record is emitted, not the one at setup: a process that
    swaps sys.stderr later (a test's capture, an embedding application) must not leave the handler writing to a
    closed stream."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ / setStream assign it; sys.stderr always wins
        pass


def setup_logging(level: int = logging.INFO) -> logging.Logger:
    logger = logging.getLogger("oneshot_fl")
    if not any(getattr(h, "_oneshot_fl", False) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [oneshot-fl] %(message)s", "%H:%M:%S"))
        handler._oneshot_fl = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)
    return logger
