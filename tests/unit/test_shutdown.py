"""SIGTERM unwinds through `finally` (launcher/shutdown.py), so a killed command stops what it started."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from launcher import cli
from launcher.shutdown import Terminated, sigterm_unwinds


@pytest.fixture
def own_sigterm_handler():
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    yield seen
    signal.signal(signal.SIGTERM, previous)


def test_sigterm_raises_terminated_runs_the_cleanup_ignores_a_second_one_and_restores_the_handler(
        own_sigterm_handler):
    steps = []
    with pytest.raises(Terminated):
        with sigterm_unwinds():
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                steps.append("not reached")
            finally:
                os.kill(os.getpid(), signal.SIGTERM)  # a second one while cleaning up: ignored
                steps.append("cleanup ran to its end")
    assert steps == ["cleanup ran to its end"]
    assert own_sigterm_handler == []  # neither signal reached the handler that was there before
    os.kill(os.getpid(), signal.SIGTERM)
    assert own_sigterm_handler == [signal.SIGTERM]  # ... which is back in charge


def test_as_a_decorator_and_off_the_main_thread(own_sigterm_handler):
    @sigterm_unwinds()
    def work():
        os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Terminated):
        work()
    handlers = []

    def in_thread():
        with sigterm_unwinds():  # only the main thread may set handlers: a no-op here, not an error
            handlers.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert handlers == [signal.getsignal(signal.SIGTERM)] and own_sigterm_handler == []


def test_a_terminated_command_exits_143_in_one_line(capsys):
    def killed(args):
        os.kill(os.getpid(), signal.SIGTERM)

    assert cli.run_command(killed, type("Args", (), {"debug": False})()) == 143
    err = capsys.readouterr().err
    assert err.strip() == "oneshot-fl: terminated (SIGTERM); the processes it started were stopped"


@pytest.mark.parametrize("args, fragment", [
    (["--cpus-per-client", "nan"], "'nan': expected a finite number > 0"),
    (["--cpus-per-client", "0"], "'0': expected a finite number > 0"),
    (["--gpus-per-client", "inf"], "'inf': expected a finite number >= 0"),
    (["--gpus-per-client", "-0.5"], "'-0.5': expected a finite number >= 0"),
    (["--timeout", "-5"], "'-5': expected a finite number > 0"),
    (["--num-supernodes", "1.5"], "'1.5': expected an integer >= 1"),
    (["--num-supernodes", "0"], "'0': expected an integer >= 1"),
])
def test_launcher_options_are_checked_before_anything_starts(args, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", *args])
    assert exit_.value.code == 2 and fragment in capsys.readouterr().err


def test_bounded_accepts_the_edges_it_names():
    assert cli.bounded(0.0)("0") == 0.0 and cli.bounded(1, int, hi=65535)("65535") == 65535
    assert cli.bounded(0.0, inclusive=False)("1e-9") == 1e-9
