"""The run folder's lock (run_folder.RunFolderLock) and the ServerApp's check before it writes (run_folder.serving):
it goes on under the lock of the launcher that submitted its run, takes the lock where no launcher holds it (a
plain `flwr run`), and is refused otherwise; a lock dies with its process."""

from __future__ import annotations

import fcntl
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from oneshot_fl.config import parse_overrides
from oneshot_fl.errors import RunFolderTaken
from launcher.launch import check_run_config
from oneshot_fl.run_folder import (LAUNCH_RECORD, LOCK_FILE, RunFolderLock, launch_identity, read_holder,
                                   record_launch, serving)

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = 4242


class Holder:
    """Another process holding a folder's lock, as a launcher does; it writes `run_id` into the lock file after
    `delay` seconds (a launcher learns its run id once `flwr run` returns)."""

    CODE = ("import sys, time\n"
            "from pathlib import Path\n"
            "from oneshot_fl.run_folder import RunFolderLock, this_process\n"
            "lock = RunFolderLock.take(Path(sys.argv[1]))\n"
            "lock.record(**this_process('oneshot-fl run -c seed=1'))\n"
            "print('held', flush=True)\n"
            "if sys.argv[2] != 'none':\n"
            "    time.sleep(float(sys.argv[3]))\n"
            "    lock.record(run_id=int(sys.argv[2]))\n"
            "time.sleep(300)\n")

    def __init__(self, folder: Path, run_id: int | None, delay: float = 0.0):
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE, str(folder), str(run_id or "none"), str(delay)],
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.proc.stdout.readline().strip() == "held"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _cfg(tmp_path, **extra):
    return check_run_config({"method": "fedavg", "preset": "smoke", "output-dir": str(tmp_path), "run-name": "r",
                             **extra})


def test_a_lock_is_one_process_s_and_dies_with_it(tmp_path):
    folder = tmp_path / "r"
    holder = Holder(folder, None)
    try:
        assert RunFolderLock.take(folder) is None
        assert read_holder(folder)["command"] == "oneshot-fl run -c seed=1"
        assert read_holder(folder)["pid"] == holder.proc.pid
    finally:
        holder.kill()  # SIGKILL: nothing of the holder ran on the way out
    lock = RunFolderLock.take(folder)
    assert lock is not None
    lock.release()
    assert not (folder / LOCK_FILE).exists()


def test_a_lock_file_removed_as_its_holder_let_go_is_not_the_one_taken(tmp_path):
    folder = tmp_path / "r"
    first = RunFolderLock.take(folder)
    stale = os.open(folder / LOCK_FILE, os.O_RDWR)  # a launch that opened the file before the holder let go
    first.release()
    fcntl.flock(stale, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ... and then locked the removed file
    try:
        second = RunFolderLock.take(folder)  # the folder's lock is the file there now: free
        assert second is not None and (folder / LOCK_FILE).exists()
        assert RunFolderLock.take(folder) is None  # and it is held
        second.release()
    finally:
        os.close(stale)


def test_the_serverapp_goes_on_under_its_launchers_lock_and_takes_it_over_if_the_launcher_dies(tmp_path):
    cfg = _cfg(tmp_path)
    folder = tmp_path / "r"
    holder = Holder(folder, RUN_ID, delay=1.5)  # the run id arrives after the ServerApp started waiting
    try:
        start = time.monotonic()
        with serving(cfg, RUN_ID, "flwr run .") as (run_dir, launcher):
            assert run_dir == folder and time.monotonic() - start >= 1.0
            assert launcher["command"] == "oneshot-fl run -c seed=1" and launcher["run_id"] == RUN_ID
            assert not (folder / LAUNCH_RECORD).exists()  # the launcher's checks and record are the launcher's
            holder.kill()  # the launcher is gone while the ServerApp still writes
            deadline = time.monotonic() + 10
            while read_holder(folder).get("pid") != os.getpid() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert read_holder(folder)["pid"] == os.getpid()  # this process holds the folder now
            assert read_holder(folder)["command"] == "oneshot-fl run -c seed=1"
            other = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from "
                                    "oneshot_fl.run_folder import RunFolderLock; "
                                    "print(RunFolderLock.take(Path(sys.argv[1])) is None)", str(folder)],
                                   capture_output=True, text=True, cwd=ROOT)
            assert other.stdout.strip() == "True"  # no other process takes it
        assert not (folder / LOCK_FILE).exists()
    finally:
        holder.kill()


@pytest.mark.parametrize("recorded, wait", [(RUN_ID + 1, 60.0), (None, 1.0)])
def test_a_folder_another_run_holds_is_refused_by_the_serverapp(tmp_path, recorded, wait):
    folder = tmp_path / "r"
    holder = Holder(folder, recorded)
    try:
        (folder / "uploads").mkdir()
        start = time.monotonic()
        with pytest.raises(RunFolderTaken) as err:
            with serving(_cfg(tmp_path), RUN_ID, "flwr run .", wait=wait):
                pytest.fail("the ServerApp went on")
        assert time.monotonic() - start < 10  # another run's id: at once; none: after `wait`
        assert str(err.value) == (f"run folder {folder} is in use by `oneshot-fl run -c seed=1` (pid {holder.proc.pid}"
                                  f" on {read_holder(folder)['host']}, since {read_holder(folder)['since']}); choose "
                                  "another run-name, or wait until that run ends")
        assert sorted(p.name for p in folder.iterdir()) == [LOCK_FILE, "uploads"]
    finally:
        holder.kill()


def test_without_a_launcher_the_serverapp_holds_the_folder_and_records_its_config(tmp_path):
    cfg = _cfg(tmp_path)
    folder = tmp_path / "r"
    with serving(cfg, RUN_ID, "flwr run . --run-config 'seed=1'") as (run_dir, launcher):
        assert run_dir == folder and launcher == {}
        assert read_holder(folder)["pid"] == os.getpid() and read_holder(folder)["run_id"] == RUN_ID
        assert json.loads((folder / LAUNCH_RECORD).read_text())["identity"] == launch_identity(cfg)
        assert RunFolderLock.take(folder) is None  # held
        (folder / "uploads").mkdir()
    assert sorted(p.name for p in folder.iterdir()) == [LAUNCH_RECORD, "uploads"]  # let go; the run's files stay
    with serving(cfg, RUN_ID + 1, "flwr run .") as (run_dir, _):  # the same config again continues it
        assert (run_dir / "uploads").is_dir()
    with pytest.raises(RunFolderTaken) as err:  # another config is refused, its files untouched
        with serving(_cfg(tmp_path, method="dense"), RUN_ID + 2, "flwr run ."):
            pytest.fail("went on")
    assert str(err.value) == (f"run folder {folder} holds an unfinished run of another config (method: 'fedavg' in "
                              "the folder, 'dense' now); choose another run-name, or start it over with `oneshot-fl "
                              "run --force` (or empty that folder)")
    assert sorted(p.name for p in folder.iterdir()) == [LAUNCH_RECORD, "uploads"]


def test_a_serverapp_that_wrote_nothing_leaves_no_folder_and_unnamed_runs_get_their_own(tmp_path):
    cfg = check_run_config({"method": "fedavg", "preset": "smoke", "output-dir": str(tmp_path)})
    with serving(cfg, 1, "flwr run .") as (first, _):
        with serving(cfg, 2, "flwr run .") as (second, _):  # the same second, the same config: another folder
            assert first != second and second.name == first.name + "-2"
    assert list(tmp_path.iterdir()) == []


def test_a_launch_record_is_the_identity_of_its_config(tmp_path):
    cfg = _cfg(tmp_path)
    record_launch(tmp_path, launch_identity(cfg))
    identity = json.loads((tmp_path / LAUNCH_RECORD).read_text())["identity"]
    assert identity["data-dir"] == str(Path(identity["data-dir"]).resolve())  # absolute: "" and a path compare
    assert identity["output-dir"] == str(tmp_path.resolve()) and "run-name" not in identity


def test_a_plain_runs_command_is_its_run_config_against_the_apps_defaults():
    from oneshot_fl.config import default_run_config, merge_overrides
    from server_app.app import plain_run_command

    assert plain_run_command(default_run_config()) == "flwr run ."
    overrides = {"method": "fedavg", "run-name": "it's", "alpha": 0.1}
    command = plain_run_command(merge_overrides(overrides))
    argv = shlex.split(command)
    assert argv[:4] == ["flwr", "run", ".", "--run-config"]
    assert parse_overrides([argv[4]]) == overrides
