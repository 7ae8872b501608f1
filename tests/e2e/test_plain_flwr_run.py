"""End-to-end: plain `flwr run . --run-config "..."`, as the README tells a new user, without the
oneshot-fl launcher (only a private FLWR_HOME and free ports, so no other SuperLink is touched).

Flower 1.41's local simulation starts 2 SuperNodes; the app needs one per client. A 5-client run on
the default simulation must fail in seconds with the fix in its message (not wait 600 s for nodes
that never come); after the Flower-way fix, `flwr federation simulation-config --num-supernodes 5`
(stored by the local SuperLink), the same plain command completes.
"""

from __future__ import annotations

import json
import time

import pytest

from oneshot_fl.launch import find_superlinks, flwr_cli, flwr_env, free_port, kill_tree, wait_for_status
from tests.conftest import ROOT

pytestmark = pytest.mark.e2e


def submit(run_config: str, env: dict) -> int:
    done = flwr_cli("run", ".", "--format", "json", "--run-config", run_config, env=env, cwd=ROOT, timeout=300)
    try:
        return int(json.loads(done.stdout)["run-id"])
    except (ValueError, KeyError, TypeError):
        pytest.fail(f"flwr run did not start a run:\n{done.stdout}\n{done.stderr}")


def test_plain_flwr_run_fails_fast_on_too_few_supernodes_then_completes(mnist_dir, tmp_path):
    home = tmp_path / "flwr-home"
    env = {**flwr_env(home), "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(free_port())}
    out = tmp_path / "runs"
    base = f"preset='smoke' method='fedavg' dataset='mnist' output-dir='{out}' data-dir='{mnist_dir}'"
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
        run_id = submit(base + " run-name='plain'", env)
        status, details = wait_for_status(run_id, env=env, cwd=ROOT, timeout=600,
                                          marker=out / "plain" / "result.json")
        log = flwr_cli("log", str(run_id), "--show", env=env, cwd=ROOT).stdout
        assert status == "finished:completed", (status, details, log[-3000:])
        result = json.loads((out / "plain" / "result.json").read_text())
        assert result["method"] == "fedavg" and len(result["clients"]) == 5 and result["rejected"] == []
        assert result["global"]["accuracy"] > 0.3
        assert result["provenance"]["versions"]["flwr"] == "1.41.0"
    finally:
        for pid in find_superlinks(home):
            kill_tree(pid)
    assert not find_superlinks(home), "the SuperLink this test started must be gone"
