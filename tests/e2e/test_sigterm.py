"""End-to-end: `kill <pid>` (SIGTERM) of a running `oneshot-fl run` stops the SuperLink and the simulation
it started. Python's default for SIGTERM skips every `finally`; the local SuperLink that `flwr run` starts
is detached from the launcher, so without the handler it would run on, orphaned, with Ray beneath it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from launcher.launch import cmdline, kill_tree
from tests.conftest import processes_mentioning, superlinks_under

pytestmark = pytest.mark.e2e


def test_sigterm_stops_the_superlink_and_simulation_the_launcher_started(mnist_dir, tmp_path):
    home_root = tmp_path / "tmp"  # the launcher's private FLWR_HOME is made under TMPDIR: find it by this
    home_root.mkdir()
    env = {**os.environ, "TMPDIR": str(home_root), "ONESHOT_FL_OUTPUT_DIR": str(tmp_path / "runs")}
    exe = Path(sys.executable).parent / "oneshot-fl"
    proc = subprocess.Popen([str(exe), "run", "-c", "method='fedavg' preset='smoke' num-clients=2"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(300, proc.kill)  # never hang the suite on a launcher that does not submit
    watchdog.start()
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if "submitted; run folder" in line:
                break
        superlinks = superlinks_under(home_root)
        assert superlinks, "the run was submitted, so its SuperLink must be up:\n" + "".join(lines)
        time.sleep(3)  # into the simulation: Ray and the ClientApps are starting
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
        output = "".join(lines) + rest
        assert proc.returncode == 143, output[-3000:]
        assert "oneshot-fl: terminated (SIGTERM)" in output
        assert not [pid for pid in superlinks if cmdline(pid)], "the SuperLink must be stopped"
        assert processes_mentioning(str(home_root)) == [], "nothing started for the run may be left"
        assert list(home_root.iterdir()) == [], "the private FLWR_HOME is removed"
    finally:
        watchdog.cancel()
        for pid in superlinks_under(home_root):
            kill_tree(pid)
        if proc.poll() is None:
            kill_tree(proc.pid)
