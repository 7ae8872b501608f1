"""The launcher's in-process Control API path and the pruned app copy `flwr run` bundles; all
without starting Flower (a stand-in answers the Control API with real Flower protobuf messages); colour codes
only for a terminal; run.log also when the run is interrupted."""

import sys
import time
from pathlib import Path

import pytest
from flwr.proto.control_pb2 import ListRunsResponse, StreamLogsResponse
from flwr.proto.run_pb2 import Run, RunStatus

import launcher.launch as launch
from launcher.control_api import LocalControl, run_status_text
from tests.unit.test_launcher_polling import Clock


class FakeControlClient:
    """Answers ListRuns from a list of (status, sub_status, details), StreamLogs from log chunks."""

    def __init__(self, statuses, chunks=(), fail_logs=False):
        self.statuses, self.chunks, self.fail_logs = list(statuses), list(chunks), fail_logs
        self.asked, self.stopped, self.closed = [], [], False

    def ListRuns(self, request):  # noqa: N802 - Flower's method name
        self.asked.append(request.run_id)
        if not self.statuses:
            raise ConnectionError("SuperLink gone")
        status, sub, details = self.statuses.pop(0)
        res = ListRunsResponse()
        res.run_dict[request.run_id].CopyFrom(
            Run(run_id=request.run_id, status=RunStatus(status=status, sub_status=sub, details=details)))
        return res

    def StopRun(self, request):  # noqa: N802
        self.stopped.append(request.run_id)

    def StreamLogs(self, request):  # noqa: N802
        assert request.after_timestamp == 0.0  # the whole log, from the run's start
        if self.fail_logs:
            raise ConnectionError("no log stream")
        for chunk in self.chunks:
            yield StreamLogsResponse(log_output=chunk, latest_timestamp=1.0)

    def close(self):
        self.closed = True


def control_with(client) -> LocalControl:
    control = LocalControl.__new__(LocalControl)  # no HTTP client: the stand-in answers
    control.address, control.client = "127.0.0.1:0", client
    return control


def test_status_text_matches_flwr_ls():
    assert run_status_text("finished", "completed") == "finished:completed"
    assert run_status_text("running", "") == "running"


def test_status_reads_the_asked_run_and_says_nothing_when_the_superlink_cannot_answer():
    client = FakeControlClient([("finished", "failed", "ServerApp raised ValueError")])
    control = control_with(client)
    assert control.status(7) == ("finished:failed", "ServerApp raised ValueError")
    assert client.asked == [7]
    assert control.status(7) == ("", "")  # the stand-in now raises: no answer, not a crash


def test_wait_for_status_asks_the_control_api_every_poll_and_never_starts_flwr_ls(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(launch.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(launch.time, "sleep", clock.sleep)
    monkeypatch.setattr(launch, "flwr_cli", lambda *a, **k: pytest.fail(f"flwr CLI started: {a}"))
    client = FakeControlClient([("running", "", "")] * 5 + [("finished", "completed", "")])
    asked_at = []
    real_list = client.ListRuns
    client.ListRuns = lambda request: (asked_at.append(clock.now), real_list(request))[1]
    status, _ = launch.wait_for_status(3, env={}, cwd=Path("."), poll=2.0, max_poll=60.0,
                                       control=control_with(client))
    assert status == "finished:completed"
    assert [round(t) for t in asked_at] == [0, 2, 4, 6, 8, 10]  # no back-off: an ask costs an HTTP request


def test_timeout_stops_the_run_through_the_control_api(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(launch.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(launch.time, "sleep", clock.sleep)
    monkeypatch.setattr(launch, "flwr_cli", lambda *a, **k: pytest.fail(f"flwr CLI started: {a}"))
    client = FakeControlClient([("running", "", "")] * 100)
    status, details = launch.wait_for_status(4, env={}, cwd=Path("."), timeout=10.0, control=control_with(client))
    assert status == "finished:stopped" and "timeout after 10s" in details
    assert client.stopped == [4]


def test_log_follower_keeps_every_chunk_in_order_and_echoes_them(capsys):
    control = control_with(FakeControlClient([], chunks=["a\n", "b\n", "c"]))
    assert control.follow_log(5, echo=True).text(wait=5) == "a\nb\nc"
    assert capsys.readouterr().out == "a\nb\nc"
    failed = control_with(FakeControlClient([], fail_logs=True)).follow_log(5, echo=False)
    assert failed.text(wait=5) == "" and "ConnectionError" in failed.error


def test_the_echo_leaves_out_flowers_default_size_notice_and_the_kept_log_has_it(capsys):
    notice = "WARNING :   Since flwr 1.32, default simulated SuperNodes changed from 10 to 2.\n"
    size = "INFO :      Federation `local` (5 simulated SuperNodes)\n"
    control = control_with(FakeControlClient([], chunks=["a\n" + notice + size, "b\n"]))
    assert control.follow_log(5, echo=True).text(wait=5) == "a\n" + notice + size + "b\n"
    assert capsys.readouterr().out == "a\n" + size + "b\n"


def test_local_control_only_for_the_local_simulation_superlink(monkeypatch):
    made = []
    monkeypatch.setattr(launch, "LocalControl", lambda port: made.append(port) or "control")
    assert launch.local_control({"FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": "39093"}, None) == "control"
    assert made == ["39093"]
    assert launch.local_control({"FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": "39093"}, "edge") is None  # a deployment
    assert launch.local_control({}, None) is None  # the user's own default connection: the CLI decides


def test_stage_app_copies_the_app_without_what_its_gitignore_excludes(tmp_path):
    app, dest = tmp_path / "app", tmp_path / "staged"
    files = {".gitignore": ".venv/\nruns/\n*.pt\n", "pyproject.toml": "[project]\n", "pkg/mod.py": "x = 1\n",
             "pkg/data.json": "{}", ".venv/lib/site.py": "", "runs/r1/result.json": "{}", "model.pt": "",
             "pkg/sub/runs/x.py": "", ".git/HEAD": "ref"}
    for rel, text in files.items():
        (app / rel).parent.mkdir(parents=True, exist_ok=True)
        (app / rel).write_text(text)
    (app / "link.py").symlink_to(app / "pkg" / "mod.py")
    dest.mkdir()
    launch.stage_app(app, dest)
    copied = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    # `runs/` (no leading slash) matches at any depth, as git reads it; symlinks and .git are left out
    assert copied == [".gitignore", "pkg/data.json", "pkg/mod.py", "pyproject.toml"]
    assert (dest / "pkg" / "mod.py").read_text() == "x = 1\n"


def test_stage_app_without_a_gitignore_copies_everything_but_git(tmp_path):
    app, dest = tmp_path / "app", tmp_path / "staged"
    for rel in ("pyproject.toml", "a/b.py", ".git/config"):
        (app / rel).parent.mkdir(parents=True, exist_ok=True)
        (app / rel).write_text("1")
    dest.mkdir()
    launch.stage_app(app, dest)
    assert sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()) == ["a/b.py",
                                                                                             "pyproject.toml"]


def test_a_client_share_no_machine_here_has_is_refused_before_anything_starts(monkeypatch):
    # Ray ends such a run with "ActorPool is empty" once the SuperLink and the simulation are up
    import torch

    from oneshot_fl.config import ConfigError

    monkeypatch.setattr(launch.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    launch.check_client_resources(2, 0)
    with pytest.raises(ConfigError, match="--cpus-per-client 2.5: this machine has 2 CPU cores"):
        launch.check_client_resources(2.5, 0)
    with pytest.raises(ConfigError, match="--gpus-per-client 0.5: no CUDA GPU is visible"):
        launch.check_client_resources(1, 0.5)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    launch.check_client_resources(1, 0.5)
    launch.check_client_resources(1, 2)
    with pytest.raises(ConfigError, match="--gpus-per-client 3: this machine has 2 GPU"):
        launch.check_client_resources(1, 3)
    with pytest.raises(ConfigError, match="--gpus-per-client 1.5: Ray takes a fraction below 1 or whole GPUs"):
        launch.check_client_resources(1, 1.5)
    called = []
    monkeypatch.setattr(launch, "pin_run_config", lambda *a, **k: called.append(1))
    with pytest.raises(ConfigError, match="cpus-per-client"):
        launch.run_simulation({"method": "fedavg", "preset": "smoke"}, cpus_per_client=3)
    assert not called  # nothing pinned, no folder made, no Flower process


GREEN, RESET = "\x1b[92m", "\x1b[0m"  # what Flower's console handler puts around a log level


class Terminal:
    def __init__(self):
        self.text = ""

    def isatty(self):
        return True

    def write(self, text):
        self.text += text

    def flush(self):
        pass


def test_colour_codes_are_echoed_to_a_terminal_only_and_never_kept(capsys, monkeypatch):
    chunks = [f"{GREEN}INFO {RESET}:      a\n", f"{GREEN}INFO {RESET}:      b\n"]
    follower = control_with(FakeControlClient([], chunks=chunks)).follow_log(5, echo=True)
    assert follower.text(wait=5) == "".join(chunks)  # the log as Flower sent it
    assert capsys.readouterr().out == "INFO :      a\nINFO :      b\n"  # piped: plain text
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    follower = control_with(FakeControlClient([], chunks=chunks)).follow_log(5, echo=True)
    follower.text(wait=5)
    assert terminal.text == "".join(chunks)  # a terminal keeps Flower's colours


def _fake_run(monkeypatch, chunks, wait):
    """follow_run against stand-ins: `flwr run` submits run 7, the Control API streams `chunks`, and waiting for the
    run's status is `wait` (raise KeyboardInterrupt to be Ctrl-C)."""
    monkeypatch.setattr(launch, "flwr_cli", lambda *a, **k: type("Done", (), {"stdout": '{"run-id": 7}',
                                                                             "stderr": ""})())
    monkeypatch.setattr(launch, "stage_app", lambda app_dir, dest: dest)
    monkeypatch.setattr(launch, "local_control", lambda env, superlink: control_with(FakeControlClient([], chunks)))
    monkeypatch.setattr(launch, "wait_for_status", wait)


def test_an_interrupted_run_folder_keeps_the_log_until_then_and_a_resumed_run_adds_its_own(tmp_path, monkeypatch):
    def interrupt(*args, **kwargs):
        time.sleep(0.5)  # the log stream has been read by then
        raise KeyboardInterrupt

    run_dir = tmp_path / "run"
    (run_dir / "uploads").mkdir(parents=True)  # the run had written its clients' uploads
    _fake_run(monkeypatch, [f"{GREEN}INFO {RESET}: clients done\n"], interrupt)
    with pytest.raises(KeyboardInterrupt):
        launch.follow_run(tmp_path, "seed=1", [], env={"FLWR_HOME": str(tmp_path)}, run_dir=run_dir, stream=False)
    assert (run_dir / "run.log").read_text() == "INFO : clients done\n"

    _fake_run(monkeypatch, ["INFO : distillation resumed\n"], lambda *a, **k: ("finished:completed", ""))
    run = launch.follow_run(tmp_path, "seed=1", [], env={"FLWR_HOME": str(tmp_path)}, run_dir=run_dir, stream=False)
    assert run.ok
    assert (run_dir / "run.log").read_text() == ("INFO : clients done\n" + launch.RESUMED_MARK
                                                 + "INFO : distillation resumed\n")


def test_an_interrupted_run_that_wrote_nothing_gets_no_log(tmp_path, monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "launch.json").write_text("{}")  # only the launch's bookkeeping: the folder goes as it lets go
    _fake_run(monkeypatch, ["INFO : starting\n"], interrupt)
    with pytest.raises(KeyboardInterrupt):
        launch.follow_run(tmp_path, "seed=1", [], env={"FLWR_HOME": str(tmp_path)}, run_dir=run_dir, stream=False)
    assert sorted(p.name for p in run_dir.iterdir()) == ["launch.json"]
