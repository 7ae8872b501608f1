"""`python -m launcher.deploy` (also `oneshot-fl-deploy`): run oneshot-fl as a real Flower deployment.

  secrets   [--out deploy/secrets] [--dns NAME] [--ip ADDR]   CA, SuperLink cert, node keys, SuperExec secrets
  run       -c "method='fedavg' ..." [--isolation process]    fleet on this machine: start, run, check, stop
  up        [--isolation process]                             fleet on this machine until Ctrl-C
  submit    --superlink NAME -c "..."                         flwr run to a running SuperLink + status check
  connect   NAME HOST:PORT --ca deploy/secrets/ca.crt         add a [superlink.NAME] connection for the CLI
  register  NAME KEY.pub ...                                  register SuperNode public keys
  commands  [--superlink-host HOST]                           every process's command line, grouped by machine, paths
                                                              relative to the deploy bundle each machine copies
  compose   [--check]                                         render docker-compose.yml from deploy/fleet.toml
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import re
import shlex
import sys
import time
import tomllib
from pathlib import Path

from oneshot_fl.config import PROJECT_ROOT, ConfigError
from oneshot_fl.errors import RunFolderTaken
from launcher.cli import bounded
from launcher.deploy.compose import COMPOSE_FILE, render
from launcher.deploy.fleet import (FLEET_FILE, ISOLATIONS, Fleet, FleetError, Layout, secret_names, superexec_args,
                                   superlink_args, supernode_args)
from launcher.deploy.local import CONNECTION, LocalFleet, register_node, write_connection
from launcher.deploy.secrets import DEFAULT_DNS, DEFAULT_IPS, SUPERLINK_SECRET, SecretFiles, generate, server_sans
from launcher.launch import RunFailed, check_run_config, flwr_env, follow_run, parse_overrides, pin_run_config
from launcher.shutdown import Terminated, quiet_when_output_closes, sigterm_unwinds
from oneshot_fl.run_folder import release_run_folder

DEFAULT_SECRETS = PROJECT_ROOT / "deploy" / "secrets"
DEFAULT_WORK = PROJECT_ROOT / "deploy" / "work"


def ip_address(text: str) -> str:
    """argparse type: an IPv4 / IPv6 address, refused before any file is written."""
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IPv4 or IPv6 address") from None


def host_name(text: str) -> str:
    """argparse type: a DNS name (RFC 1123 labels, the last one not all digits) or an IP address."""
    label = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    if len(text) <= 253 and re.fullmatch(rf"{label}(\.{label})*", text) and not text.rsplit(".", 1)[-1].isdigit():
        return text
    try:
        return ip_address(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a host name nor an IP address") from None


def _fleet(args):
    fleet = Fleet.load(Path(args.fleet))
    if getattr(args, "port", None):
        fleet = dataclasses.replace(fleet, superlink_port=args.port)
    return fleet


def _local(args):
    return LocalFleet(_fleet(args), Path(args.work), tls=not args.insecure, auth=not args.insecure,
                      isolation=args.isolation, secrets_dir=Path(args.secrets))


def cmd_secrets(args) -> int:
    fleet = _fleet(args)
    report = generate(Path(args.out), [n.name for n in fleet.nodes], superexec=secret_names(fleet),
                      dns=DEFAULT_DNS + tuple(args.dns), ips=DEFAULT_IPS + tuple(args.ip), overwrite=args.force)
    print(f"secrets in {args.out}: created {report['created'] or 'nothing'}; kept {report['kept'] or 'nothing'}")
    return 0


def cmd_run(args) -> int:
    overrides = parse_overrides(args.run_config)
    with _local(args) as fleet:
        print(f"[oneshot-fl] fleet up: SuperLink {fleet.address}, {len(fleet.fleet.nodes)} SuperNodes, "
              f"logs in {fleet.work / 'logs'}", flush=True)
        run = fleet.run(overrides, timeout=args.timeout, stream=not args.quiet, force=args.force)
    return _report(run)


def _report(run) -> int:
    if not run.ok:
        print(f"[oneshot-fl] run {run.run_id} ended with status {run.status}: {run.status_details}", file=sys.stderr)
        return 1
    result = run.result()
    print(f"[oneshot-fl] run {run.run_id} completed in {run.seconds:.0f}s; results in {run.run_dir}")
    print(f"  global accuracy {result['global']['accuracy']:.4f}; {len(result['clients'])} uploads, "
          f"rejected {result['rejected'] or 'none'}, missing {result.get('missing') or 'none'}")
    return 0


def cmd_up(args) -> int:
    with _local(args) as fleet:
        home = fleet.cli_env["FLWR_HOME"]
        print(f"fleet up: SuperLink {fleet.address}; logs in {fleet.work / 'logs'}\n"
              f"submit from another shell:\n"
              f"  FLWR_HOME={home} {sys.executable} -m launcher.deploy submit --superlink {CONNECTION} "
              f"-c \"method='fedavg'\"\nCtrl-C here (or kill {os.getpid()}) stops every fleet process.", flush=True)
        try:
            while all(p.poll() is None for p in fleet.procs.values()):
                time.sleep(2.0)
        except (KeyboardInterrupt, Terminated):  # Ctrl-C, or `kill <pid>` (see main)
            print("stopping the fleet", flush=True)
        dead = [n for n, p in fleet.procs.items() if p.poll() is not None]
        if dead:
            print(f"fleet process(es) {dead} exited; stopping the rest. Logs: {fleet.work / 'logs'}", file=sys.stderr)
            return 1
    return 0


def cmd_submit(args) -> int:
    overrides = parse_overrides(args.run_config)
    overrides.setdefault("num-clients", _fleet(args).num_partitions)  # one client per partition
    cfg = check_run_config(overrides)
    home = Path(os.environ.get("FLWR_HOME", Path.home() / ".flwr"))
    known_connection(home, args.superlink)
    # data-dir/output-dir are the ServerApp's paths: pinned to this machine's unless it runs elsewhere (then the
    # ServerApp checks its run folder itself: run_folder.serving)
    run_config, run_dir = pin_run_config(cfg, overrides, threads=cfg.threads, paths=not args.remote_paths,
                                         force=args.force)
    env = flwr_env(home)
    try:
        run = follow_run(PROJECT_ROOT, run_config, [], env=env, run_dir=run_dir, superlink=args.superlink,
                         stream=not args.quiet, timeout=args.timeout)
    finally:
        release_run_folder(run_dir)
    if run.ok and args.remote_paths:
        print(f"[oneshot-fl] run {run.run_id} completed; results in <ServerApp output dir>/{run_dir}")
        return 0
    return _report(run)


def known_connection(flwr_home: Path, name: str) -> None:
    """FleetError unless $FLWR_HOME/config.toml has a [superlink.NAME] entry (flwr run's own error is a JSON blob)."""
    path = flwr_home / "config.toml"
    try:
        connections = tomllib.loads(path.read_text()).get("superlink", {}) if path.is_file() else {}
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise FleetError(f"{path} is not valid TOML ({exc}); fix it before submitting") from None
    names = sorted(k for k, v in connections.items() if isinstance(v, dict)) if isinstance(connections, dict) else []
    if name not in names:
        raise FleetError(f"no [superlink.{name}] connection in {path} (known: {', '.join(names) or 'none'}); add it "
                         f"with: oneshot-fl-deploy connect {name} HOST:PORT --ca deploy/secrets/ca.crt")


def cmd_connect(args) -> int:
    home = Path(os.environ.get("FLWR_HOME", Path.home() / ".flwr"))
    path = write_connection(home, args.name, args.address, Path(args.ca) if args.ca else None)
    print(f"added [superlink.{args.name}] -> {args.address} to {path}")
    return 0


def cmd_register(args) -> int:
    home = Path(os.environ.get("FLWR_HOME", Path.home() / ".flwr"))
    known_connection(home, args.superlink)
    # all or none: a missing key found after the first ones were registered would leave a half-registered fleet
    if missing := [key for key in args.keys if not Path(key).is_file()]:
        raise FleetError(f"public key file(s) not found: {', '.join(missing)}; nothing registered")
    env = flwr_env(home)
    for key in args.keys:
        # flwr runs in the checkout: a key path relative to where this command runs must not move with it
        print(f"{key}: {register_node(Path(key).resolve(), args.superlink, env, PROJECT_ROOT)}")
    return 0


BUNDLE = Path(".")  # the commands' view of the secrets: the folder each machine copies its files into


def machine_files(fleet, isolation: str, node=None) -> list[str]:
    """The secrets folder's files one machine needs: the SuperLink's (node None) or a SuperNode's."""
    files = SecretFiles(BUNDLE)
    needed = [files.ca_cert] + ([files.server_cert, files.server_key] if node is None else [files.node_key(node.name)])
    if isolation == "process":
        needed.append(files.superexec_secret(SUPERLINK_SECRET if node is None else node.name))
    return [path.name for path in needed]


def commands_text(fleet, secrets_dir: Path, superlink_host: str, isolation: str) -> str:
    """Every fleet process's command line, grouped by machine. The paths in them are relative to the deploy
    bundle: the folder on each machine holding the files its heading lists (copied from `secrets_dir` here),
    from which its commands run; no path of this machine appears in another machine's commands."""
    local = SecretFiles(secrets_dir)
    # the SuperLink listens on every interface; a SuperNode's plain-HTTP Runtime API stays on loopback
    layout = Layout(secrets=SecretFiles(BUNDLE), auth=True, isolation=isolation, bind_host="0.0.0.0",
                    superlink_host=superlink_host, node_host=lambda n: "127.0.0.1",
                    database="state/state.db", node_bind_host="127.0.0.1")
    lines = [f"# Files come from {secrets_dir} on this machine (python -m launcher.deploy secrets). On every",
             "# machine below, copy the files its heading lists into one folder (its deploy bundle, e.g.",
             "# ~/oneshot-fl-deploy), cd into it and run its commands there: their paths are relative to it.",
             "# ca.key never leaves this machine; each private key goes to its own machine only.", ""]
    everything = [*machine_files(fleet, isolation), *(name for n in fleet.nodes
                                                     for name in machine_files(fleet, isolation, n))]
    if missing := sorted({name for name in everything if not (local.root / name).exists()}):
        lines += [f"# WARNING: not in {secrets_dir} yet: {' '.join(missing)}; create them with: "
                  "python -m launcher.deploy secrets", ""]
    if local.server_cert.exists():
        sans = server_sans(local)
        if not {f"DNS:{superlink_host}", f"IP:{superlink_host}"} & sans:
            lines += [f"# WARNING: the SuperLink certificate does not name {superlink_host} ({sorted(sans)}); "
                      f"re-issue it (keys are kept): python -m launcher.deploy secrets --dns|--ip {superlink_host}",
                      ""]

    def machine(title: str, files: list[str], commands: list[tuple[str, list[str]]]) -> None:
        lines.extend([f"# == {title} ==", f"# copy into its deploy bundle: {' '.join(files)}",
                      *(shlex.join([exe, *argv]) for exe, argv in commands), ""])

    link = [("flower-superlink", superlink_args(fleet, layout))]
    if isolation == "process":
        link.append(("flower-superexec", superexec_args(fleet, layout)))
    machine("SuperLink machine", machine_files(fleet, isolation), link)
    for node in fleet.nodes:
        cmds = [("flower-supernode", supernode_args(fleet, node, layout))]
        if isolation == "process":
            cmds.append(("flower-superexec", superexec_args(fleet, layout, node)))
        machine(f"{node.name}'s machine", machine_files(fleet, isolation, node), cmds)
    keys = [SecretFiles(BUNDLE).node_pub(n.name).name for n in fleet.nodes]
    deploy = ["-m", "launcher.deploy"]  # in the environment oneshot-fl is installed in
    machine("the machine that submits runs ('lab': any connection name)", [local.ca_cert.name, *keys],
            [("python", [*deploy, "connect", "lab", f"{superlink_host}:{fleet.superlink_port}", "--ca",
                         layout.secrets.ca_cert.name]),
             ("python", [*deploy, "register", "lab", *keys])])
    return "\n".join(lines)


def cmd_commands(args) -> int:
    print(commands_text(_fleet(args), Path(args.secrets), args.superlink_host, args.isolation))
    return 0


def cmd_compose(args) -> int:
    text = render(_fleet(args))
    out = Path(args.out or COMPOSE_FILE)
    if args.check:
        if not out.exists() or out.read_text() != text:
            print(f"{out} is out of date with {args.fleet}; run: python -m launcher.deploy compose", file=sys.stderr)
            return 1
        print(f"{out} is up to date")
        return 0
    out.write_text(text)
    print(f"wrote {out}")
    return 0


@quiet_when_output_closes  # `... commands | head`: a quiet exit 141, as SIGPIPE ends a Unix tool
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launcher.deploy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fleet", default=str(FLEET_FILE), help="fleet description (default deploy/fleet.toml)")
    sub = parser.add_subparsers(dest="command", required=True)

    sec = sub.add_parser("secrets", help="generate TLS certificates, node keys and SuperExec secrets")
    sec.add_argument("--out", default=str(DEFAULT_SECRETS))
    sec.add_argument("--dns", action="append", default=[], type=host_name,
                     help="extra DNS SAN for the SuperLink (its host name)")
    sec.add_argument("--ip", action="append", default=[], type=ip_address, help="extra IP SAN for the SuperLink")
    sec.add_argument("--force", action="store_true", help="regenerate everything (registered keys change!)")
    sec.set_defaults(func=cmd_secrets)

    for name, func, text in (("run", cmd_run, "start the fleet here, run once, check the status, stop"),
                             ("up", cmd_up, "start the fleet here and keep it up until Ctrl-C")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--work", default=str(DEFAULT_WORK), help="logs, state, per-process FLWR_HOME")
        p.add_argument("--secrets", default=str(DEFAULT_SECRETS))
        p.add_argument("--isolation", choices=ISOLATIONS, default="subprocess")
        p.add_argument("--port", type=bounded(1, int, hi=65535), default=None,
                       help="SuperLink port (default: the fleet file's)")
        p.add_argument("--insecure", action="store_true", help="no TLS, no node auth (loopback experiments only)")
        p.set_defaults(func=func)
        if name == "run":
            _run_args(p)

    p = sub.add_parser("submit", help="flwr run to a running SuperLink and check the final status")
    p.add_argument("--superlink", required=True, help="connection name in $FLWR_HOME/config.toml")
    p.add_argument("--remote-paths", action="store_true",
                   help="do not pin data-dir/output-dir to this machine's paths (the ServerApp runs elsewhere)")
    _run_args(p)
    p.set_defaults(func=cmd_submit)

    p = sub.add_parser("connect", help="add a SuperLink connection to $FLWR_HOME/config.toml")
    p.add_argument("name")
    p.add_argument("address", help="HOST:PORT of the SuperLink")
    p.add_argument("--ca", help="CA certificate (omit only for an insecure SuperLink)")
    p.set_defaults(func=cmd_connect)

    p = sub.add_parser("register", help="register SuperNode public keys with a SuperLink")
    p.add_argument("superlink", help="connection name")
    p.add_argument("keys", nargs="+")
    p.set_defaults(func=cmd_register)

    p = sub.add_parser("commands", help="print every fleet process's command line")
    p.add_argument("--superlink-host", default="127.0.0.1", type=host_name,
                   help="address the SuperNodes reach the SuperLink at")
    p.add_argument("--secrets", default=str(DEFAULT_SECRETS))
    p.add_argument("--isolation", choices=ISOLATIONS, default="subprocess")
    p.set_defaults(func=cmd_commands)

    p = sub.add_parser("compose", help="render docker-compose.yml from the fleet file")
    p.add_argument("--out", default=None)
    p.add_argument("--check", action="store_true", help="fail if the file differs from what would be rendered")
    p.set_defaults(func=cmd_compose)

    args = parser.parse_args(argv)

    try:
        with sigterm_unwinds():  # SIGTERM stops the fleet processes a command started, as Ctrl-C does
            return args.func(args)
    except RunFolderTaken as exc:  # a run folder in use or finished: refused as oneshot-fl run refuses it
        print(f"oneshot-fl deploy: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, FleetError, FileNotFoundError) as exc:
        print(f"oneshot-fl deploy: {exc}", file=sys.stderr)
        return 2
    except RunFailed as exc:
        print(f"oneshot-fl deploy: {exc}", file=sys.stderr)
        return 1
    except Terminated:
        print("oneshot-fl deploy: terminated (SIGTERM); the processes it started were stopped", file=sys.stderr)
        return 143


def _run_args(p) -> None:
    p.add_argument("-c", "--run-config", action="append", default=[],
                   help="run-config overrides, as for flwr run: \"k=v k2='s'\" or a TOML file; repeatable")
    p.add_argument("--timeout", type=bounded(0.0, inclusive=False), default=None,
                   help="stop the run after this many seconds")
    p.add_argument("--quiet", action="store_true", help="do not stream the run's log")
    p.add_argument("--force", action="store_true",
                   help="with run-name: start the unfinished run in that folder over (its files are removed first)")
