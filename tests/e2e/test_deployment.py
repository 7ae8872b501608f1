"""End-to-end deployment on loopback: real flower-superlink, 3 flower-supernode processes and
`flwr run`, TLS + SuperNode authentication, smoke preset; every process killed by PID.

Two fleets: the compose path (process isolation, external SuperExecs) running the project's app,
and a subprocess-isolation fleet running a test-only ClientApp wrapper (tests/e2e/fault_injection)
that corrupts its upload when its node config says so, for the fault tests.
"""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from launcher.deploy.fleet import Fleet, Node
from launcher.deploy.health import healthy
from launcher.deploy.local import LocalFleet
from launcher.deploy.secrets import generate
from launcher.launch import cmdline, free_port
from tests.conftest import ROOT, TokenWatch, data_dir, files_containing

pytestmark = pytest.mark.e2e
SMOKE = {"method": "fedavg", "preset": "smoke", "round-timeout": 300.0}
FIRST_TENSOR = "features.0.weight"  # cnn2's first float tensor, where the "nan" corruption lands
NODE_MODES: dict[str, str] = {}  # fault fleet: node name -> the corrupt-upload mode it runs with


def alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if cmdline(pid)]  # zombies have no command line


def stop_and_check(fleet: LocalFleet) -> None:
    pids = fleet.pids()
    fleet.stop()
    deadline = time.monotonic() + 10
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(pids), f"fleet processes left running: {alive(pids)}"


@pytest.fixture(scope="module")
def compose_path_fleet(tmp_path_factory):
    """The docker-compose.yml layout as local processes: TLS, node auth, process isolation."""
    data_dir()
    fleet = LocalFleet(Fleet.simple(3).with_free_ports(), tmp_path_factory.mktemp("fleet-process"),
                       isolation="process")
    fleet.start()
    yield fleet
    stop_and_check(fleet)


def fault_app_dir(dest: Path) -> Path:
    """The project's app with the test-only ClientApp as its clientapp component."""
    for package in ("oneshot_fl", "strategies", "server_app", "client_app"):
        shutil.copytree(ROOT / package, dest / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "tests" / "e2e" / "fault_injection", dest / "fault_injection",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "README.md", dest / "README.md")
    shutil.copy(ROOT / "LICENSE", dest / "LICENSE")
    pyproject = (ROOT / "pyproject.toml").read_text()
    component = 'clientapp = "client_app.app:app"'
    include = 'fab-include = ["oneshot_fl/**/*.py", '
    assert component in pyproject and include in pyproject
    pyproject = pyproject.replace(component, 'clientapp = "fault_injection.app:app"')
    pyproject = pyproject.replace(include, include + '"fault_injection/*.py", ')  # ship the wrapper too
    (dest / "pyproject.toml").write_text(pyproject)
    return dest


@pytest.fixture(scope="module")
def fault_fleet(tmp_path_factory):
    data_dir()
    work = tmp_path_factory.mktemp("fleet-faults")
    fleet = LocalFleet(Fleet.simple(3).with_free_ports(), work, app_dir=fault_app_dir(work / "app"))
    NODE_MODES.clear()
    fleet.start()
    yield fleet
    stop_and_check(fleet)


def set_nodes(fleet: LocalFleet, corrupt: dict[str, str], names: list[str] | None = None) -> None:
    """(Re)start nodes (default: all) so that exactly those in `corrupt` corrupt their uploads."""
    for node in fleet.fleet.nodes:
        if names is not None and node.name not in names:
            continue
        mode = corrupt.get(node.name, "")
        if fleet.procs[node.name].poll() is None and NODE_MODES.get(node.name, "") == mode:
            continue
        fleet.stop_node(node.name)  # graceful: it deactivates itself and may rejoin at once
        fleet.start_node(node, extra_config=f'corrupt-upload="{mode}"' if mode else "")
        NODE_MODES[node.name] = mode
        fleet.wait_nodes([node.name])


def test_tls_auth_fleet_runs_the_app_through_flwr_run(compose_path_fleet, tmp_path):
    fleet = compose_path_fleet
    # the docker-compose healthchecks, run against the real processes
    assert healthy(f"https://127.0.0.1:{fleet.fleet.superlink_port}/health", str(fleet.secrets.ca_cert))
    assert not healthy(f"https://127.0.0.1:{fleet.fleet.superlink_port}/health")  # TLS, untrusted without our CA
    assert all(healthy(f"http://127.0.0.1:{n.port}/health") for n in fleet.fleet.nodes)

    with TokenWatch(fleet.pids) as watch:
        run = fleet.run({**SMOKE, "output-dir": str(tmp_path)})
    assert run.ok, run.status_details + run.log_text[-3000:]
    result = run.result()
    assert sorted(c["partition_id"] for c in result["clients"]) == [0, 1, 2]
    # no file of the run, and none of the fleet's logs, holds a token Flower gave its processes (only the
    # SuperLink's state database, where Flower keeps them); the provenance is the launching command (here this
    # test's), not flwr-serverapp's command line
    assert watch.tokens, "no --token seen on the fleet's Flower processes"
    for token in watch.tokens:
        assert files_containing(tmp_path, token) == [], token  # the run folder
        held = files_containing(fleet.work, token)
        assert all(Path(path).parent == fleet.work / "state" for path in held), held
    assert result["provenance"]["command_source"] == "launcher"
    assert "flwr-serverapp" not in result["provenance"]["command"] and "--token" not in result["provenance"]["command"]
    assert result["rejected"] == [] and result["missing_nodes"] == []
    assert result["global"]["accuracy"] > 0.3  # chance is 0.1
    assert (run.run_dir / "global_model.pt").is_file()
    # one log per process; each SuperExec ran its app
    assert "results written" in fleet.log_path(f"serverapp-run-{run.run_id}").read_text()
    for node in fleet.fleet.nodes:
        assert "local test accuracy" in fleet.log_path(f"superexec-{node.name}").read_text()


def test_an_unregistered_supernode_is_refused(fault_fleet):
    fleet = fault_fleet
    generate(fleet.secrets.root, ["stranger"])  # a valid key pair the SuperLink was never told about
    proc = fleet.start_node(Node("stranger", 0, free_port()))
    assert proc.wait(timeout=60) != 0
    log = fleet.log_path("stranger").read_text()
    # what Flower 1.41 really does: exit status 1, logging exit code 305 / "Failed to activate SuperNode"
    assert "Exit Code: 305" in log and "Failed to activate SuperNode" in log
    assert len(fleet.online_nodes()) == 3  # the registered fleet is untouched


def test_a_supernode_killed_after_its_instruction_is_missing_and_the_run_completes(fault_fleet, tmp_path):
    fleet = fault_fleet
    set_nodes(fleet, {})
    victim = fleet.node_id("supernode-2")
    with ThreadPoolExecutor(1) as pool:
        killed = pool.submit(fleet.kill_node_when_busy, "supernode-2", 300.0)
        run = fleet.run({**SMOKE, "min-clients": 2, "output-dir": str(tmp_path)})
    assert killed.result() is not None, "supernode-2 never received its instruction"
    assert run.ok, run.status_details + run.log_text[-3000:]
    result = run.result()
    assert sorted(c["partition_id"] for c in result["clients"]) == [0, 1]
    assert result["rejected"] == [] and result["missing_nodes"] == [victim]
    # Flower 1.41: the SuperLink answers for a node whose heartbeats stopped (2 x 30 s interval),
    # so the round ends well before round-timeout
    assert "Node Unavailable" in result["missing"][0]["reason"]
    assert result["timings"]["wait_for_uploads"] < SMOKE["round-timeout"]


def test_malformed_uploads_are_rejected_with_their_reason_and_the_run_completes(fault_fleet, tmp_path):
    fleet = fault_fleet
    set_nodes(fleet, {"supernode-1": "counts", "supernode-2": "nan"})
    run = fleet.run({**SMOKE, "min-clients": 1, "output-dir": str(tmp_path)})
    assert run.ok, run.status_details + run.log_text[-3000:]
    result = run.result()
    assert [c["partition_id"] for c in result["clients"]] == [0]
    reasons = {r["node_id"]: r["reason"] for r in result["rejected"]}
    assert reasons == {fleet.node_id("supernode-1"): "label counts contain negative values",
                       fleet.node_id("supernode-2"): f"tensor {FIRST_TENSOR!r} contains NaN or Inf"}
    assert f"rejected upload from node {fleet.node_id('supernode-2')}: tensor" in run.log_text


def test_too_few_supernodes_fail_the_run_and_write_no_model(fault_fleet, tmp_path):
    """Fewer than min-clients nodes left: a clear failure, nothing written as if it were a result.
    (Too few *valid uploads* take the same QuorumError path: tests/strategies/test_missing_nodes.py.)"""
    fleet = fault_fleet
    set_nodes(fleet, {}, names=["supernode-0"])
    for name in ("supernode-1", "supernode-2"):
        fleet.stop_node(name)  # graceful: the SuperLink knows at once they are gone
    run = fleet.run({**SMOKE, "min-clients": 2, "node-wait-timeout": 2.0, "output-dir": str(tmp_path)})
    assert run.status == "finished:failed"
    assert "only 1 SuperNodes connected" in run.status_details + run.log_text
    assert "2 required" in run.status_details + run.log_text
    assert not (run.run_dir / "result.json").exists() and not (run.run_dir / "global_model.pt").exists()
