"""The same `oneshot-fl run` command again finds the run folder it left unfinished (run_folder.claim_run_folder),
a folder in use or holding another config's unfinished run is refused, an interrupted launcher names that folder
and the ways on, and SIGINT interrupts also a launcher that was started with SIGINT ignored (a background job of
a script)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.cli import main
from oneshot_fl.errors import RunFolderTaken
from launcher.launch import check_run_config, pin_run_config
from oneshot_fl.run_folder import (LAUNCH_RECORD, LOCK_FILE, check_run_dir_free, claim_run_folder,
                                   interrupted_message, read_holder, release_run_folder)

ROOT = Path(__file__).resolve().parents[2]


def _cfg(tmp_path, **extra):
    return check_run_config({"method": "fedavg", "preset": "smoke", "output-dir": str(tmp_path), **extra})


def _claim(cfg, resume=True, force=False) -> Path:
    """A launcher's claim of its folder, let go at once (the launcher ended)."""
    _, folder = pin_run_config(cfg, {}, threads=1, resume=resume, force=force)
    release_run_folder(folder)
    return folder


def _leave_unfinished(folder: Path) -> None:
    """What an interrupted launch leaves beside its record: a run file."""
    (folder / "checkpoints").mkdir()
    (folder / "checkpoints" / "distill.pt").write_bytes(b"a checkpoint")


def snapshot(folder: Path) -> dict[str, str]:
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}


class Launcher:
    """A second process that claimed a run folder as `oneshot-fl run` does (pin_run_config) and holds it."""

    CODE = ("import json, sys, time\n"
            "from launcher.launch import check_run_config, pin_run_config\n"
            "cfg = check_run_config(json.loads(sys.argv[1]))\n"
            "print(pin_run_config(cfg, {}, threads=1, resume=True)[1], flush=True)\n"
            "time.sleep(300)\n")

    def __init__(self, overrides: dict):
        self.proc = subprocess.Popen([sys.executable, "-c", self.CODE, json.dumps(overrides), "--launcher-flag"],
                                     stdout=subprocess.PIPE, text=True, cwd=ROOT)
        line = self.proc.stdout.readline().strip()
        assert line, "the second launcher did not claim its folder"
        self.folder = Path(line)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_the_same_command_again_continues_its_unfinished_folder(tmp_path, capsys):
    cfg = _cfg(tmp_path)
    first = _claim(cfg)
    assert first.parent == tmp_path and not first.exists()  # the launch wrote nothing: no folder is left
    _, first = pin_run_config(cfg, {}, threads=1, resume=True)
    assert (first / LAUNCH_RECORD).is_file() and read_holder(first)["pid"] == os.getpid()
    _leave_unfinished(first)
    release_run_folder(first)
    assert not (first / LOCK_FILE).exists()  # let go: the lock file goes with the lock
    time.sleep(1.1)  # a later launch gets a later time stamp
    run_config, again = pin_run_config(cfg, {}, threads=1, resume=True)
    try:
        assert again == first and f"run-name={json.dumps(first.name)}" in run_config
        assert f"continuing the unfinished run of this command in {first}" in capsys.readouterr().err
        assert read_holder(first)["pid"] == os.getpid()  # the folder is this launch's now
    finally:
        release_run_folder(again)
    assert (first / "checkpoints" / "distill.pt").read_bytes() == b"a checkpoint"


@pytest.mark.parametrize("change", ["finished", "other config", "named run", "no resume", "force"])
def test_a_folder_is_not_continued_when(change, tmp_path):
    cfg = _cfg(tmp_path)
    _, first = pin_run_config(cfg, {}, threads=1, resume=True)
    _leave_unfinished(first)
    release_run_folder(first)
    if change == "finished":
        (first / "result.json").write_text("{}")
    if change == "other config":
        cfg = _cfg(tmp_path, **{"distill.epochs": 7})
    elif change == "named run":
        cfg = _cfg(tmp_path, **{"run-name": "mine"})
    time.sleep(1.1)
    again = _claim(cfg, resume=change != "no resume", force=change == "force")
    assert again != first
    assert (first / "checkpoints" / "distill.pt").is_file()  # left as it was


def test_a_folder_a_running_launcher_holds_is_not_continued_and_its_lock_dies_with_it(tmp_path):
    overrides = {"method": "fedavg", "preset": "smoke", "output-dir": str(tmp_path)}
    cfg = _cfg(tmp_path)
    holder = Launcher(overrides)
    try:
        _leave_unfinished(holder.folder)
        time.sleep(1.1)
        again = _claim(cfg)
        assert again != holder.folder  # running: a new folder, the running one untouched
        holder.kill()  # SIGKILL: no cleanup ran, the kernel dropped the lock
        time.sleep(1.1)
        _, third = pin_run_config(cfg, {}, threads=1, resume=True)
        release_run_folder(third)
        assert third == holder.folder
    finally:
        holder.kill()


def test_two_launchers_on_one_run_name_the_second_is_refused_in_one_line_and_changes_nothing(tmp_path, capsys,
                                                                                            monkeypatch):
    import launcher.launch as launch

    holder = Launcher({"method": "fedavg", "preset": "smoke", "output-dir": str(tmp_path), "run-name": "dup"})
    try:
        folder = tmp_path / "dup"
        _leave_unfinished(folder)  # the first run has written something
        before = snapshot(folder)
        monkeypatch.setattr(launch, "follow_run", lambda *a, **k: pytest.fail("a second run was submitted"))
        code = main(["run", "-c", f"method='fedavg' preset='smoke' seed=1 run-name='dup' output-dir='{tmp_path}'"])
        err = capsys.readouterr().err.strip()
        assert code == 1 and err.count("\n") == 0, err
        assert err.startswith(f"oneshot-fl: error: run folder {folder} is in use by `")
        assert "--launcher-flag" in err and f"pid {holder.proc.pid} on " in err  # the holder's command and process
        assert err.endswith("; choose another run-name, or wait until that run ends")
        assert snapshot(folder) == before  # byte for byte, the lock file's record included
        with pytest.raises(RunFolderTaken, match="is in use by"):  # --force does not take a running folder
            pin_run_config(_cfg(tmp_path, **{"run-name": "dup", "seed": 1}), {}, threads=1, force=True)
        assert snapshot(folder) == before
    finally:
        holder.kill()


def test_another_config_on_an_unfinished_folder_is_refused_naming_the_difference_and_force_starts_over(tmp_path,
                                                                                                     capsys):
    dense = _cfg(tmp_path, method="dense", **{"run-name": "mix"})
    folder = _claim(dense)
    _, folder = pin_run_config(dense, {}, threads=1)
    _leave_unfinished(folder)
    (folder / "uploads").mkdir()
    release_run_folder(folder)
    before = snapshot(folder)
    fedavg = {"run-name": "mix", "output-dir": str(tmp_path), "preset": "smoke"}
    args = ["run", "-c", f"method='fedavg' run-name='mix' preset='smoke' output-dir='{tmp_path}'"]
    assert main(args) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"oneshot-fl: error: run folder {folder} holds an unfinished run of another config (method: "
                   "'dense' in the folder, 'fedavg' now); choose another run-name, or add --force to start it over "
                   "(the unfinished run's files there, its checkpoint among them, are removed first)")
    assert snapshot(folder) == before and not (folder / LOCK_FILE).exists()
    # the same config continues it; --force starts it over, the old checkpoint gone before anything runs
    _claim(dense)
    assert snapshot(folder)["checkpoints/distill.pt"] == before["checkpoints/distill.pt"]
    _, again = pin_run_config(check_run_config({"method": "fedavg", **fedavg}), {}, threads=1, force=True)
    try:
        assert again == folder
        assert sorted(p.name for p in folder.iterdir()) == [LAUNCH_RECORD, LOCK_FILE]  # the old run's files gone
        assert json.loads((folder / LAUNCH_RECORD).read_text())["identity"]["method"] == "fedavg"
        assert "--force: starting " in capsys.readouterr().err
    finally:
        release_run_folder(again)


def test_differences_are_named_method_first_and_counted(tmp_path):
    from oneshot_fl.run_folder import config_difference

    assert config_difference({"method": "dense", "alpha": 0.5, "seed": 0, "download": True},
                             {"method": "fedavg", "alpha": 0.1, "seed": 1, "download": False, "x": 1}, shown=3) == \
        ("method: 'dense' in the folder, 'fedavg' now; alpha: 0.5 in the folder, 0.1 now; download: true in the "
         "folder, false now; 2 more")


def test_an_unfinished_folder_without_a_record_of_its_config_is_refused(tmp_path):
    folder = tmp_path / "old"
    folder.mkdir()
    (folder / "checkpoints").mkdir()
    with pytest.raises(RunFolderTaken, match="holds an unfinished run whose config is not recorded"):
        pin_run_config(_cfg(tmp_path, **{"run-name": "old"}), {}, threads=1)
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoints"]


def test_two_launches_in_one_second_get_two_folders(tmp_path):
    cfg = _cfg(tmp_path)
    name = "fedavg-mnist-dirichlet0.5-k5-s0-20250101-000000"
    assert claim_run_folder(cfg, tmp_path, name, {}) == name
    assert claim_run_folder(cfg, tmp_path, name, {}) == name + "-2"  # the first one is held (by this process)
    for folder in (name, name + "-2"):
        release_run_folder(tmp_path / folder)


def test_a_folder_with_only_its_record_is_removed_and_the_record_is_a_run_file(tmp_path):
    cfg = _cfg(tmp_path)
    name = claim_run_folder(cfg, tmp_path, "x-20250101-000000", {})
    check_run_dir_free(tmp_path / name)  # the ServerApp accepts a folder holding the launch record and lock
    release_run_folder(tmp_path / name)
    assert not (tmp_path / name).exists()
    name = claim_run_folder(cfg, tmp_path, "y-20250101-000000", {})
    (tmp_path / name / "uploads").mkdir()
    release_run_folder(tmp_path / name)
    assert sorted(p.name for p in (tmp_path / name).iterdir()) == [LAUNCH_RECORD, "uploads"]


def test_the_interrupted_message_names_the_folder_and_the_ways_on(tmp_path):
    run_dir = tmp_path / "run"
    assert "written nothing yet" in interrupted_message(run_dir)
    (run_dir / "checkpoints").mkdir(parents=True)
    text = interrupted_message(run_dir)
    assert f"the unfinished run is in {run_dir}" in text and "run the same command again to resume" in text
    assert "no client uploads were saved yet" in text
    (run_dir / "uploads").mkdir()
    (run_dir / "uploads" / "manifest.json").write_text("{}")
    assert f"oneshot-fl replay {run_dir / 'uploads'}" in interrupted_message(run_dir)


def test_sigint_to_the_pid_interrupts_also_when_started_with_sigint_ignored():
    # `cmd &` in a script starts cmd with SIGINT ignored; Python then installs no KeyboardInterrupt handler
    code = ("import sys, time\n"
            "from launcher.shutdown import sigterm_unwinds\n"
            "try:\n"
            "    with sigterm_unwinds():\n"
            "        print('ready', flush=True)\n"
            "        time.sleep(60)\n"
            "except KeyboardInterrupt:\n"
            "    sys.exit(130)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2],
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        assert proc.stdout.readline().strip() == "ready"
        start = time.monotonic()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=10) == 130 and time.monotonic() - start < 5
    finally:
        if proc.poll() is None:
            proc.kill()
