"""End-to-end: Ctrl-C during FedHydra's distillation, then the same `oneshot-fl run` command again, resumes and
costs only what is left.

A terminal's Ctrl-C is SIGINT to the launcher's whole process group (the local SuperLink `flwr run` starts is
in a session of its own, so only the launcher hears it). The launcher must stop the SuperLink and simulation
it started, exit 130, name the unfinished run folder with the two ways on, and keep what the run logged until
then as the folder's run.log. The same command again (no run-name: the default name carries a time stamp) must
find that folder, serve the uploads the interrupted launch archived without training a client, load the saved
stratification instead of running MS again, resume distillation from the checkpoint's epoch (the log says all
three), add its log after the first one's, and end with the global model and accuracy an uninterrupted run of
the same config ends with, bit for bit. The uninterrupted reference runs beside the interrupted one, to keep the
test short.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from launcher.launch import RESUMED_MARK, cmdline, kill_tree
from oneshot_fl.results import load_model
from tests.conftest import processes_mentioning, superlinks_under

pytestmark = pytest.mark.e2e

# enough epochs that the run cannot finish in the seconds its ServerApp takes to stop after the SIGINT lands
EPOCHS = 12
# the smoke preset, two clients, a cheap distillation epoch (checkpointed every epoch: eval-every is 1)
CONFIG = (f"method='fedhydra' preset='smoke' num-clients=2 distill.epochs={EPOCHS} distill.generator-steps=3 "
          "distill.kd-steps=4 eval.test-samples=200 fedhydra.ms-steps=5")
REUSED = "resuming: the 2 uploads archived by the interrupted run are reused; no client trains again"
EXE = str(Path(sys.executable).parent / "oneshot-fl")


def launch(args: list[str], env: dict, log: Path, new_group: bool = False) -> subprocess.Popen:
    return subprocess.Popen([EXE, "run", *args], env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=new_group)


def wait_for_checkpoint(runs: Path, proc: subprocess.Popen, log: Path, min_epoch: int, timeout: float) -> Path:
    """The default-named run folder, once its distillation checkpoint is past `min_epoch`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the launcher ended before distillation:\n" + log.read_text()[-3000:]
        for path in runs.glob("fedhydra-mnist-*/checkpoints/distill.pt"):
            try:
                epoch = torch.load(path, map_location="cpu", weights_only=True)["epoch"]
            except Exception:  # noqa: BLE001 - replaced while read: ask again
                continue
            if epoch >= min_epoch:
                return path.parents[1]
        time.sleep(0.5)
    pytest.fail(f"no checkpoint past epoch {min_epoch} within {timeout:.0f}s:\n" + log.read_text()[-3000:])


def test_ctrl_c_during_distillation_then_the_same_command_resumes_to_the_uninterrupted_model(mnist_dir, tmp_path):
    runs = tmp_path / "runs"
    # each launcher's private FLWR_HOME is made under its TMPDIR (found by this); Ray's sockets go there too,
    # and a socket path longer than 107 bytes (pytest's tmp_path is long) fails Ray: a short folder in /tmp
    short = Path(tempfile.mkdtemp(prefix="oneshot-ir-", dir="/tmp"))
    homes = {name: short / name[:3] for name in ("reference", "interrupted", "resumed")}
    for home in homes.values():
        home.mkdir()
    env = {name: {**os.environ, "TMPDIR": str(home), "ONESHOT_FL_OUTPUT_DIR": str(runs)}
           for name, home in homes.items()}
    logs = {name: tmp_path / f"{name}.log" for name in homes}
    procs: list[subprocess.Popen] = []
    try:
        start = time.monotonic()
        reference = launch(["-c", CONFIG + " run-name='reference'"], env["reference"], logs["reference"])
        procs.append(reference)
        # a terminal runs the command in a process group of its own and sends Ctrl-C's SIGINT to all of it
        first = launch(["-c", CONFIG], env["interrupted"], logs["interrupted"], new_group=True)
        procs.append(first)
        run_dir = wait_for_checkpoint(runs, first, logs["interrupted"], min_epoch=2, timeout=600)
        sent = time.monotonic()
        superlinks = superlinks_under(homes["interrupted"])
        assert superlinks, "the interrupted launcher's SuperLink must be up"
        os.killpg(first.pid, signal.SIGINT)
        assert first.wait(timeout=120) == 130, logs["interrupted"].read_text()[-3000:]
        stop_s = time.monotonic() - sent
        output = logs["interrupted"].read_text()
        assert f"[oneshot-fl] the unfinished run is in {run_dir}" in output, output[-3000:]
        assert "run the same command again to resume it" in output
        assert "the clients' archived uploads are reused, no client trains again" in output
        assert f"oneshot-fl replay {run_dir / 'uploads'}" in output  # the clients had finished: their uploads
        assert "oneshot-fl: interrupted" in output
        assert stop_s < 40, f"Ctrl-C took {stop_s:.0f}s to end the launcher"
        assert not [pid for pid in superlinks if cmdline(pid)], "the SuperLink must be stopped"
        assert processes_mentioning(str(homes["interrupted"])) == [], "nothing started for the run may be left"
        assert not (run_dir / "result.json").exists()
        # what the run logged until the interrupt is kept beside what it wrote
        interrupted_log = (run_dir / "run.log").read_text()
        assert "2 valid uploads (0 rejected, 0 missing); running fedhydra" in interrupted_log, interrupted_log[-3000:]
        # the clients trained in this launch (their log lines reach the run's log), and MS ran
        assert "client p0: " in interrupted_log and "sending the round-1 training instruction" in interrupted_log
        assert "stratification done in" in interrupted_log
        stopped_at = torch.load(run_dir / "checkpoints" / "distill.pt", weights_only=True)["epoch"]
        assert 2 <= stopped_at < EPOCHS
        archived = {path.name: (path.read_bytes(), path.stat().st_mtime_ns)
                    for path in sorted((run_dir / "uploads").iterdir())}

        again_at = time.monotonic()
        again = launch(["-c", CONFIG], env["resumed"], logs["resumed"])  # the same command again
        procs.append(again)
        assert again.wait(timeout=600) == 0, logs["resumed"].read_text()[-3000:]
        again_s = time.monotonic() - again_at
        assert reference.wait(timeout=600) == 0, logs["reference"].read_text()[-3000:]
        print(f"interrupted at checkpoint epoch {stopped_at}; stopped {stop_s:.1f}s after SIGINT; "
              f"all three runs took {time.monotonic() - start:.0f}s")
        output = logs["resumed"].read_text()
        assert f"continuing the unfinished run of this command in {run_dir}" in output, output[-3000:]
        assert REUSED in output, output[-3000:]
        saved = run_dir / "checkpoints" / "stratification.pt"
        assert f"fedhydra: stratification reused from {saved} (saved by the interrupted run)" in output, output[-3000:]
        checkpoint = run_dir / "checkpoints" / "distill.pt"
        assert f"fedhydra: resuming distillation from epoch {stopped_at} of {checkpoint}" in output, output[-3000:]
        assert f"results in {run_dir}" in output
        log = (run_dir / "run.log").read_text()  # the interrupted launch's log, then the resumed one's
        assert log.startswith(interrupted_log + RESUMED_MARK), log[:3000]
        second = log[len(interrupted_log):]
        assert REUSED in second and f"resuming distillation from epoch {stopped_at}" in second
        # no client trained, no instruction went out, MS did not run, and the archive was left as it was
        for absent in ("client p0: ", "client p1: ", "sending the round-1 training instruction", "stratification: "):
            assert absent not in second, f"{absent!r} in the resumed launch's log"
        assert {path.name: (path.read_bytes(), path.stat().st_mtime_ns)
                for path in sorted((run_dir / "uploads").iterdir())} == archived
        assert sorted(p.name for p in runs.iterdir()) == sorted(["reference", run_dir.name])  # no third folder

        resumed = json.loads((run_dir / "result.json").read_text())
        uninterrupted = json.loads((runs / "reference" / "result.json").read_text())
        phases = ("local_sum", "wait_for_uploads", "stratification", "distillation", "server_fuse")
        print(f"the resumed launch took {again_s:.0f}s; phases (s) of the uninterrupted run "
              f"{ {k: round(uninterrupted['timings'].get(k, 0.0), 1) for k in phases} }, of the resumed one "
              f"{ {k: round(resumed['timings'].get(k, 0.0), 1) for k in phases} }")
        assert resumed["global"]["resumed_from_epoch"] == stopped_at > 0
        assert uninterrupted["global"]["resumed_from_epoch"] == 0
        assert [h["epoch"] for h in resumed["history"]] == list(range(1, EPOCHS + 1))
        assert resumed["global"]["accuracy"] == uninterrupted["global"]["accuracy"]
        same = ("partition_id", "arch", "num_examples", "label_counts", "local_accuracy")  # not node ids, timings
        assert [{k: c[k] for k in same} for c in resumed["clients"]] == \
            [{k: c[k] for k in same} for c in uninterrupted["clients"]]
        strata = [json.loads((folder / "stratification.json").read_text()) for folder in (run_dir, runs / "reference")]
        assert strata[0]["used_u_r"] == strata[1]["used_u_r"] and strata[0]["used_u_c"] == strata[1]["used_u_c"]
        model_a, _ = load_model(runs / "reference" / "global_model.pt")
        model_b, _ = load_model(run_dir / "global_model.pt")
        state_a, state_b = model_a.state_dict(), model_b.state_dict()
        assert list(state_a) == list(state_b)
        for key in state_a:
            assert torch.equal(state_a[key], state_b[key]), f"{key} differs from the uninterrupted run's"
    finally:
        for proc in procs:
            if proc.poll() is None:
                kill_tree(proc.pid)
        for home in homes.values():
            for pid in superlinks_under(home):
                kill_tree(pid)
        shutil.rmtree(short, ignore_errors=True)
