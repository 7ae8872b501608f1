"""docker-compose.yml (no Docker daemon here): rendered from deploy/fleet.toml with the same
builders as the tested local fleet, valid against the Compose spec, every cross-reference holds."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import yaml
from flwr.common.config import parse_config_args

from oneshot_fl.deploy import cli
from oneshot_fl.deploy.compose import COMPOSE_FILE, flwr_version, render
from oneshot_fl.deploy.fleet import Fleet, superexec_args, superlink_args, supernode_args
from oneshot_fl.deploy.local import LocalFleet
from tests.conftest import ROOT

SECRETS_TARGET = "/app/secrets/"


def interpolate(text: str) -> str:
    """Compose's ${VAR} / ${VAR:-default} substitution (the spec parser does not do it)."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: os.environ.get(m[1]) or (m[2] or ""), text)


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE_FILE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def by_image(services: dict, prefix: str) -> dict:
    return {name: svc for name, svc in services.items() if svc["image"].startswith(prefix)}


def test_compose_file_is_rendered_from_the_fleet_description():
    assert COMPOSE_FILE.read_text() == render(Fleet.load()), \
        "docker-compose.yml is stale: run python -m oneshot_fl.deploy compose"
    assert cli.main(["compose", "--check"]) == 0


def test_compose_file_passes_the_compose_spec_parser():
    from compose_spec import PyOptions

    spec = PyOptions(apply_merge=True).from_yaml(interpolate(COMPOSE_FILE.read_text()))
    spec.validate()  # every secret / volume / network a service uses is defined
    fleet = Fleet.load()
    expected = {"superlink", "superexec-serverapp"} | {n.name for n in fleet.nodes} | \
               {f"superexec-{n.name}" for n in fleet.nodes}
    assert set(spec.service_names()) == expected


def test_images_are_pinned_to_our_flower_version_and_builds_exist(services):
    version = flwr_version()
    assert version == "1.41.0"
    for name, svc in services.items():
        image = svc["image"]
        if image.startswith("flwr/"):
            assert image.split(":")[1] == version, name
        else:  # our derived image: built here, FROM the pinned superexec image
            dockerfile = ROOT / svc["build"]["context"] / svc["build"]["dockerfile"]
            text = dockerfile.read_text()
            assert re.search(rf"^FROM flwr/superexec:{re.escape(version)}$", text, re.M), name
            for source in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", text, re.M):
                for path in source.split():
                    assert (ROOT / svc["build"]["context"] / path).exists(), f"{dockerfile}: COPY {path}"
    assert by_image(services, "flwr/superlink") and by_image(services, "flwr/supernode")


def test_every_mounted_secret_and_path_exists_after_the_secrets_script(compose, services, tmp_path):
    assert cli.main(["secrets", "--out", str(tmp_path / "secrets")]) == 0
    for name, secret in compose["secrets"].items():
        host = Path(secret["file"])
        assert host.parent == Path("./deploy/secrets"), name
        assert (tmp_path / "secrets" / host.name).is_file(), f"{name}: {host.name} not generated"
    for name, svc in services.items():
        targets = {s["target"] for s in svc.get("secrets", [])}
        assert all(s["source"] in compose["secrets"] for s in svc.get("secrets", [])), name
        used = {arg for arg in svc["command"] if arg.startswith(SECRETS_TARGET)}
        assert used <= targets, f"{name} uses {used - targets} without mounting it"
        for volume in svc.get("volumes", []):
            host, target, *mode = interpolate(volume).split(":")
            assert host.startswith("./") or Path(host).is_absolute(), f"{name}: {volume}"
            if target == "/data":  # datasets: read-only, and the apps are told where they are
                assert mode == ["ro"] and svc["environment"]["ONESHOT_FL_DATA_DIR"] == "/data", name
    # the ServerApp writes its run folders to a host mount, the SuperLink its state
    server = services["superexec-serverapp"]
    assert any(v.endswith(":" + server["environment"]["ONESHOT_FL_OUTPUT_DIR"]) for v in server["volumes"])
    link = services["superlink"]
    state = "/app/" + os.path.dirname(flag(link["command"], "--database"))
    assert any(v.split(":")[1] == state for v in link["volumes"])


def test_node_configs_ports_and_addresses_are_consistent(services):
    fleet = Fleet.load()
    link = services["superlink"]["command"]
    link_port = flag(link, "--port")
    nodes = by_image(services, "flwr/supernode")
    configs = {name: parse_config_args([flag(svc["command"], "--node-config")]) for name, svc in nodes.items()}
    partitions = [c["partition-id"] for c in configs.values()]
    assert len(set(partitions)) == len(partitions) == len(fleet.nodes)
    assert {c["num-partitions"] for c in configs.values()} == {fleet.num_partitions}
    assert all(0 <= p < fleet.num_partitions for p in partitions)
    ports = [flag(svc["command"], "--port") for svc in nodes.values()] + [link_port]
    assert len(set(ports)) == len(ports)
    published = [p.split(":")[0] for svc in services.values() for p in svc.get("ports", [])]
    assert published == [link_port]  # only the SuperLink is reachable from outside
    for name, svc in nodes.items():
        assert flag(svc["command"], "--superlink") == f"superlink:{link_port}"
        assert flag(svc["command"], "--auth-supernode-private-key") == f"{SECRETS_TARGET}{name}"
        assert "--insecure" not in svc["command"] and "--root-certificates" in svc["command"]
    for name, svc in by_image(services, "oneshot-fl-superexec").items():
        host, port = flag(svc["command"], "--runtime-api-address").split(":")
        assert flag(services[host]["command"], "--port") == port, name
        assert svc["depends_on"] == {host: {"condition": "service_healthy"}}, name
        assert svc["shm_size"], name
    for name, svc in services.items():
        for dep in svc.get("depends_on", {}):
            assert "healthcheck" in services[dep], f"{name} waits for {dep}, which has no healthcheck"
    assert {"--enable-supernode-auth", "--ssl-certfile", "--ssl-keyfile", "--ssl-ca-certfile"} <= set(link)
    assert "--insecure" not in link


def test_compose_commands_are_the_tested_local_fleets_commands(services, tmp_path):
    """Same builders: only paths and addresses differ from the process-level path the e2e tests run."""
    fleet = Fleet.load()
    local = LocalFleet(fleet, tmp_path, isolation="process").layout

    def shape(argv: list[str]) -> list[str]:  # flags in order, values dropped except the node config
        return [a for i, a in enumerate(argv) if a.startswith("--") or argv[i - 1] == "--node-config"]

    assert shape(services["superlink"]["command"]) == shape(superlink_args(fleet, local))
    assert shape(services["superexec-serverapp"]["command"]) == shape(superexec_args(fleet, local))
    for node in fleet.nodes:
        assert shape(services[node.name]["command"]) == shape(supernode_args(fleet, node, local))
        assert shape(services[f"superexec-{node.name}"]["command"]) == shape(superexec_args(fleet, local, node))
    # the healthcheck is the probe the local fleet waits on
    probe = services["superlink"]["healthcheck"]["test"]
    assert probe[:2] == ["CMD", "python"] and "urlopen" in probe[3]
    assert shlex.join(probe[1:])  # plain strings, no shell needed
