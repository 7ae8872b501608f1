"""Output piped into a reader that stops early (`oneshot-fl list keys | head -1`) ends the command quietly with
exit 141, as SIGPIPE ends a Unix tool (launcher/shutdown.py): no "unexpected error: BrokenPipeError", no
"Exception ignored" at exit; a run's log goes on being kept once it can no longer be shown."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest

from launcher import cli, control_api
from launcher.shutdown import SIGPIPE_EXIT
from oneshot_fl.config import PROJECT_ROOT, run_config_key_lines

PAGE = 4096  # the smallest pipe Linux makes


def test_sigpipe_exit_is_the_shells_status_for_a_command_sigpipe_ended():
    assert SIGPIPE_EXIT == 141  # 128 + SIGPIPE (13)


@pytest.mark.skipif(not hasattr(fcntl, "F_SETPIPE_SZ"), reason="needs Linux's F_SETPIPE_SZ")
def test_list_keys_into_a_reader_that_takes_one_line_and_closes_ends_quietly_with_141():
    lines = run_config_key_lines()
    # the output cannot all be in the pipe before the reader closes (one page of pipe, and the one line read),
    # so the command is still writing when it does: what `| head -1` does to it, without the race
    assert len("\n".join(lines)) > 2 * PAGE
    read_end, write_end = os.pipe()
    fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PAGE)
    proc = subprocess.Popen([sys.executable, "-m", "launcher.cli", "list", "keys"], stdout=write_end,
                            stderr=subprocess.PIPE, cwd=PROJECT_ROOT, text=True)
    os.close(write_end)
    first = b""
    while not first.endswith(b"\n"):  # byte by byte: the reader takes one line and nothing more
        first += os.read(read_end, 1)
    os.close(read_end)
    _, stderr = proc.communicate(timeout=60)
    assert first.decode().rstrip("\n") == lines[0]
    assert stderr == ""
    assert proc.returncode == SIGPIPE_EXIT


@pytest.mark.parametrize("argv", [["-m", "launcher.cli", "--version"], ["-m", "launcher.deploy", "commands"]],
                         ids=["oneshot-fl --version", "launcher.deploy commands"])
def test_output_into_a_closed_pipe_ends_quietly_with_141(argv):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the command writes: every write of its output fails
    proc = subprocess.run([sys.executable, *argv], stdout=write_end, stderr=subprocess.PIPE, cwd=PROJECT_ROOT,
                          text=True, timeout=60)
    os.close(write_end)
    assert proc.stderr == ""
    assert proc.returncode == SIGPIPE_EXIT


def test_a_broken_pipe_that_is_not_stdouts_is_still_an_error(capsys):
    def talks_to_a_closed_socket(args):
        raise BrokenPipeError(32, "Broken pipe")

    assert cli.run_command(talks_to_a_closed_socket, object()) == 1
    assert capsys.readouterr().err.startswith("oneshot-fl: unexpected error: BrokenPipeError")


class _Control:
    class client:  # noqa: N801 - stands in for the Control API's client
        @staticmethod
        def StreamLogs(request):  # noqa: N802 - Flower's name
            return [type("Res", (), {"log_output": f"line {i}\n"}) for i in range(3)]


def test_a_run_log_is_kept_whole_once_stdout_is_a_closed_pipe(monkeypatch):
    read_end, write_end = os.pipe()
    os.close(read_end)
    with open(write_end, "w") as closed:
        monkeypatch.setattr(sys, "stdout", closed)
        follower = control_api.LogFollower(_Control(), run_id=1, echo=True)
        follower.start()
        assert follower.text() == "line 0\nline 1\nline 2\n"
        with pytest.raises(BrokenPipeError):  # what was shown is still buffered: closing flushes it, in vain
            closed.close()
    assert follower.error == "" and follower.echo is False
