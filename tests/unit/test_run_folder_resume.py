"""The same `oneshot-fl run` command again finds the run folder it left unfinished (run_folder.claim_run_folder),
an interrupted launcher names that folder and the ways on, and SIGINT interrupts also a launcher that was
started with SIGINT ignored (a background job of a script)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.launch import check_run_config, pin_run_config
from oneshot_fl.run_folder import (LAUNCH_RECORD, check_run_dir_free, claim_run_folder, interrupted_message,
                                   release_run_folder)


def _cfg(tmp_path, **extra):
    return check_run_config({"method": "fedavg", "preset": "smoke", "output-dir": str(tmp_path), **extra})


def _gone_pid() -> int:
    done = subprocess.Popen(["true"])
    done.wait()
    return done.pid


def _leave_unfinished(folder: Path, pid: int | None = None) -> None:
    """What an interrupted launch leaves: its record (a launcher that is gone) and a run file."""
    record = json.loads((folder / LAUNCH_RECORD).read_text())
    record["pid"] = pid or _gone_pid()
    (folder / LAUNCH_RECORD).write_text(json.dumps(record))
    (folder / "checkpoints").mkdir()


def test_the_same_command_again_continues_its_unfinished_folder(tmp_path, capsys):
    cfg = _cfg(tmp_path)
    _, first = pin_run_config(cfg, {}, threads=1, resume=True)
    assert first.parent == tmp_path and (first / LAUNCH_RECORD).is_file()
    _leave_unfinished(first)
    time.sleep(1.1)  # a later launch gets a later time stamp
    run_config, again = pin_run_config(cfg, {}, threads=1, resume=True)
    assert again == first and f"run-name={json.dumps(first.name)}" in run_config
    assert f"continuing the unfinished run of this command in {first}" in capsys.readouterr().err
    assert json.loads((first / LAUNCH_RECORD).read_text())["pid"] == os.getpid()  # the folder is this launch's now


@pytest.mark.parametrize("change", ["finished", "other config", "launcher running", "other host", "named run",
                                    "no resume"])
def test_a_folder_is_not_continued_when(change, tmp_path):
    cfg = _cfg(tmp_path)
    _, first = pin_run_config(cfg, {}, threads=1, resume=True)
    _leave_unfinished(first, pid=os.getpid() if change == "launcher running" else None)
    if change == "finished":
        (first / "result.json").write_text("{}")
    elif change == "other host":
        record = json.loads((first / LAUNCH_RECORD).read_text())
        (first / LAUNCH_RECORD).write_text(json.dumps({**record, "host": "elsewhere"}))
    if change == "other config":
        cfg = _cfg(tmp_path, **{"distill.epochs": 7})
    elif change == "named run":
        cfg = _cfg(tmp_path, **{"run-name": "mine"})
    time.sleep(1.1)
    _, again = pin_run_config(cfg, {}, threads=1, resume=change != "no resume")
    assert again != first


def test_two_launches_in_one_second_get_two_folders(tmp_path):
    cfg = _cfg(tmp_path)
    name = "fedavg-mnist-dirichlet0.5-k5-s0-20250101-000000"
    assert claim_run_folder(cfg, tmp_path, name, {}) == name
    assert claim_run_folder(cfg, tmp_path, name, {}) == name + "-2"  # the first launcher (this process) is alive


def test_a_folder_with_only_its_record_is_removed_and_the_record_is_a_run_file(tmp_path):
    cfg = _cfg(tmp_path)
    name = claim_run_folder(cfg, tmp_path, "x-20250101-000000", {})
    check_run_dir_free(tmp_path / name)  # the ServerApp accepts a folder holding the launch record
    release_run_folder(tmp_path / name)
    assert not (tmp_path / name).exists()
    name = claim_run_folder(cfg, tmp_path, "y-20250101-000000", {})
    (tmp_path / name / "uploads").mkdir()
    release_run_folder(tmp_path / name)
    assert (tmp_path / name / LAUNCH_RECORD).is_file()


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
