"""A Flower deployment on this machine: real SuperLink and SuperNode processes, TLS + SuperNode
authentication by default, one log per process, every process stopped by PID.

    with LocalFleet(Fleet.load(), Path("deploy/work")) as fleet:   # start() on enter, stop() on exit
        run = fleet.run({"method": "fedavg", "preset": "smoke"})
        assert run.ok

The commands come from `fleet.py`, the same builders docker-compose.yml is rendered from.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from oneshot_fl.config import PROJECT_ROOT
from launcher.deploy.fleet import (Fleet, FleetError, Layout, Node, secret_names, superexec_args,
                                     superlink_args, supernode_args)
from launcher.deploy.health import healthy
from launcher.deploy.secrets import SecretFiles, generate
from launcher.control_api import strip_ansi
from launcher.launch import (SimulationRun, cmdline, check_run_config, flwr_cli, flwr_env, follow_run,
                               kill_tree, pin_run_config, process_tree)
from oneshot_fl.run_folder import release_run_folder

CONNECTION = "oneshot-fleet"  # the [superlink.NAME] entry the CLI uses for this fleet
# a TOML bare key: anything else would need quoting, and a bad header breaks the user's whole config.toml
CONNECTION_NAME = re.compile(r"[A-Za-z0-9_-]+")
ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):([0-9]{1,5})")  # HOST:PORT, [IPv6]:PORT


def check_connection(name: str, address: str, ca_cert: Path | None) -> None:
    """What `write_connection` would write is a working entry: FleetError (nothing written) otherwise."""
    if not CONNECTION_NAME.fullmatch(name):
        raise FleetError(f"connection name {name!r}: use letters, digits, '-' and '_' only")
    match = ADDRESS.fullmatch(address)
    if match is None or not 1 <= int(match.group(2)) <= 65535:
        raise FleetError(f"address {address!r} is not HOST:PORT with a port in 1..65535")
    if ca_cert is not None and not Path(ca_cert).is_file():
        raise FleetError(f"CA certificate {ca_cert} not found (the SuperLink's CA, e.g. deploy/secrets/ca.crt; "
                         "omit --ca only for an insecure SuperLink)")


def write_connection(flwr_home: Path, name: str, address: str, ca_cert: Path | None, *,
                     replace: bool = False) -> Path:
    """Add a `[superlink.NAME]` connection to $FLWR_HOME/config.toml (created if absent; the first
    entry becomes the default). An existing entry of that name is the user's: FleetError, unless
    `replace` (a fleet's private FLWR_HOME), which rewrites the whole file."""
    check_connection(name, address, ca_cert)
    path = Path(flwr_home) / "config.toml"
    text = "" if replace or not path.exists() else path.read_text()
    if f"[superlink.{name}]" in text:
        raise FleetError(f"{path} already has a [superlink.{name}] connection; edit it or choose another name")
    entry = f'\n[superlink.{name}]\naddress = "{address}"\n'
    entry += f'root-certificates = "{Path(ca_cert).resolve()}"\n' if ca_cert else "insecure = true\n"
    if not text:
        text = f'[superlink]\ndefault = "{name}"\n'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + entry)
    return path


def register_node(public_key: Path, connection: str, env: dict, cwd: Path) -> str:
    """`flwr supernode register`; a key that is already registered is fine (state persists)."""
    done = flwr_cli("supernode", "register", str(public_key), connection, "--format", "json", env=env, cwd=cwd)
    try:
        reply = json.loads(done.stdout)
    except ValueError:
        raise FleetError(f"flwr supernode register {public_key} failed:\n{done.stdout}\n{done.stderr}") from None
    if reply.get("success"):
        return str(reply["node-id"])
    if "already in use" in reply.get("error-message", ""):
        return "already registered"
    raise FleetError(f"flwr supernode register {public_key}: {reply.get('error-message')}")


class LocalFleet:
    """SuperLink + SuperNodes (+ their SuperExecs in process isolation) as local processes."""

    def __init__(self, fleet: Fleet, work_dir: Path, *, tls: bool = True, auth: bool = True,
                 isolation: str = "subprocess", secrets_dir: Path | None = None,
                 app_dir: Path = PROJECT_ROOT, persist_state: bool = True):
        fleet.check()
        self.fleet = fleet
        self.work = Path(work_dir).resolve()
        self.app_dir = Path(app_dir).resolve()
        self.secrets = SecretFiles(Path(secrets_dir or self.work / "secrets").resolve())
        self.layout = Layout(secrets=self.secrets if tls else None, auth=auth, isolation=isolation,
                             bind_host="127.0.0.1", superlink_host="127.0.0.1",
                             node_host=lambda node: "127.0.0.1",
                             database=str(self.work / "state" / "state.db") if persist_state else "")
        self.procs: dict[str, subprocess.Popen] = {}
        self._log_start: dict[str, int] = {}  # where each process's current start begins in its log
        self.cli_env = flwr_env(self.work / "homes" / "cli")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.fleet.superlink_port}"

    def log_path(self, name: str) -> Path:
        return self.work / "logs" / f"{name}.log"

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.log_path(name)
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    # --- processes -----------------------------------------------------------------------------

    def _spawn(self, name: str, exe: str, args: list[str]) -> subprocess.Popen:
        if name in self.procs and self.procs[name].poll() is None:
            raise FleetError(f"{name} is already running (pid {self.procs[name].pid})")
        home = self.work / "homes" / name  # own FLWR_HOME: installed FABs never collide
        home.mkdir(parents=True, exist_ok=True)
        self.log_path(name).parent.mkdir(parents=True, exist_ok=True)
        env = flwr_env(home)
        with open(self.log_path(name), "ab") as log:
            self._log_start[name] = log.tell()
            # own session: a Ctrl-C in the terminal reaches the launcher, which stops them in order
            proc = subprocess.Popen([exe, *args], stdout=log, stderr=subprocess.STDOUT, env=env,
                                    cwd=self.work, start_new_session=True)
        self.procs[name] = proc
        return proc

    def start(self, timeout: float = 120.0) -> "LocalFleet":
        """Secrets -> SuperLink -> register keys -> SuperNodes; returns once every node is online."""
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        if self.layout.secrets is not None:
            generate(self.secrets.root, [n.name for n in self.fleet.nodes],
                     superexec=secret_names(self.fleet) if self.layout.isolation == "process" else [])
        if self.layout.database:
            Path(self.layout.database).parent.mkdir(parents=True, exist_ok=True)
        self._spawn("superlink", "flower-superlink", superlink_args(self.fleet, self.layout))
        if self.layout.isolation == "process":
            self._spawn("superexec-serverapp", "flower-superexec", superexec_args(self.fleet, self.layout))
        scheme = "http" if self.layout.secrets is None else "https"
        ca = str(self.secrets.ca_cert) if self.layout.secrets is not None else None
        self._wait(lambda: healthy(f"{scheme}://{self.address}/health", ca), "superlink", deadline,
                   [name for name in self.procs])
        write_connection(Path(self.cli_env["FLWR_HOME"]), CONNECTION, self.address,
                         self.secrets.ca_cert if self.layout.secrets is not None else None, replace=True)
        for node in self.fleet.nodes:
            if self.layout.auth:
                register_node(self.secrets.node_pub(node.name), CONNECTION, self.cli_env, self.app_dir)
            self.start_node(node)
        self.wait_nodes([n.name for n in self.fleet.nodes], deadline - time.monotonic())

    def wait_nodes(self, names: list[str], timeout: float = 60.0) -> None:
        """Wait until these SuperNodes are activated by the SuperLink (a refused one exits: FleetError)."""
        watch = [p for name in names for p in (name, f"superexec-{name}") if p in self.procs]
        self._wait(lambda: all(self.node_id(name) is not None for name in names), f"SuperNodes {names}",
                   time.monotonic() + timeout, watch)

    def start_node(self, node: Node, key: str | None = None, extra_config: str = "") -> subprocess.Popen:
        """Start one SuperNode (and its SuperExec in process isolation). `key` overrides the
        node's authentication key name (e.g. an unregistered one, to see it refused);
        `extra_config` is appended to its --node-config."""
        layout = self.layout
        args = supernode_args(self.fleet, node, layout)
        if key is not None:
            flag = args.index("--auth-supernode-private-key")
            args[flag + 1] = str(self.secrets.node_key(key))
        if extra_config:
            flag = args.index("--node-config")
            args[flag + 1] += " " + extra_config
        proc = self._spawn(node.name, "flower-supernode", args)
        if layout.isolation == "process":
            self._spawn(f"superexec-{node.name}", "flower-superexec", superexec_args(self.fleet, layout, node))
        return proc

    def _wait(self, ready, what: str, deadline: float, watch: list[str]) -> None:
        """Poll `ready` until the deadline; fail at once if a watched process exits."""
        while not ready():
            dead = [name for name in watch if self.procs[name].poll() is not None]
            if dead:
                tails = "\n".join(f"--- {n} (exit {self.procs[n].returncode}):\n{self.log_tail(n)}" for n in dead)
                raise FleetError(f"fleet process(es) {dead} exited while waiting for {what}:\n{tails}")
            if time.monotonic() > deadline:
                raise FleetError(f"timed out waiting for {what}; logs in {self.work / 'logs'}")
            time.sleep(0.5)

    def node_id(self, name: str) -> int | None:
        """The id the SuperLink gave this SuperNode in its current start (None until activated:
        Flower logs the id once activation succeeded)."""
        if name not in self._log_start or not self.log_path(name).exists():
            return None
        with open(self.log_path(name), "rb") as log:
            log.seek(self._log_start[name])
            ids = re.findall(rb"SuperNode ID: (\d+)", log.read())
        return int(ids[-1]) if ids else None

    def online_nodes(self) -> list[str]:
        """Node ids the SuperLink lists as online."""
        done = flwr_cli("supernode", "list", CONNECTION, "--format", "json", env=self.cli_env, cwd=self.app_dir)
        try:
            nodes = json.loads(done.stdout).get("nodes", [])
        except ValueError:
            return []
        return [str(n["node-id"]) for n in nodes if n.get("status") == "online"]

    # --- runs ----------------------------------------------------------------------------------

    def run(self, overrides: dict, *, timeout: float | None = None, stream: bool = False,
            app_dir: Path | None = None, force: bool = False) -> SimulationRun:
        """Validate, take the run folder (pin_run_config; `force` starts an unfinished run of another config
        there over), `flwr run` on this fleet, wait for the final status, let the folder go. `app_dir` swaps
        the app (e.g. a test ClientApp); the run's status, not an exit code, says whether it worked."""
        overrides = dict(overrides)
        overrides.setdefault("num-clients", self.fleet.num_partitions)
        if overrides["num-clients"] != self.fleet.num_partitions:
            raise FleetError(f"num-clients={overrides['num-clients']} but the fleet's SuperNodes split the "
                             f"data into num-partitions={self.fleet.num_partitions}")
        cfg = check_run_config(overrides)
        # each node's ClientApp and the ServerApp share this machine's cores
        threads = max(1, (os.cpu_count() or 1) // len(self.fleet.nodes))
        run_config, run_dir = pin_run_config(cfg, overrides, threads=threads, force=force)
        try:
            run = follow_run(Path(app_dir or self.app_dir), run_config, [], env=self.cli_env, run_dir=run_dir,
                             superlink=CONNECTION, stream=stream, timeout=timeout)
        finally:
            release_run_folder(run_dir)
        # the ServerApp's output goes to the SuperLink, not to a process log: keep it beside the others
        self.log_path(f"serverapp-run-{run.run_id}").write_text(strip_ansi(run.log_text))
        return run

    # --- faults --------------------------------------------------------------------------------

    def _node_pids(self, name: str) -> list[int]:
        roots = [self.procs[p].pid for p in (name, f"superexec-{name}") if p in self.procs]
        return [pid for root in roots for pid in process_tree(root)]

    def node_busy(self, name: str) -> bool:
        """Whether the node is running a ClientApp, i.e. has received an instruction."""
        return any("flwr-clientapp" in cmdline(pid) for pid in self._node_pids(name))

    def kill_node(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Kill a SuperNode and everything it started (SIGKILL: a crash, no goodbye to the SuperLink)."""
        for pid in self._node_pids(name):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        for proc_name in (name, f"superexec-{name}"):
            if proc_name in self.procs:
                self.procs[proc_name].wait(timeout=10)

    def stop_node(self, name: str) -> None:
        """Stop a SuperNode gracefully (it deactivates itself, so it can rejoin at once)."""
        for proc_name in (f"superexec-{name}", name):
            if proc_name in self.procs and self.procs[proc_name].poll() is None:
                kill_tree(self.procs[proc_name].pid)
                self.procs[proc_name].wait(timeout=10)

    def kill_node_when_busy(self, name: str, timeout: float = 300.0) -> float | None:
        """Wait until the node has received its instruction, then kill it. Returns when (monotonic)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.node_busy(name):
                self.kill_node(name)
                return time.monotonic()
            time.sleep(0.2)
        return None

    # --- stop ----------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every process this fleet started, SuperNodes first, by PID (TERM, then KILL)."""
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                kill_tree(proc.pid, grace=10.0)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self.procs.clear()

    def pids(self) -> list[int]:
        """Every live process of this fleet (roots and descendants)."""
        return [pid for proc in self.procs.values() if proc.poll() is None for pid in process_tree(proc.pid)]

    def __enter__(self) -> "LocalFleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
