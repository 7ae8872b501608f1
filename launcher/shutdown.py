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

Output piped into a reader that stops early (`oneshot-fl list keys | head`) ends the command quietly, as
SIGPIPE ends a Unix tool (`quiet_when_output_closes`): Python ignores SIGPIPE, so a write to the closed pipe
raises BrokenPipeError instead, often only in the flush at exit; it is caught there, stdout is pointed at
/dev/null so that the interpreter's last flush has nowhere to fail, and the exit status is the shell's for
a tool that SIGPIPE ended, 141 (as Python's documentation recommends, with that status in place of its 1).
"""

from __future__ import annotations

import contextlib
import functools
import os
import select
import signal
import sys
import threading
from typing import Callable, Iterator

SIGPIPE_EXIT = 128 + signal.SIGPIPE  # 141: what a shell reports for a command that SIGPIPE ended


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


def stdout_closed() -> bool:
    """Whether stdout's reader has gone: poll reports POLLERR on the write end of a pipe without readers. False
    where that cannot be told (no file descriptor, as under pytest's capture): a BrokenPipeError from anything
    else (a socket, a child's pipe) is then reported as the error it is."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def quiet_when_output_closes(main: Callable[..., int]) -> Callable[..., int]:
    """A command's `main` that ends quietly with SIGPIPE_EXIT once its stdout's reader has gone (see the module
    docstring): the output is flushed before `main` returns (and before argparse's SystemExit of --help leaves),
    where a closed pipe can still be caught."""
    @functools.wraps(main)
    def run(*args, **kwargs) -> int:
        try:
            try:
                return main(*args, **kwargs)
            finally:
                sys.stdout.flush()
        except BrokenPipeError:
            if not stdout_closed():
                raise
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())  # what is still buffered goes there at exit
            os.close(devnull)
            return SIGPIPE_EXIT
    return run
