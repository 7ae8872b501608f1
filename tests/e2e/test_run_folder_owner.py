"""End-to-end: two `oneshot-fl run` launchers on one explicit run-name. The second stops in one line before
anything starts, while the first runs and once it has finished; the first run ends as if alone, and its folder is
byte for byte what it wrote (a finished folder is never overwritten, a running one never shared).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from launcher.launch import kill_tree
from oneshot_fl.run_folder import LAUNCH_RECORD, LOCK_FILE, read_holder
from tests.conftest import superlinks_under

pytestmark = pytest.mark.e2e

EXE = str(Path(sys.executable).parent / "oneshot-fl")
FIRST = "method='fedavg' preset='smoke' run-name='dup'"
SECOND = FIRST + " seed=1"  # another run: what it would write is not the first's


def snapshot(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


def second_launch(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([EXE, "run", "-c", SECOND], env=env, capture_output=True, text=True, timeout=300)


def test_a_second_launcher_on_a_running_or_finished_run_name_is_refused_and_the_first_run_is_intact(mnist_dir,
                                                                                                   tmp_path):
    runs = tmp_path / "runs"
    folder = runs / "dup"
    # each launcher's FLWR_HOME goes under TMPDIR, and Ray's socket paths with it: a short folder (see
    # test_interrupt_resume)
    short = Path(tempfile.mkdtemp(prefix="oneshot-of-", dir="/tmp"))
    env = {**os.environ, "TMPDIR": str(short), "ONESHOT_FL_OUTPUT_DIR": str(runs)}
    log = tmp_path / "first.log"
    first = subprocess.Popen([EXE, "run", "-c", FIRST], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while not read_holder(folder).get("run_id"):  # the first run is submitted: its ServerApp is on its way
            assert first.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        before = snapshot(folder)
        assert sorted(before) == [LAUNCH_RECORD, LOCK_FILE]

        refused = second_launch(env)  # while the first runs
        assert refused.returncode == 1 and refused.stdout == "", refused.stdout + refused.stderr
        line = refused.stderr.strip()
        assert "\n" not in line and line.startswith(f"oneshot-fl: error: run folder {folder} is in use by `")
        assert f"(pid {first.pid} on " in line and line.endswith("choose another run-name, or wait until that run ends")
        after = snapshot(folder)
        assert {name: after.get(name) for name in before} == before  # the first's record and lock, unchanged

        assert first.wait(timeout=900) == 0, log.read_text()[-3000:]
        result = json.loads((folder / "result.json").read_text())
        assert result["seed"] == 0 and result["config"]["run-name"] == "dup"
        assert result["provenance"]["command_source"] == "launcher"
        assert result["provenance"]["command"].endswith(f'run -c "{FIRST}"')  # the first launcher's own command
        assert not (folder / LOCK_FILE).exists()
        finished = snapshot(folder)

        refused = second_launch(env)  # once the first has finished
        assert refused.returncode == 1 and refused.stdout == ""
        assert refused.stderr.strip() == (f"oneshot-fl: error: run folder {folder} already holds a finished run "
                                          "(result.json); choose another run-name / output folder, or delete that "
                                          "folder to run it again")
        assert snapshot(folder) == finished  # byte for byte
        assert sorted(p.name for p in runs.iterdir()) == ["dup"]  # the refused launches made no folder
    finally:
        if first.poll() is None:
            kill_tree(first.pid)
        for pid in superlinks_under(short):
            kill_tree(pid)
        shutil.rmtree(short, ignore_errors=True)
