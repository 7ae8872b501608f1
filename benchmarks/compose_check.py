"""docker-compose started for real, with TLS and node authentication: image sizes and build time, the fleet up,
two smoke runs, a run that loses a SuperNode container and completes on quorum, and `down`. One command, end to end:

    python -m benchmarks.compose_check --data-dir ../shared/data      # as root (or a docker-group user)

1. engine: `docker` and `docker-compose` (v1) or `docker compose` (v2) must be installed
   (Debian: `apt-get install -y docker.io docker-compose debootstrap`, or `--install-engine`);
   dockerd is started (log in /tmp/oneshot-fl-dockerd.log) if it is not running
2. images: `deploy/build-images.sh --local` (no registry: Debian base + stand-ins for Flower's
   images, the torch / torchvision versions pyproject.toml pins, checked inside the image) or
   `--registry` (Flower's published images);
   `--no-build` uses the images already there
3. the committed docker-compose.yml must be what deploy/fleet.toml renders (`compose --check`)
4. fresh secrets, SuperLink state and runs folder in deploy/work/compose-check/ (git-ignored), handed
   to the containers' uid 49999; `up -d superlink`, register the three node keys through the
   SuperLink's Control API on 127.0.0.1, `up -d` the SuperNodes and SuperExecs, wait until all three
   nodes are online; the published ports are read back from the engine (only 127.0.0.1:<superlink>)
5. a smoke FedAvg and a smoke FedHydra run (`preset='smoke'`, the data folder mounted read-only);
   result.json read from the mounted runs folder
6. a FedAvg run with min-clients=2 during which one SuperNode container is killed (SIGKILL) as soon
   as its SuperExec runs the ClientApp: the run must complete on quorum with that node in
   result.json's `missing`
7. `down`; no container of the project may be left

Writes benchmarks/results/compose_check.json and compose_check.md (image sizes, build time, time to
first result, each run's status, accuracy and time). Exit status 0 when every step passed.
Cost on the 2-core development machine: ~5 min to build the images locally (once), then ~7 min for the fleet and
its three runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

from oneshot_fl.config import PROJECT_ROOT
from launcher.deploy.compose import (COMPOSE_FILE, PUBLISH_HOST, RUNS_ENV, SECRETS_ENV, STATE_ENV,
                                       published_ports)
from launcher.deploy.fleet import Fleet, secret_names
from launcher.deploy.local import register_node, write_connection
from launcher.deploy.secrets import SecretFiles, generate
from launcher.launch import check_run_config, flwr_cli, flwr_env, follow_run, pin_run_config

RESULTS = PROJECT_ROOT / "benchmarks" / "results"
WORK = PROJECT_ROOT / "deploy" / "work" / "compose-check"
PROJECT = "oneshot-fl-check"  # compose project name: the check's containers never mix with an operator's
CONNECTION = "compose-check"
APP_UID = 49999  # the user the Flower images run as
SMOKE = {"preset": "smoke", "dataset": "mnist", "download": False, "threads": 1}


def log(msg: str) -> None:
    print(f"[compose-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sh(*cmd: str, check: bool = True, env: dict | None = None, timeout: float = 600,
       capture: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, capture_output=capture, text=True, env=env, timeout=timeout, cwd=PROJECT_ROOT)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done


# --- engine ------------------------------------------------------------------------------------

def ensure_engine(install: bool) -> dict:
    if install and not (shutil.which("docker") and (shutil.which("docker-compose") or compose_v2())):
        log("installing docker.io docker-compose debootstrap with apt")
        sh("apt-get", "update", timeout=900)
        sh("apt-get", "install", "-y", "docker.io", "docker-compose", "debootstrap", timeout=1800,
           env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if not shutil.which("docker"):
        raise SystemExit("no docker CLI: apt-get install -y docker.io docker-compose debootstrap "
                         "(or run with --install-engine)")
    if sh("docker", "info", check=False).returncode != 0:
        dockerd = shutil.which("dockerd")
        if not dockerd:
            raise SystemExit("the Docker daemon is not running and dockerd is not installed")
        log("starting dockerd (log: /tmp/oneshot-fl-dockerd.log)")
        with open("/tmp/oneshot-fl-dockerd.log", "ab") as out:
            subprocess.Popen([dockerd], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        for _ in range(120):
            if sh("docker", "info", check=False).returncode == 0:
                break
            time.sleep(0.5)
        else:
            raise SystemExit("dockerd did not come up; see /tmp/oneshot-fl-dockerd.log")
    return {"docker": sh("docker", "version", "--format", "{{.Server.Version}}").stdout.strip()}


def compose_v2() -> bool:
    return shutil.which("docker") is not None and sh("docker", "compose", "version", check=False).returncode == 0


def compose_command(choice: str) -> list[str]:
    if choice == "v2" or (choice == "auto" and compose_v2()):
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise SystemExit("neither `docker compose` (v2) nor `docker-compose` (v1) is installed")


# --- images ------------------------------------------------------------------------------------

def build_images(mode: str) -> dict:
    start = time.monotonic()
    done = sh(str(PROJECT_ROOT / "deploy" / "build-images.sh"), f"--{mode}", timeout=3600, capture=True)
    sys.stderr.write(done.stderr[-2000:])
    images, steps = {}, {}
    for line in done.stdout.splitlines():
        if m := re.match(r"image (\S+) size_bytes=(\d+) seconds=(\d+)", line):
            images[m[1]] = {"size_mb": round(int(m[2]) / 1e6, 1), "build_seconds": int(m[3])}
        elif m := re.match(r"step (\S+) seconds=(\d+)", line):
            steps[m[1]] = int(m[2])  # debootstrap + import of the Debian base (--local, first time only)
    return {"mode": mode, "seconds": round(time.monotonic() - start, 1), "images": images, "base_steps_s": steps,
            "summary": [line for line in done.stdout.splitlines() if line.startswith("images ")]}


def image_sizes() -> dict:
    from launcher.deploy.compose import APP_IMAGE, flwr_version

    names = [f"flwr/{role}:{flwr_version()}" for role in ("superlink", "supernode", "superexec")] + [APP_IMAGE]
    out = {}
    for name in names:
        done = sh("docker", "image", "inspect", "-f", "{{.Size}}", name, check=False)
        out[name] = {"size_mb": round(int(done.stdout) / 1e6, 1)} if done.returncode == 0 else {"missing": True}
    return out


def pinned_versions() -> dict[str, str]:
    """The torch / torchvision / flwr versions pyproject.toml pins: what the tests ran with."""
    import tomllib

    deps = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {}
    for dep in deps:
        name, _, version = dep.partition("==")
        name = name.split("[")[0]
        if name in ("torch", "torchvision", "flwr") and version:
            pins[name] = version
    return pins


def versions_match(pinned: dict[str, str], found: dict[str, str]) -> bool:
    """Every pinned version is the one found, up to a local label (torch 2.14.1+cpu is torch 2.14.1)."""
    return all(found.get(name, "").split("+")[0] == version for name, version in pinned.items())


def image_versions(image: str) -> dict:
    """The torch / torchvision / flwr versions inside the app image (a throwaway container) against the pins."""
    code = ("import json, flwr, torch, torchvision; print(json.dumps({'torch': torch.__version__, "
            "'torchvision': torchvision.__version__, 'flwr': flwr.__version__}))")
    done = sh("docker", "run", "--rm", "--entrypoint", "python", image, "-c", code, check=False, timeout=300)
    pinned = pinned_versions()
    if done.returncode != 0:
        return {"pinned": pinned, "found": {}, "match": False, "error": (done.stderr or done.stdout)[-500:]}
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return {"pinned": pinned, "found": found, "match": versions_match(pinned, found)}


# --- the fleet ---------------------------------------------------------------------------------

class ComposeFleet:
    def __init__(self, compose: list[str], data_dir: Path, fleet: Fleet):
        self.fleet = fleet
        self.secrets = SecretFiles(WORK / "secrets")
        self.state, self.runs, self.home = WORK / "state", WORK / "runs", WORK / "flwr-home"
        self.compose = [*compose, "-p", PROJECT, "-f", str(COMPOSE_FILE)]
        self.env = {**os.environ, SECRETS_ENV: str(self.secrets.root), STATE_ENV: str(self.state),
                    RUNS_ENV: str(self.runs), "ONESHOT_FL_DATA_DIR": str(data_dir)}
        self.cli_env = flwr_env(self.home)

    def dc(self, *args: str, check: bool = True, timeout: float = 600) -> subprocess.CompletedProcess:
        return sh(*self.compose, *args, env=self.env, check=check, timeout=timeout)

    def prepare(self) -> None:
        """Fresh state and runs, fresh secrets; private files and writable folders for uid 49999."""
        self.down(quiet=True)
        for path in (self.state, self.runs, self.home, self.secrets.root):
            shutil.rmtree(path, ignore_errors=True)
        generate(self.secrets.root, [n.name for n in self.fleet.nodes], superexec=secret_names(self.fleet))
        for path in (self.state, self.runs):
            path.mkdir(parents=True)
            os.chown(path, APP_UID, APP_UID)
        private = [self.secrets.server_key, *(self.secrets.node_key(n.name) for n in self.fleet.nodes),
                   *(self.secrets.superexec_secret(s) for s in secret_names(self.fleet))]
        if os.geteuid() == 0:
            for path in private:
                os.chown(path, APP_UID, APP_UID)  # 0600, readable by the containers' user only
        os.chmod(self.secrets.root, 0o755)  # compose bind-mounts single files from it

    def container(self, service: str) -> str:
        return self.dc("ps", "-q", service).stdout.strip()

    def health(self, service: str) -> str:
        cid = self.container(service)
        if not cid:
            return "absent"
        done = sh("docker", "inspect", "-f", "{{if .State.Health}}{{.State.Health.Status}}{{else}}{{.State.Status}}{{end}}",
                  cid, check=False)
        return done.stdout.strip()

    def wait(self, what: str, ready, timeout: float) -> float:
        start = time.monotonic()
        while not ready():
            if time.monotonic() - start > timeout:
                raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.logs()}")
            time.sleep(1.0)
        return time.monotonic() - start

    def logs(self, tail: int = 40) -> str:
        return self.dc("logs", "--no-color", "--tail", str(tail), check=False).stdout[-8000:]

    def online(self) -> list[str]:
        done = flwr_cli("supernode", "list", CONNECTION, "--format", "json", env=self.cli_env, cwd=PROJECT_ROOT)
        try:
            nodes = json.loads(done.stdout).get("nodes", [])
        except ValueError:
            return []
        return [str(n["node-id"]) for n in nodes if n.get("status") == "online"]

    def node_id(self, service: str) -> int | None:
        out = sh("docker", "logs", self.container(service), check=False).stdout
        out += sh("docker", "logs", self.container(service), check=False).stderr
        ids = re.findall(r"SuperNode ID: (\d+)", out)
        return int(ids[-1]) if ids else None

    def up(self) -> dict:
        timings = {}
        start = time.monotonic()
        self.dc("up", "-d", "superlink")
        timings["superlink_healthy_s"] = round(self.wait("superlink healthy", lambda: self.health("superlink") == "healthy", 180), 1)
        write_connection(self.home, CONNECTION, f"127.0.0.1:{self.fleet.superlink_port}", self.secrets.ca_cert,
                         replace=True)
        registered = {n.name: register_node(self.secrets.node_pub(n.name), CONNECTION, self.cli_env, PROJECT_ROOT)
                      for n in self.fleet.nodes}
        self.dc("up", "-d", "--no-build")
        timings["nodes_online_s"] = round(self.wait(
            "3 SuperNodes online", lambda: len(self.online()) >= len(self.fleet.nodes), 300), 1)
        timings["up_s"] = round(time.monotonic() - start, 1)
        return {"timings": timings, "registered": registered}

    def ports(self) -> dict:
        """What the engine actually published, per service: `docker port` lines."""
        out = {}
        for service in ["superlink", *(n.name for n in self.fleet.nodes), "superexec-serverapp"]:
            cid = self.container(service)
            lines = sh("docker", "port", cid, check=False).stdout.split("\n") if cid else []
            out[service] = sorted(line.strip() for line in lines if line.strip())
        return out

    def clientapp_running(self, node: str) -> bool:
        cid = self.container(f"superexec-{node}")
        return bool(cid) and "flwr-clientapp" in sh("docker", "top", cid, check=False).stdout

    def down(self, quiet: bool = False) -> list[str]:
        self.dc("down", "--remove-orphans", "-t", "20", check=not quiet, timeout=300)
        left = sh("docker", "ps", "-a", "-q", "--filter", f"label=com.docker.compose.project={PROJECT}").stdout.split()
        return left

    # --- runs ----------------------------------------------------------------------------------

    def run(self, overrides: dict, timeout: float = 1200) -> dict:
        overrides = {**SMOKE, "num-clients": self.fleet.num_partitions, **overrides}
        cfg = check_run_config(overrides)
        run_config, rel = pin_run_config(cfg, overrides, threads=1, paths=False)
        run_dir = self.runs / rel
        run = follow_run(PROJECT_ROOT, run_config, [], env=self.cli_env, run_dir=run_dir, superlink=CONNECTION,
                         stream=False, timeout=timeout)
        record = {"run_id": run.run_id, "run_name": rel.name, "config": overrides, "status": run.status,
                  "status_details": run.status_details, "seconds": round(run.seconds, 1)}
        path = run_dir / "result.json"
        if path.is_file():
            result = json.loads(path.read_text())
            record.update(accuracy=result["global"]["accuracy"],
                          clients=sorted(c["partition_id"] for c in result["clients"]),
                          rejected=result["rejected"], missing=result.get("missing", []),
                          missing_nodes=result.get("missing_nodes", []),
                          result_json=str(path.relative_to(PROJECT_ROOT)))
        else:
            record["log_tail"] = run.log_text[-3000:]
        return record


def kill_during_training(fleet: ComposeFleet, victim: str, overrides: dict, delay: float) -> dict:
    """Submit a run with min-clients=2; SIGKILL `victim`'s SuperNode container `delay` seconds after its
    SuperExec started the ClientApp (it has received its instruction and is loading data / training);
    the run must complete without it."""
    node_id = fleet.node_id(victim)
    killed: dict = {}
    stop = threading.Event()

    def killer():
        start = time.monotonic()
        while not stop.is_set() and time.monotonic() - start < 600:
            if fleet.clientapp_running(victim):
                seen = time.monotonic()
                while time.monotonic() - seen < delay and fleet.clientapp_running(victim):
                    time.sleep(0.5)
                if not fleet.clientapp_running(victim):
                    killed["note"] = f"the ClientApp ended within {delay:.0f}s; killed after it"
                cid = fleet.container(victim)
                sh("docker", "kill", "--signal", "KILL", cid)
                killed.update(after_submit_s=round(time.monotonic() - start, 1), container=cid[:12],
                              after_clientapp_start_s=round(time.monotonic() - seen, 1))
                return
            time.sleep(0.3)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        record = fleet.run(overrides)
    finally:
        stop.set()
        thread.join()
    record["victim"] = {"service": victim, "node_id": node_id, **killed}
    if killed:
        cid = killed["container"]
        state = sh("docker", "inspect", "-f", "{{.State.Status}} restarts={{.RestartCount}}", cid, check=False)
        record["victim"]["container_after_run"] = state.stdout.strip()
    record["passed"] = bool(killed) and record["status"] == "finished:completed" and \
        node_id in record.get("missing_nodes", [])
    return record


# --- record ------------------------------------------------------------------------------------

def write_record(record: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "compose_check.json").write_text(json.dumps(record, indent=2) + "\n")
    lines = [f"# docker-compose check ({record['date']})", "",
             f"`python -m benchmarks.compose_check {' '.join(record['argv'])}`: **{'PASSED' if record['passed'] else 'FAILED'}**. "
             f"Machine: {record['machine']['cpus']} CPUs, Docker {record['engine'].get('docker')}, "
             f"`{' '.join(record['compose_command'])}` ({record['compose_version']}).", ""]
    build = record.get("build") or {}
    lines += ["## Images", "", "| image | size (MB) | build (s) |", "| --- | ---: | ---: |"]
    for name, info in record["images"].items():
        secs = (build.get("images", {}).get(name) or {}).get("build_seconds", "-")
        lines.append(f"| `{name}` | {info.get('size_mb', 'missing')} | {secs} |")
    versions = record.get("image_versions")
    if versions:
        lines += ["", f"Inside the app image: {versions.get('found') or versions.get('error')}; pinned in "
                      f"pyproject.toml: {versions['pinned']}: **{'match' if versions['match'] else 'MISMATCH'}**."]
    if build:
        lines += ["", f"Build mode `{build['mode']}`, {build['seconds']} s in all ({'; '.join(build['summary'])}); "
                      f"Debian base: {build.get('base_steps_s') or 'already there, not rebuilt'}; "
                      f"environment: {record.get('build_env') or 'defaults'}."]
    lines += ["", "## Fleet", "",
              f"- `up` (SuperLink healthy, keys registered, 3 SuperNodes online): {record['up']['timings']}",
              f"- published ports as the engine reports them: {record['published_ports']}",
              f"- time to first result (from `up` to the first run's result.json): {record.get('time_to_first_result_s')} s",
              "", "## Runs", "", "| run | status | accuracy | clients | missing | seconds |",
              "| --- | --- | ---: | --- | --- | ---: |"]
    for name, run in record["runs"].items():
        acc = f"{run['accuracy']:.4f}" if "accuracy" in run else "-"
        missing = ", ".join(f"node {m.get('node_id')}: {m.get('reason')}" for m in run.get("missing", [])) or "none"
        lines.append(f"| {name} | {run['status']} | {acc} | {run.get('clients', '-')} | {missing} | {run['seconds']} |")
    kill = record["runs"].get("fedavg-kill", {}).get("victim")
    if kill:
        lines += ["", f"Killed (SIGKILL): `{kill['service']}` (node {kill.get('node_id')}) {kill.get('after_submit_s')} s after "
                      f"submission, {kill.get('after_clientapp_start_s')} s after its ClientApp started "
                      f"{kill.get('note', '')}; container afterwards: {kill.get('container_after_run')}."]
    lines += ["", f"`down`: containers left: {record['containers_left']}."]
    if record.get("error"):
        lines += ["", "## Error", "", "```", record["error"][-3000:], "```"]
    (RESULTS / "compose_check.md").write_text("\n".join(lines) + "\n")


def _portable(arg: str) -> str:
    """A command-line argument as the committed record shows it: paths relative to the checkout."""
    path = Path(arg)
    return os.path.relpath(path.resolve(), PROJECT_ROOT) if path.is_absolute() and path.exists() else arg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.compose_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default=os.environ.get("ONESHOT_FL_DATA_DIR", ""),
                        help="datasets folder (needs mnist/), mounted read-only (default $ONESHOT_FL_DATA_DIR)")
    parser.add_argument("--build", choices=("local", "registry", "none"), default="local",
                        help="local: no registry (default); registry: Flower's images; none: use what is there")
    parser.add_argument("--compose", choices=("auto", "v1", "v2"), default="auto",
                        help="docker compose v2 if installed (auto), else docker-compose v1")
    parser.add_argument("--install-engine", action="store_true", help="apt-get install docker.io docker-compose debootstrap")
    parser.add_argument("--victim", default="supernode-1", help="SuperNode killed during the third run")
    parser.add_argument("--kill-delay", type=float, default=10.0,
                        help="seconds between the victim's ClientApp start and the kill (default 10)")
    parser.add_argument("--kill-run", default="local.epochs=3",
                        help="extra run config of the kill run (FedAvg, smoke, min-clients=2), 'k=v ...'")
    parser.add_argument("--no-record", action="store_true", help="do not write benchmarks/results/compose_check.*")
    args = parser.parse_args(argv)
    if not args.data_dir or not (Path(args.data_dir) / "mnist").is_dir():
        parser.error(f"--data-dir {args.data_dir!r} has no mnist/ folder")
    data_dir = Path(args.data_dir).resolve()

    record: dict = {"date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), "argv": [_portable(a) for a in (argv or sys.argv[1:])],
                    "machine": {"cpus": os.cpu_count(), "platform": platform.platform()}, "passed": False,
                    "runs": {}, "containers_left": None,
                    "build_env": {k: os.environ[k] for k in ("REBUILD_BASE", "WHEELS_DIR", "TORCH_VERSION",
                                                               "TORCH_INDEX_URL", "DEBIAN_MIRROR") if k in os.environ}}
    fleet = None
    try:
        record["engine"] = ensure_engine(args.install_engine)
        compose = compose_command(args.compose)
        record["compose_command"] = compose
        record["compose_version"] = sh(*compose, "version", "--short", check=False).stdout.strip() or \
            sh(*compose, "version").stdout.splitlines()[0]
        if sh(sys.executable, "-m", "launcher.deploy", "compose", "--check", check=False).returncode != 0:
            raise RuntimeError("docker-compose.yml is not what deploy/fleet.toml renders: "
                               "python -m launcher.deploy compose")
        if args.build != "none":
            log(f"building images ({args.build}); this takes minutes")
            record["build"] = build_images(args.build)
        record["images"] = image_sizes()
        from launcher.deploy.compose import APP_IMAGE

        record["image_versions"] = image_versions(APP_IMAGE)
        log(f"versions in {APP_IMAGE}: {record['image_versions']}")
        if not record["image_versions"]["match"]:
            raise RuntimeError(f"{APP_IMAGE} does not run the pinned versions: {record['image_versions']}")
        fleet = ComposeFleet(compose, data_dir, Fleet.load())
        fleet.prepare()
        sh(*fleet.compose, "config", "-q", env=fleet.env)  # the file as this compose version reads it
        log("up: SuperLink, register keys, SuperNodes + SuperExecs")
        up_start = time.time()
        record["up"] = fleet.up()
        record["published_ports"] = fleet.ports()
        declared = published_ports(__import__("yaml").safe_load(COMPOSE_FILE.read_text()))
        record["declared_ports"] = declared
        exposed = [p for lines in record["published_ports"].values() for p in lines
                   if not p.split("-> ")[-1].startswith(f"{PUBLISH_HOST}:")]
        if exposed:
            raise RuntimeError(f"ports published beyond {PUBLISH_HOST}: {exposed}")
        for method in ("fedavg", "fedhydra"):
            log(f"run: smoke {method}")
            record["runs"][method] = fleet.run({"method": method})
            if "time_to_first_result_s" not in record and record["runs"][method].get("result_json"):
                # from `up -d superlink` to the moment the first result.json was written
                written = (PROJECT_ROOT / record["runs"][method]["result_json"]).stat().st_mtime
                record["time_to_first_result_s"] = round(written - up_start, 1)
            log(f"  {method}: {record['runs'][method]['status']} accuracy {record['runs'][method].get('accuracy')}")
        log(f"run: fedavg, min-clients=2, {args.victim} killed during local training")
        from launcher.launch import parse_overrides

        record["runs"]["fedavg-kill"] = kill_during_training(
            fleet, args.victim, {"method": "fedavg", "min-clients": 2, **parse_overrides([args.kill_run])},
            args.kill_delay)
        kill = record["runs"]["fedavg-kill"]
        log(f"  kill run: {kill['status']}, missing {kill.get('missing_nodes')}, victim {kill['victim']}")
        ok = all(record["runs"][m]["status"] == "finished:completed" for m in ("fedavg", "fedhydra")) and kill["passed"]
        record["passed"] = ok
    except Exception as exc:  # the record says what failed; the fleet still goes down
        import traceback

        record["error"] = traceback.format_exc()
        if fleet is not None:
            record["error"] += "\n--- compose logs ---\n" + fleet.logs()
        log(f"FAILED: {exc}")
    finally:
        if fleet is not None:
            log("down")
            left = fleet.down(quiet=True)
            record["containers_left"] = len(left)
            if left:
                record["passed"] = False
    record.setdefault("images", {})
    record.setdefault("engine", {})
    record.setdefault("compose_command", [])
    record.setdefault("compose_version", "")
    record.setdefault("up", {"timings": {}})
    record.setdefault("published_ports", {})
    if not args.no_record:
        write_record(record)
        log(f"record: {RESULTS / 'compose_check.json'}, {RESULTS / 'compose_check.md'}")
    log("PASSED" if record["passed"] else "FAILED")
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
