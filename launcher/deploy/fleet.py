"""The deployment fleet, described once, and the command line of every process in it.

`deploy/fleet.toml` lists the SuperNodes (partition, Runtime API port, optional architecture and
role). The local launcher (`local.py`, what the tests run for real) and `docker-compose.yml`
(rendered by `compose.py`) both take their flags from the builders below, so the two paths differ
only in addresses and file paths (`Layout`), never in flags.
"""

from __future__ import annotations

import dataclasses
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from oneshot_fl.config import PROJECT_ROOT
from launcher.deploy.secrets import SUPERLINK_SECRET, SecretFiles
from launcher.launch import free_port

FLEET_FILE = PROJECT_ROOT / "deploy" / "fleet.toml"
ISOLATIONS = ("subprocess", "process")


class FleetError(ValueError):
    """The fleet description is inconsistent, or a fleet process failed."""


@dataclass(frozen=True)
class Node:
    """One SuperNode: its data partition, its Runtime API port and optional architecture/role."""

    name: str
    partition_id: int
    port: int
    arch: str = ""
    role: str = ""


def _integer(path: Path, table: dict, key: str, default: int | None = None) -> int:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise FleetError(f"{path}: {key} = {value!r} is not an integer")
    return value


@dataclass(frozen=True)
class Fleet:
    num_partitions: int
    nodes: tuple[Node, ...]
    superlink_port: int = 8000

    @classmethod
    def load(cls, path: Path = FLEET_FILE) -> "Fleet":
        with open(path, "rb") as fh:
            try:
                raw = tomllib.load(fh)
            except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
                raise FleetError(f"{path} is not valid TOML: {exc}") from None
        known = {"num-partitions", "superlink-port", "supernodes"}
        if unknown := set(raw) - known:
            raise FleetError(f"{path}: unknown key(s) {sorted(unknown)}; known: {sorted(known)}")
        entries = raw.get("supernodes", [])
        if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
            raise FleetError(f"{path}: supernodes must be [[supernodes]] tables")
        nodes = []
        for entry in entries:
            fields = {"name", "partition-id", "port", "arch", "role"}
            if unknown := set(entry) - fields:
                raise FleetError(f"{path}: supernode {entry.get('name')!r} has unknown key(s) {sorted(unknown)}")
            if missing := {"name", "partition-id", "port"} - set(entry):
                raise FleetError(f"{path}: supernode {entry.get('name')!r} lacks {sorted(missing)}")
            nodes.append(Node(name=str(entry["name"]), partition_id=_integer(path, entry, "partition-id"),
                              port=_integer(path, entry, "port"), arch=str(entry.get("arch", "")),
                              role=str(entry.get("role", ""))))
        if "num-partitions" not in raw:
            raise FleetError(f"{path}: num-partitions is missing")
        fleet = cls(num_partitions=_integer(path, raw, "num-partitions"), nodes=tuple(nodes),
                    superlink_port=_integer(path, raw, "superlink-port", 8000))
        fleet.check()
        return fleet

    @classmethod
    def simple(cls, num_nodes: int, superlink_port: int = 8000, first_node_port: int = 9094) -> "Fleet":
        """N homogeneous SuperNodes with partitions 0..N-1."""
        nodes = tuple(Node(f"supernode-{i}", i, first_node_port + i) for i in range(num_nodes))
        return cls(num_nodes, nodes, superlink_port)

    def with_free_ports(self) -> "Fleet":
        """The same fleet on ports that are free on this machine now (tests, parallel fleets)."""
        nodes = tuple(dataclasses.replace(n, port=free_port()) for n in self.nodes)
        return dataclasses.replace(self, nodes=nodes, superlink_port=free_port())

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise FleetError(f"no SuperNode named {name!r}; fleet has {[n.name for n in self.nodes]}")

    def check(self) -> None:
        """Every name, partition and port unique; partitions within num-partitions; known archs."""
        from oneshot_fl.models.registry import ARCHITECTURES  # torch: only the check needs it

        problems = []
        if not self.nodes:
            problems.append("no supernodes")
        for label, values in (("name", [n.name for n in self.nodes]),
                              ("partition-id", [n.partition_id for n in self.nodes]),
                              ("port", [n.port for n in self.nodes] + [self.superlink_port])):
            dupes = sorted({v for v in values if values.count(v) > 1}, key=str)
            if dupes:
                problems.append(f"duplicate {label}(s) {dupes}")
        for name, port in [(n.name, n.port) for n in self.nodes] + [("superlink", self.superlink_port)]:
            if not 1 <= port <= 65535:
                problems.append(f"{name}: port {port} outside 1..65535")
        for node in self.nodes:
            if not 0 <= node.partition_id < self.num_partitions:
                problems.append(f"{node.name}: partition-id {node.partition_id} outside 0..{self.num_partitions - 1}")
            if node.arch and node.arch not in ARCHITECTURES:
                problems.append(f"{node.name}: unknown arch {node.arch!r} (known: {', '.join(ARCHITECTURES)})")
            if not node.name.replace("-", "").isalnum():
                problems.append(f"{node.name!r}: names may hold letters, digits and '-' only")
        if problems:
            raise FleetError("fleet description: " + "; ".join(problems))

    def node_config(self, node: Node) -> str:
        """The SuperNode's --node-config value (TOML values; strings quoted)."""
        parts = [f"partition-id={node.partition_id}", f"num-partitions={self.num_partitions}"]
        parts += [f'{key}="{value}"' for key, value in (("arch", node.arch), ("role", node.role)) if value]
        return " ".join(parts)


@dataclass(frozen=True)
class Layout:
    """Where the processes run relative to each other: the only thing local and compose differ in.

    `secrets` are the paths as the processes see them (None = --insecure, loopback experiments only).
    """

    secrets: SecretFiles | None
    auth: bool
    isolation: str
    bind_host: str  # what servers listen on: 127.0.0.1 locally, 0.0.0.0 in containers
    superlink_host: str  # how the others reach the SuperLink
    node_host: Callable[[Node], str]  # how a SuperNode's SuperExec reaches the SuperNode
    database: str = ""  # SuperLink state file; "" = in memory
    node_bind_host: str = ""  # SuperNodes' Runtime API bind address; "" = bind_host

    def __post_init__(self):
        if self.isolation not in ISOLATIONS:
            raise FleetError(f"isolation={self.isolation!r}; choose one of {ISOLATIONS}")
        if self.auth and self.secrets is None:
            raise FleetError("SuperNode authentication needs TLS (Flower refuses --enable-supernode-auth without it)")


def superlink_args(fleet: Fleet, layout: Layout) -> list[str]:
    """flower-superlink arguments: one HTTP port for Fleet, Control and Runtime APIs."""
    sec = layout.secrets
    args = (["--insecure"] if sec is None else
            ["--ssl-ca-certfile", str(sec.ca_cert), "--ssl-certfile", str(sec.server_cert),
             "--ssl-keyfile", str(sec.server_key)])
    if layout.auth:
        args.append("--enable-supernode-auth")
    # dependencies are baked into the environment / images; no `uv sync` per run
    args += ["--disable-runtime-dependency-installation", "--isolation", layout.isolation,
             "--host", layout.bind_host, "--port", str(fleet.superlink_port)]
    if layout.isolation == "process" and sec is not None:
        args += ["--superexec-auth-secret-file", str(sec.superexec_secret(SUPERLINK_SECRET))]
    if layout.database:
        args += ["--database", layout.database]
    return args


def supernode_args(fleet: Fleet, node: Node, layout: Layout) -> list[str]:
    """flower-supernode arguments for one node (its partition in --node-config)."""
    sec = layout.secrets
    args = ["--insecure"] if sec is None else ["--root-certificates", str(sec.ca_cert)]
    args += ["--superlink", f"{layout.superlink_host}:{fleet.superlink_port}"]
    if layout.auth:
        args += ["--auth-supernode-private-key", str(sec.node_key(node.name))]
    args += ["--node-config", fleet.node_config(node), "--isolation", layout.isolation,
             "--host", layout.node_bind_host or layout.bind_host, "--port", str(node.port)]
    if layout.isolation == "process" and sec is not None:
        args += ["--superexec-auth-secret-file", str(sec.superexec_secret(node.name))]
    return args


def superexec_args(fleet: Fleet, layout: Layout, node: Node | None = None) -> list[str]:
    """flower-superexec arguments (process isolation): for the ServerApp (node None) or a node's ClientApps."""
    sec = layout.secrets
    if node is None:
        # the SuperLink's Runtime API shares its TLS port
        tls = ["--insecure"] if sec is None else ["--root-certificates", str(sec.ca_cert)]
        address, secret = f"{layout.superlink_host}:{fleet.superlink_port}", SUPERLINK_SECRET
    else:
        # a SuperNode's Runtime API is plain HTTP: keep it on loopback / a private network
        tls = ["--insecure"]
        address, secret = f"{layout.node_host(node)}:{node.port}", node.name
    args = [*tls, "--runtime-api-address", address]
    if sec is not None:
        args += ["--superexec-auth-secret-file", str(sec.superexec_secret(secret))]
    return args


def secret_names(fleet: Fleet) -> list[str]:
    """SuperExec shared-secret names: one for the SuperLink, one per SuperNode."""
    return [SUPERLINK_SECRET, *(n.name for n in fleet.nodes)]
