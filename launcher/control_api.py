"""A local SuperLink's Control API, asked from the launcher's own process.

Each `flwr ls` or `flwr log` is a new Python process that imports the Flower CLI: about 1.4 s of
CPU per call, which over a run's status checks was 3 % of the whole run's CPU (benchmarks/
launcher_cpu.py). The local SuperLink that `flwr run` starts for a simulation serves the same
Control API over plain HTTP on a port the launcher chose (FLWR_LOCAL_SUPERLINK_HTTP_API_PORT), so
the launcher asks it directly: a status check is one HTTP request, and the log is one stream that
both shows the run's output live and keeps it for the run folder.
"""

from __future__ import annotations

import re
import sys
import threading


def run_status_text(status, sub_status: str) -> str:
    """'finished:completed' the way `flwr ls` writes a run's status and sub-status."""
    return f"{status}:{sub_status}" if sub_status else str(status)


class LocalControl:
    """Status and logs of runs on the local (insecure, 127.0.0.1) SuperLink at `port`."""

    def __init__(self, port: int | str):
        # Flower's imports cost about a second of CPU, paid once here and only by launchers that ask
        from flwr.cli.utils import CliClientHttpInterceptor, RuntimeVersionHttpInterceptor
        from flwr.supercore.control import ControlHttpClient

        self.address = f"127.0.0.1:{int(port)}"
        self.client = ControlHttpClient.from_server_address(
            self.address, insecure=True, root_certificates=None,
            interceptors=[CliClientHttpInterceptor(), RuntimeVersionHttpInterceptor(component_name="flwr CLI")])

    def status(self, run_id: int) -> tuple[str, str]:
        """(status, details) of `run_id`, e.g. ('finished:failed', 'ServerApp raised ...'); ('', '')
        when the SuperLink cannot say (not up yet, or gone): the caller asks again later."""
        from flwr.proto.control_pb2 import ListRunsRequest  # pylint: disable=E0611

        try:
            res = self.client.ListRuns(ListRunsRequest(run_id=run_id))
        except Exception:  # noqa: BLE001 - any transport or server error means "no answer this time"
            return "", ""
        run = res.run_dict.get(run_id)
        if run is None:
            return "", ""
        return run_status_text(run.status.status, run.status.sub_status), run.status.details

    def stop(self, run_id: int) -> None:
        from flwr.proto.control_pb2 import StopRunRequest  # pylint: disable=E0611

        try:
            self.client.StopRun(StopRunRequest(run_id=run_id))
        except Exception:  # noqa: BLE001 - a run that already ended cannot be stopped: nothing to do
            pass

    def follow_log(self, run_id: int, echo: bool = True) -> LogFollower:
        """Start reading `run_id`'s log in a background thread (echoing it to stdout if `echo`)."""
        follower = LogFollower(self, run_id, echo)
        follower.start()
        return follower

    def close(self) -> None:
        self.client.close()


# Flower 1.41's simulation logs this on every run, whatever size it was given; the launcher always sets the
# size (the next log line, "Federation ... (N simulated SuperNodes)", shows it), so the echo leaves it out.
SIZE_NOTICE = "Since flwr 1.32, default simulated SuperNodes changed from 10 to 2."


def without_size_notice(chunk: str) -> str:
    """A log chunk as echoed: Flower's default-size notice dropped (run.log keeps the full log)."""
    if SIZE_NOTICE not in chunk:
        return chunk
    return "".join(line for line in chunk.splitlines(keepends=True) if SIZE_NOTICE not in line)


# ANSI escape sequences (Flower colours its log levels): kept for a terminal, dropped for a pipe or a file
ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]")


def strip_ansi(text: str) -> str:
    return ANSI.sub("", text)


def for_display(chunk: str, stream=None) -> str:
    """A log chunk as echoed to `stream` (default stdout): without colour codes unless it is a terminal."""
    stream = sys.stdout if stream is None else stream
    isatty = getattr(stream, "isatty", None)
    return chunk if isatty is not None and isatty() else strip_ansi(chunk)


def echo(chunk: str) -> bool:
    """Show a log chunk on stdout; False once stdout's reader has gone (`oneshot-fl run | head`): the run goes on
    and its log is still kept for the run folder, only no longer shown (the command's exit is then quiet,
    launcher.shutdown)."""
    try:
        sys.stdout.write(for_display(chunk))
        sys.stdout.flush()
    except BrokenPipeError:
        return False
    return True


class LogFollower(threading.Thread):
    """The run's log, streamed from its start until the SuperLink ends the stream (the run finished)."""

    def __init__(self, control: LocalControl, run_id: int, echo: bool):
        super().__init__(daemon=True, name=f"flwr-log-{run_id}")
        self.control, self.run_id, self.echo = control, run_id, echo
        self.chunks: list[str] = []
        self.error: str = ""

    def run(self) -> None:
        from flwr.proto.control_pb2 import StreamLogsRequest  # pylint: disable=E0611

        try:
            for res in self.control.client.StreamLogs(StreamLogsRequest(run_id=self.run_id, after_timestamp=0.0)):
                self.chunks.append(res.log_output)
                if self.echo:
                    self.echo = echo(without_size_notice(res.log_output))
        except Exception as exc:  # noqa: BLE001 - the log is a convenience; the run's status decides
            self.error = f"{type(exc).__name__}: {exc}"

    def text(self, wait: float = 10.0) -> str:
        """Everything read so far, after waiting up to `wait` s for the stream to end."""
        self.join(wait)
        return "".join(self.chunks)
