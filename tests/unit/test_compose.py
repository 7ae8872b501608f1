"""docker-compose.yml without a Docker daemon: rendered from deploy/fleet.toml with the same
builders as the tested local fleet, valid against the Compose spec, every cross-reference holds,
nothing but the SuperLink port published and that on loopback only. (Started for real by
`python -m benchmarks.compose_check`, record in benchmarks/results/compose_check.md.)"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml
from flwr.common.config import parse_config_args

from launcher.deploy import cli
from launcher.deploy.compose import COMPOSE_FILE, flwr_version, render
from launcher.deploy.fleet import Fleet, superexec_args, superlink_args, supernode_args
from launcher.deploy.health import probe_command
from launcher.deploy.local import LocalFleet
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
        "docker-compose.yml is stale: run python -m launcher.deploy compose"
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
            # FROM the pinned superexec image by default; build-images.sh --local swaps in a stand-in
            assert re.search(rf"^ARG BASE_IMAGE=flwr/superexec:{re.escape(version)}$", text, re.M), name
            assert re.findall(r"^FROM .*$", text, re.M) == ["FROM ${BASE_IMAGE}"], name
            for source in re.findall(r"^COPY (?:--\S+ )*(.+) \S+$", text, re.M):
                for path in source.split():
                    assert (ROOT / svc["build"]["context"] / path).exists(), f"{dockerfile}: COPY {path}"
    assert by_image(services, "flwr/superlink") and by_image(services, "flwr/supernode")


def test_every_mounted_secret_and_path_exists_after_the_secrets_script(compose, services, tmp_path):
    assert cli.main(["secrets", "--out", str(tmp_path / "secrets")]) == 0
    for name, secret in compose["secrets"].items():
        host = Path(interpolate(secret["file"]))
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
    assert any(interpolate(v).split(":")[1] == state for v in link["volumes"])


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
    published = [p.split(":") for svc in services.values() for p in svc.get("ports", [])]
    assert published == [["127.0.0.1", link_port, link_port]]  # only the SuperLink, on loopback
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
    # the healthcheck is the probe the local fleet waits on, in exec form (no shell in the image needed)
    fleet_port = fleet.superlink_port
    probe = services["superlink"]["healthcheck"]["test"]
    assert probe == ["CMD", *probe_command(f"https://localhost:{fleet_port}/health", "/app/secrets/ca.crt")]
    for node in fleet.nodes:
        assert services[node.name]["healthcheck"]["test"] == \
            ["CMD", *probe_command(f"http://localhost:{node.port}/health")]


def test_the_healthcheck_probe_passes_on_200_and_fails_otherwise(tmp_path):
    """Run the compose healthcheck's argv (with this Python) against a server answering 200, then 503,
    then against a closed port: exit 0 only for the first."""
    import http.server
    import subprocess
    import sys
    import threading

    status = {"code": 200}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            self.send_response(status["code"] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    test = yaml.safe_load(COMPOSE_FILE.read_text())["services"]["supernode-0"]["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python"
    argv = [sys.executable, *test[2:-1], f"http://127.0.0.1:{port}/health"]

    def exit_code() -> int:
        return subprocess.run(argv, capture_output=True, timeout=30).returncode

    try:
        assert exit_code() == 0
        status["code"] = 503
        assert exit_code() != 0
    finally:
        server.shutdown()
        server.server_close()
    assert exit_code() != 0  # nothing listening


# --- issue 13: what the shipped compose file exposes -------------------------------------------

def port_bindings(compose: dict) -> list[tuple[str, str, str, str]]:
    """(service, host ip, host port, container port) for every `ports:` entry, short or long syntax;
    an entry without a host ip binds every interface (0.0.0.0), as Docker does."""
    out = []
    for name, svc in compose["services"].items():
        for entry in svc.get("ports", []):
            if isinstance(entry, dict):
                out.append((name, str(entry.get("host_ip", "0.0.0.0")), str(entry.get("published", "")),
                            str(entry["target"])))
                continue
            entry = str(entry).split("/")[0]
            m = re.fullmatch(r"(?:(\[[^\]]+\]|[^:]+):)??(?:([\d-]*):)?([\d-]+)", entry)
            assert m, f"{name}: cannot parse ports entry {entry!r}"
            host_ip = (m[1] or "0.0.0.0").strip("[]")
            out.append((name, host_ip, m[2] or "", m[3]))
    return out


def test_the_port_parser_sees_an_unbound_port_as_every_interface():
    compose = {"services": {"a": {"ports": ["8000:8000", "127.0.0.1:9:9", "[::1]:7:7", "9093",
                                            {"target": 1, "published": 2}]}}}
    assert port_bindings(compose) == [("a", "0.0.0.0", "8000", "8000"), ("a", "127.0.0.1", "9", "9"),
                                      ("a", "::1", "7", "7"), ("a", "0.0.0.0", "", "9093"),
                                      ("a", "0.0.0.0", "2", "1")]


@pytest.mark.parametrize("source", ["rendered from deploy/fleet.toml", "committed docker-compose.yml"])
def test_no_control_plane_or_runtime_api_port_is_published_beyond_loopback(source):
    """Flower 1.41's SuperLink serves the Fleet API, the Control API (no user authentication without
    OIDC) and the ServerApp Runtime API on one port: it may be published on loopback only. The
    SuperNodes' plain-HTTP Runtime APIs are never published, and the fleet network has no way out."""
    import ipaddress

    fleet = Fleet.load()
    text = render(fleet) if source.startswith("rendered") else COMPOSE_FILE.read_text()
    compose = yaml.safe_load(text)
    bindings = port_bindings(compose)
    assert bindings, "the operator's CLI needs the SuperLink port on the host"
    for service, host_ip, _host_port, container_port in bindings:
        assert ipaddress.ip_address(host_ip).is_loopback, f"{service} publishes {container_port} on {host_ip}"
        assert service == "superlink" and container_port == str(fleet.superlink_port), (service, container_port)
    for name, svc in compose["services"].items():
        assert "network_mode" not in svc and "expose" not in svc, name
        if name != "superlink":  # SuperNodes and SuperExecs: only the internal network
            assert svc["networks"] == ["fleet"], name
    assert compose["networks"]["fleet"] == {"internal": True}
    assert compose["services"]["superlink"]["networks"] == ["operator", "fleet"]
    # the SuperLink listens on all interfaces *inside* its container, i.e. on the compose networks
    assert flag(compose["services"]["superlink"]["command"], "--host") == "0.0.0.0"


def readme_published_ports() -> set[tuple[str, str]]:
    """(service, ports entry) rows of deploy/README.md's "Published ports" table."""
    text = (ROOT / "deploy" / "README.md").read_text()
    section = text.split("### Published ports", 1)[1].split("\n#", 1)[0]
    rows = re.findall(r"^\| `([\w-]+)` \| `([^`]+)` \|", section, re.M)
    assert rows, "deploy/README.md has no Published ports table"
    return set(rows)


def test_the_readme_and_the_compose_file_agree_on_the_published_ports():
    for compose in (yaml.safe_load(render(Fleet.load())), yaml.safe_load(COMPOSE_FILE.read_text())):
        published = {(name, str(p)) for name, svc in compose["services"].items() for p in svc.get("ports", [])}
        assert readme_published_ports() == published


def test_the_file_uses_only_keys_both_compose_v1_and_v2_read(compose):
    """docker-compose v1 (1.29) rejects a top-level `name:`; docker compose v2 warns on `version:`
    (v1 >= 1.27 reads a versionless file as the Compose spec). Checked with `docker-compose config`
    by benchmarks.compose_check."""
    assert set(compose) == {"services", "networks", "secrets"}
    assert all(set(svc) <= {"image", "build", "command", "environment", "volumes", "secrets", "ports",
                            "healthcheck", "shm_size", "stop_signal", "restart", "depends_on", "networks"}
               for svc in compose["services"].values())


def test_the_app_image_is_built_with_the_pinned_torch_and_torchvision_and_checked_against_them():
    """build-images.sh reads the pins from pyproject.toml (no wheel of another version, whatever the building
    machine's wheel folder holds) and passes both to the Dockerfile, which installs exactly them; the compose
    check compares what the container imports with the same pins."""
    from benchmarks.compose_check import pinned_versions, versions_match

    assert pinned_versions() == {"flwr": "1.41.0", "torch": "2.14.1", "torchvision": "0.29.1"}
    pin = subprocess.run(["bash", "-c", 'source <(sed -n "/^pin()/,/^}/p" deploy/build-images.sh); '
                          "pin flwr; pin torch; pin torchvision"], cwd=ROOT, env={**os.environ, "ROOT": str(ROOT)},
                         capture_output=True, text=True, check=True)
    assert pin.stdout.split() == ["1.41.0", "2.14.1", "0.29.1"]
    script = (ROOT / "deploy" / "build-images.sh").read_text()
    assert 'torch-"$TORCH_VERSION"+cpu-cp311' in script and "sort -V" not in script  # only the pinned wheel
    assert '--build-arg TORCHVISION_VERSION="$TORCHVISION_VERSION"' in script
    dockerfile = (ROOT / "deploy" / "Dockerfile.superexec").read_text()
    assert '"torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}"' in dockerfile
    pinned = {"torch": "2.14.1", "torchvision": "0.29.1"}
    assert versions_match(pinned, {"torch": "2.14.1+cpu", "torchvision": "0.29.1"})
    assert not versions_match(pinned, {"torch": "2.13.0+cpu", "torchvision": "0.29.1"})
    assert not versions_match(pinned, {"torch": "2.14.1"})  # torchvision missing
    assert not versions_match(pinned, {"torch": "2.14.10", "torchvision": "0.29.1"})
