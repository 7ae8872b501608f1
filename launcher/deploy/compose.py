"""docker-compose.yml, rendered from deploy/fleet.toml with the same command builders as the local
launcher (process isolation: one SuperExec for the ServerApp, one per SuperNode).

`python -m launcher.deploy compose` writes it; the tests check that the committed file is exactly
what this renders, so the compose commands cannot drift from the process-level path.
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path, PurePosixPath

import yaml

from oneshot_fl.config import DATA_DIR_ENV, OUTPUT_DIR_ENV, PROJECT_ROOT
from launcher.deploy.fleet import Fleet, Layout, superexec_args, superlink_args, supernode_args
from launcher.deploy.health import probe_command
from launcher.deploy.secrets import SUPERLINK_SECRET, SecretFiles

COMPOSE_FILE = PROJECT_ROOT / "docker-compose.yml"
# host folders, relative to the compose file; each can be moved with an environment variable
SECRETS_ENV, STATE_ENV, RUNS_ENV = "ONESHOT_FL_SECRETS_DIR", "ONESHOT_FL_STATE_DIR", "ONESHOT_FL_RUNS_DIR"
SECRETS_ON_HOST = f"${{{SECRETS_ENV}:-./deploy/secrets}}"
STATE_ON_HOST = f"${{{STATE_ENV}:-./deploy/state}}"
RUNS_ON_HOST = f"${{{RUNS_ENV}:-./runs}}"
DATA_ON_HOST = f"${{{DATA_DIR_ENV}:-./data}}"
# The SuperLink's one HTTP port serves the Fleet API, the Control API (`flwr run`, `flwr supernode
# register`, `flwr log`: no user authentication in Flower's open-source SuperLink without OIDC) and
# the ServerApp Runtime API. It is published on the host's loopback only; the compose SuperNodes
# reach it on the internal network. See deploy/README.md, "Threat model".
PUBLISH_HOST = "127.0.0.1"
FLEET_NETWORK = "fleet"  # internal: no route to the outside; every SuperNode and SuperExec lives here only
OPERATOR_NETWORK = "operator"  # a plain bridge for the SuperLink alone: what the loopback port is published through
SECRETS_IN_CONTAINER = PurePosixPath("/app/secrets")
DATA_IN_CONTAINER = "/data"
RUNS_IN_CONTAINER = "/app/runs"
APP_IMAGE = "oneshot-fl-superexec:latest"
DOCKERFILE = "deploy/Dockerfile.superexec"
SHM_SIZE = "2gb"  # torch DataLoader workers share memory through /dev/shm; Docker's 64 MB is too small

HEADER = """\
# GENERATED from deploy/fleet.toml by `python -m launcher.deploy compose`; do not edit by hand.
# The commands come from launcher/deploy/fleet.py, the same builders the tested local fleet uses.
# TLS + SuperNode authentication, process isolation (a SuperExec per SuperLink / SuperNode).
# Only the SuperLink port is published, on 127.0.0.1 (it also serves the unauthenticated Control API);
# everything else talks on the internal network "fleet". Works with docker-compose v1 and docker compose v2.
# Before `up`, see deploy/README.md (or run: python -m benchmarks.compose_check): secrets, chown, register keys.
"""


def flwr_version() -> str:
    """The flwr version pyproject.toml pins (the images are pinned to the same)."""
    with open(PROJECT_ROOT / "pyproject.toml", "rb") as fh:
        deps = tomllib.load(fh)["project"]["dependencies"]
    pin = next(d for d in deps if d.startswith("flwr[") or d.startswith("flwr=="))
    return pin.split("==", 1)[1]


def compose_layout() -> Layout:
    """Containers: servers listen on 0.0.0.0, peers are reached by service name."""
    return Layout(secrets=SecretFiles(Path(SECRETS_IN_CONTAINER)), auth=True, isolation="process",
                  bind_host="0.0.0.0", superlink_host="superlink", node_host=lambda node: node.name,
                  database="state/state.db")


def _secret(name: str, target: PurePosixPath) -> dict:
    return {"source": name, "target": str(target)}


def _superexec_service(command: list[str], secrets: list[dict], depends_on: str) -> dict:
    return {
        "build": {"context": ".", "dockerfile": DOCKERFILE},
        "image": APP_IMAGE,
        "command": command,
        "environment": {DATA_DIR_ENV: DATA_IN_CONTAINER, OUTPUT_DIR_ENV: RUNS_IN_CONTAINER},
        # the datasets, read-only; point ONESHOT_FL_DATA_DIR on the host at them before `up`
        "volumes": [f"{DATA_ON_HOST}:{DATA_IN_CONTAINER}:ro"],
        "secrets": secrets,
        "shm_size": SHM_SIZE,
        "stop_signal": "SIGINT",
        "restart": "on-failure",
        "depends_on": {depends_on: {"condition": "service_healthy"}},
        "networks": [FLEET_NETWORK],
    }


def _healthcheck(url: str, ca: str | None) -> dict:
    return {"test": ["CMD", *probe_command(url, ca)], "interval": "10s", "timeout": "5s",
            "retries": 6, "start_period": "10s"}


def render_dict(fleet: Fleet) -> dict:
    layout = compose_layout()
    sec = layout.secrets
    version = flwr_version()
    host_file = {  # compose secret name -> (file on the host, path in the container)
        "superlink-ca-cert": sec.ca_cert.name, "superlink-server-cert": sec.server_cert.name,
        "superlink-server-key": sec.server_key.name,
    }
    ca = _secret("superlink-ca-cert", SECRETS_IN_CONTAINER / sec.ca_cert.name)

    def exec_secret(name: str) -> dict:
        key = f"superexec-{name}-secret"
        host_file[key] = sec.superexec_secret(name).name
        return _secret(key, SECRETS_IN_CONTAINER / sec.superexec_secret(name).name)

    services = {
        "superlink": {
            "image": f"flwr/superlink:{version}",
            "command": superlink_args(fleet, layout),
            "ports": [f"{PUBLISH_HOST}:{fleet.superlink_port}:{fleet.superlink_port}"],
            # --database state/state.db: registrations and runs survive a restart (chown 49999, see README)
            "volumes": [f"{STATE_ON_HOST}:/app/state"],
            "secrets": [ca, _secret("superlink-server-cert", SECRETS_IN_CONTAINER / sec.server_cert.name),
                        _secret("superlink-server-key", SECRETS_IN_CONTAINER / sec.server_key.name),
                        exec_secret(SUPERLINK_SECRET)],
            "healthcheck": _healthcheck(f"https://localhost:{fleet.superlink_port}/health", str(sec.ca_cert)),
            "restart": "unless-stopped",
            # OPERATOR_NETWORK only to publish the port on the host (an internal network cannot);
            # the fleet talks on FLEET_NETWORK
            "networks": [OPERATOR_NETWORK, FLEET_NETWORK],
        },
        "superexec-serverapp": {
            **_superexec_service(superexec_args(fleet, layout), [dict(ca), exec_secret(SUPERLINK_SECRET)],
                                 "superlink"),
            # run folders (result.json, global_model.pt, uploads) land on the host
            "volumes": [f"{DATA_ON_HOST}:{DATA_IN_CONTAINER}:ro", f"{RUNS_ON_HOST}:{RUNS_IN_CONTAINER}"],
        },
    }
    for node in fleet.nodes:
        key = f"{node.name}-key"
        host_file[key] = sec.node_key(node.name).name
        services[node.name] = {
            "image": f"flwr/supernode:{version}",
            "command": supernode_args(fleet, node, layout),
            "secrets": [dict(ca), _secret(key, SECRETS_IN_CONTAINER / sec.node_key(node.name).name),
                        exec_secret(node.name)],
            "healthcheck": _healthcheck(f"http://localhost:{node.port}/health", None),
            # an unregistered SuperNode exits (code 305); it joins once its key is registered
            "restart": "on-failure",
            "depends_on": {"superlink": {"condition": "service_healthy"}},
            "networks": [FLEET_NETWORK],
        }
        services[f"superexec-{node.name}"] = _superexec_service(
            superexec_args(fleet, layout, node), [exec_secret(node.name)], node.name)
    # Compose-spec file without `version:` (v2 warns it is obsolete; v1 >= 1.27 reads a versionless
    # file as the Compose spec) and without top-level `name:` (v1 rejects it): the project name is
    # the folder's, or -p / COMPOSE_PROJECT_NAME
    return {
        "services": copy.deepcopy(services),  # no shared objects: YAML without &anchors
        "networks": {OPERATOR_NETWORK: {}, FLEET_NETWORK: {"internal": True}},
        "secrets": {name: {"file": f"{SECRETS_ON_HOST}/{file}"} for name, file in sorted(host_file.items())},
    }


def published_ports(compose: dict) -> dict[str, list[str]]:
    """service -> its `ports:` entries (HOST_IP:HOST_PORT:CONTAINER_PORT), for the tests and the check."""
    return {name: [str(p) for p in svc.get("ports", [])] for name, svc in compose["services"].items()
            if svc.get("ports")}


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data):  # noqa: D102 - plain YAML, no anchors
        return True


def render(fleet: Fleet) -> str:
    body = yaml.dump(render_dict(fleet), Dumper=_Dumper, sort_keys=False, width=1000, default_flow_style=False)
    return HEADER + body


def write(fleet: Fleet, path: Path = COMPOSE_FILE) -> Path:
    path.write_text(render(fleet))
    return path
