"""The launcher's status wait: growing intervals between `flwr ls`, an immediate ask when the run's
result marker changes, and a stop past the timeout; all without starting Flower."""

import json
import subprocess
from pathlib import Path

import launcher.launch as launch


class FakeFlower:
    """Stands in for the `flwr` CLI: answers `ls` with a status, records every call and the clock."""

    def __init__(self, clock, statuses):
        self.clock, self.statuses, self.calls = clock, list(statuses), []

    def __call__(self, *args, env, cwd, timeout=120):
        self.calls.append((args[0], self.clock.now))
        status = self.statuses.pop(0) if args[0] == "ls" and self.statuses else "running"
        details = "done" if status.startswith("finished") else ""
        body = {"runs": [{"run-id": 1, "status": status, "status-details": details}]}
        return subprocess.CompletedProcess(args, 0, stdout=json.dumps(body), stderr="")


class Clock:
    def __init__(self):
        self.now = 0.0

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


def _patch(monkeypatch, statuses):
    clock = Clock()
    fake = FakeFlower(clock, statuses)
    monkeypatch.setattr(launch, "flwr_cli", fake)
    monkeypatch.setattr(launch.time, "monotonic", clock.monotonic)
    monkeypatch.setattr(launch.time, "sleep", clock.sleep)
    return clock, fake


def test_status_asks_back_off_from_poll_doubling_to_max_poll(monkeypatch):
    clock, fake = _patch(monkeypatch, ["running"] * 6 + ["finished:completed"])
    status, details = launch.wait_for_status(1, env={}, cwd=Path("."), poll=2.0, max_poll=8.0)
    assert (status, details) == ("finished:completed", "done")
    times = [t for name, t in fake.calls if name == "ls"]
    gaps = [round(b - a, 1) for a, b in zip(times, times[1:])]
    # asked at once, then after 2, 4, 8, 8, 8, 8 s (each gap within one 0.5 s sleep of the interval)
    assert times[0] == 0.0 and len(times) == 7
    assert [round(g) for g in gaps] == [2, 4, 8, 8, 8, 8]


def test_a_changed_result_marker_asks_at_once_and_restarts_the_interval(monkeypatch, tmp_path):
    clock, fake = _patch(monkeypatch, ["running", "running", "running", "finished:completed"])
    marker = tmp_path / "result.json"
    real_sleep = clock.sleep

    def sleep(seconds):  # the ServerApp writes result.json at t = 5 s
        real_sleep(seconds)
        if clock.now >= 5.0 and not marker.exists():
            marker.write_text("{}")
    monkeypatch.setattr(launch.time, "sleep", sleep)
    status, _ = launch.wait_for_status(1, env={}, cwd=Path("."), poll=2.0, max_poll=60.0, marker=marker)
    times = [t for name, t in fake.calls if name == "ls"]
    assert status == "finished:completed"
    # 0, 2 (then the interval is 4: next ask due at 6), the marker appears at 5 -> asked at once at ~5
    assert times[:2] == [0.0, 2.0] and 5.0 <= times[2] < 5.6
    assert round(times[3] - times[2]) == 2  # and the interval started again from poll (2 s), not 8


def test_past_the_timeout_the_run_is_stopped(monkeypatch):
    clock, fake = _patch(monkeypatch, ["running"] * 100)
    status, details = launch.wait_for_status(1, env={}, cwd=Path("."), timeout=30.0, poll=2.0, max_poll=4.0)
    assert status == "finished:stopped" and "timeout after 30s" in details
    assert fake.calls[-1][0] == "stop" and 30.0 < fake.calls[-1][1] <= 31.0
