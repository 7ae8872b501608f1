"""End-to-end: plain `flwr run . --run-config "..."`, as docs/running.md tells a new user, without the
oneshot-fl launcher.

The environment is the docs' own: the `export` lines of its plain `flwr run .` block (read from
docs/running.md, so the test and the text cannot drift apart) on top of an environment without the launcher's
settings (`launcher.launch.QUIET_ENV`), with the venv's bin folder first on PATH (`source
.venv/bin/activate`). Only a private FLWR_HOME and free ports are added, so no other SuperLink is touched.

Flower 1.41's local simulation starts 2 SuperNodes; the app needs one per client. A 5-client run on
the default simulation must fail in seconds with the fix in its message (not wait 600 s for nodes
that never come); after the Flower-way fix, `flwr federation simulation-config --num-supernodes 5`
(stored by the local SuperLink), the same plain command completes, without any runtime dependency
installation (no `uv sync` in its log, no runtime environment, the SuperExec runs the venv's Python
without `--allow-runtime-dependency-installation`), and no file it writes holds the `--token` Flower gave
its simulation process: its provenance records the run config it was given, as a `flwr run` command. Then
`oneshot-fl stop-superlink` stops exactly that SuperLink, by PID (not a process that merely mentions its
FLWR_HOME, which a `pkill -f` pattern would also end), and every process it started.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from oneshot_fl.config import parse_overrides
from launcher.launch import (QUIET_ENV, find_superlinks, flwr_cli, free_port, kill_tree, process_tree,
                               wait_for_status)
from oneshot_fl.run_folder import LAUNCH_RECORD
from tests.conftest import ROOT, TokenWatch, files_containing

pytestmark = pytest.mark.e2e

SECTION = "## Plain `flwr run`"
# what Flower's runtime dependency installation logs (flwr/supercore/superexec/dependency_installer.py)
INSTALL_MARKERS = ("Installing application dependencies", "uv sync", "Created env for run",
                   "App dependencies installed", "runtime-envs")


def readme_block() -> list[str]:
    """The commands of docs/running.md's plain `flwr run .` block, comments dropped."""
    text = (ROOT / "docs" / "running.md").read_text()
    block = text[text.index(SECTION):].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line.split("  #", 1)[0].strip() for line in block.splitlines() if line.strip()]


def readme_env(home: Path) -> dict[str, str]:
    lines = readme_block()
    assert "source .venv/bin/activate" in lines
    exports = dict(line.removeprefix("export ").split("=", 1) for line in lines if line.startswith("export "))
    assert exports.get("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION") == "1", lines
    venv_bin = Path(sys.executable).parent
    user = {key: value for key, value in os.environ.items() if key not in QUIET_ENV and key != "VIRTUAL_ENV"}
    return {**user,
            # a test's hygiene (no calls home, no hub), none of them about dependency installation
            "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1", "RAY_USAGE_STATS_ENABLED": "0",
            "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
            **exports,
            # source .venv/bin/activate
            "VIRTUAL_ENV": str(venv_bin.parent), "PATH": str(venv_bin) + os.pathsep + os.environ.get("PATH", ""),
            # isolation from any other SuperLink on this machine
            "FLWR_HOME": str(home), "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
            "FLWR_LOCAL_CONTROL_API_PORT": str(free_port())}


def live_cmdlines(pids) -> dict[int, list[str]]:
    """pid -> command line of those of `pids` still running (a zombie has ended)."""
    found = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            if proc.status() != psutil.STATUS_ZOMBIE:
                found[pid] = proc.cmdline()
        except psutil.Error:
            pass
    return found


def submit(run_config: str, env: dict) -> int:
    done = flwr_cli("run", ".", "--format", "json", "--run-config", run_config, env=env, cwd=ROOT, timeout=300)
    try:
        return int(json.loads(done.stdout)["run-id"])
    except (ValueError, KeyError, TypeError):
        pytest.fail(f"flwr run did not start a run:\n{done.stdout}\n{done.stderr}")


def test_plain_flwr_run_fails_fast_on_too_few_supernodes_then_completes(mnist_dir, tmp_path):
    home = tmp_path / "flwr-home"
    env = readme_env(home)
    out = tmp_path / "runs"
    base = f"preset='smoke' method='fedavg' dataset='mnist' output-dir='{out}' data-dir='{mnist_dir}'"
    decoy = None
    try:
        # 1. Flower's default local simulation (2 SuperNodes), the app's default num-clients=5
        start = time.monotonic()
        run_id = submit(base + " run-name='too-few'", env)
        status, details = wait_for_status(run_id, env=env, cwd=ROOT, timeout=300)
        seconds = time.monotonic() - start
        log = flwr_cli("log", str(run_id), "--show", env=env, cwd=ROOT).stdout
        assert status == "finished:failed", (status, details, log[-3000:])
        assert 'num-supernodes=5' in details + log, (details, log[-3000:])
        print(f"wrong-size simulation failed after {seconds:.0f}s")
        assert seconds < 240, f"a wrong-size simulation took {seconds:.0f}s to fail"
        assert not (out / "too-few" / "result.json").exists()

        # 2. the Flower way to size the local simulation, once
        done = flwr_cli("federation", "simulation-config", "--num-supernodes", "5", env=env, cwd=ROOT)
        assert done.returncode == 0, done.stdout + done.stderr

        # 3. the same plain command now completes
        start = time.monotonic()
        with TokenWatch(lambda: find_superlinks(home)) as watch:
            run_id = submit(base + " run-name='plain'", env)
            status, details = wait_for_status(run_id, env=env, cwd=ROOT, timeout=600,
                                              marker=out / "plain" / "result.json")
        print(f"plain run completed after {time.monotonic() - start:.0f}s")
        log = flwr_cli("log", str(run_id), "--show", env=env, cwd=ROOT).stdout
        assert status == "finished:completed", (status, details, log[-3000:])
        result = json.loads((out / "plain" / "result.json").read_text())
        assert result["method"] == "fedavg" and len(result["clients"]) == 5 and result["rejected"] == []
        assert result["global"]["accuracy"] > 0.3
        assert result["provenance"]["versions"]["flwr"] == "1.41.0"

        # ... recorded the user's run config, not Flower's command line, and no file it wrote holds the token
        assert watch.tokens, "no --token seen on Flower's simulation process"
        for token in watch.tokens:
            assert files_containing(out, token) == [], token
        command = result["provenance"]["command"]
        assert command.startswith("flwr run . --run-config ") and "--token" not in command, command
        assert parse_overrides([shlex.split(command)[4]]) == {
            "preset": "smoke", "method": "fedavg", "output-dir": str(out), "data-dir": str(mnist_dir),
            "run-name": "plain"}
        assert result["provenance"]["command_source"].startswith("run config")
        # the ServerApp held the folder (no launcher) and let go of it; the config it ran is recorded
        assert (out / "plain" / LAUNCH_RECORD).is_file() and not (out / "plain" / "run.lock").exists()

        # ... and installed nothing at run time: the app ran in the venv flwr runs from
        superlink_log = home / "local-superlink" / "superlink.log"
        logs = log + (superlink_log.read_text() if superlink_log.is_file() else "")
        for marker in INSTALL_MARKERS:
            assert marker not in logs, f"{marker!r} in the run / SuperLink log: dependencies were installed"
        assert not (home / "runtime-envs").exists(), "a runtime environment was made"
        superlinks = find_superlinks(home)
        assert len(superlinks) == 1, superlinks
        cmdlines = live_cmdlines(process_tree(superlinks[0]))
        superexecs = [cmd for cmd in cmdlines.values() if any(arg.endswith("flower-superexec") for arg in cmd)]
        assert superexecs, cmdlines
        for cmd in cmdlines.values():
            assert "--allow-runtime-dependency-installation" not in cmd, cmd
        for cmd in [cmdlines[superlinks[0]], *superexecs]:
            assert Path(cmd[0]).parent == Path(sys.executable).parent, cmd  # the venv's Python

        # 4. oneshot-fl stop-superlink stops exactly it, by PID, and what it started; a process that only
        # mentions its FLWR_HOME (here one named after its log, as `tail -f` of it would be) is left alone
        decoy = subprocess.Popen(["bash", "-c", f'exec -a "{home}/local-superlink/superlink.log" sleep 300'])
        done = subprocess.run([str(Path(sys.executable).parent / "oneshot-fl"), "stop-superlink"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert done.stdout.strip() == (f"stopped the local SuperLink of FLWR_HOME={home.resolve()} "
                                       f"(pid {superlinks[0]}) and the processes it started")
        deadline = time.monotonic() + 60
        while live_cmdlines(cmdlines) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not live_cmdlines(cmdlines), live_cmdlines(cmdlines)
        assert decoy.poll() is None, "a process that only mentions the FLWR_HOME was stopped"
        done = subprocess.run([str(Path(sys.executable).parent / "oneshot-fl"), "stop-superlink"], env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.stdout.strip() == f"no local SuperLink of FLWR_HOME={home.resolve()} is running"
    finally:
        for pid in find_superlinks(home):
            kill_tree(pid)
        if decoy is not None:
            decoy.kill()
    assert not find_superlinks(home), "the SuperLink this test started must be gone"
