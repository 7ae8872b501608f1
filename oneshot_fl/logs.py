"""Logging for the core package: one handler on the "oneshot_fl" logger, set up by the apps."""

from __future__ import annotations

import logging
import sys


def setup_logging(level: int = logging.INFO) -> logging.Logger:
    logger = logging.getLogger("oneshot_fl")
    if not any(getattr(h, "_oneshot_fl", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [oneshot-fl] %(message)s", "%H:%M:%S"))
        handler._oneshot_fl = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)
    return logger
