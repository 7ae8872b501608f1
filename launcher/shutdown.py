"""SIGTERM and SIGINT unwind, so what a command started is stopped on the way out.

Python's default for SIGTERM (`timeout`, `kill`, a job scheduler, `docker stop`) ends the process at
once: no `finally` runs, and the SuperLink, the simulation engine and the SuperNodes the launcher or a
local fleet started keep running, orphaned. Inside `sigterm_unwinds()` a SIGTERM raises `Terminated`
where the main thread is, every `finally` and context manager on the way out runs (they stop their
processes by PID), and a second SIGTERM during that cleanup is ignored rather than cutting it short.

SIGINT (Ctrl-C, `kill -INT <pid>`) raises KeyboardInterrupt the same way, also when the process was
started with SIGINT ignored: a command started in the background of a script (`cmd &` in a shell
without job control) inherits an ignored SIGINT, and Python then installs no KeyboardInterrupt
handler at all, so `kill -INT <pid>` did nothing. A second Ctrl-C during the cleanup is ignored too
(the cleanup is bounded: the processes get a few seconds to stop, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import Iterator


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, like KeyboardInterrupt: `except Exception` does not swallow it."""


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # only the main thread can set a handler; its own one (if any) stays in charge
        return

    def raise_terminated(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the cleanup this starts must run to its end
        raise Terminated(f"signal {signum}")

    def raise_interrupt(signum, frame):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # likewise for a second Ctrl-C
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, raise_terminated)
    previous_int = signal.signal(signal.SIGINT, raise_interrupt)
    try:
        yield
    finally:
        # None: the previous handler was not set from Python; the default is what it was
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)
        signal.signal(signal.SIGINT, signal.SIG_DFL if previous_int is None else previous_int)
