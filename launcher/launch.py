"""Run the app in Flower's simulation engine through a private local SuperLink, and tell the truth.

`flwr run` starts a detached local SuperLink, submits the app and returns 0 whatever happens to
the run. This launcher (a) validates the run config and takes the run folder (its lock: no other
run writes there while this one runs; oneshot_fl/run_folder.py) before anything starts, (b) gives the run a
private FLWR_HOME and free ports so no stale SuperLink is reused, with runtime dependency
installation, telemetry and update checks off, (c) streams the run's log, (d) decides success
from the run's final status, and (e) stops the SuperLink and every process it started, by PID.
Before anything starts, (a) also checks that every data file the run reads is in its data folder
(`check_data_files`; with download=true the missing ones are fetched then, or the launcher stops in one
line), so missing data does not surface ~a minute later in every ClientApp and the ServerApp.
On the local simulation SuperLink, (c) and (d) are Control API requests from this process
(launcher/control_api.py), not `flwr log` / `flwr ls` processes; `flwr run` submits a copy of
the app pruned by its .gitignore (`stage_app`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pathspec
import psutil

from oneshot_fl import provenance
from oneshot_fl import run_folder
from oneshot_fl.config import (DATA_DIR_ENV, PROJECT_ROOT, ConfigError, from_run_config, merge_overrides,  # noqa: F401
                               parse_overrides, resolve_data_dir, resolve_output_dir, run_config_items, toml_value)
from launcher.control_api import LocalControl, echo, strip_ansi
from oneshot_fl.errors import RunFailed  # noqa: F401 (raised here, named by callers)
from oneshot_fl.run_folder import interrupted_message, release_run_folder
from launcher.provenance import launcher_env
from launcher.shutdown import Terminated, sigterm_unwinds

QUIET_ENV = {
    "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_DEDUP_LOGS": "0",
    "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
    # RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO is left at Ray's default (on): a ClientApp given 0 GPUs
    # (--gpus-per-client 0) runs with CUDA_VISIBLE_DEVICES="" and trains on the CPU instead of
    # every simulated client landing on GPU 0; with --gpus-per-client > 0 Ray sets the GPU it
    # assigned. The ServerApp is not a Ray task and always sees the machine's GPUs. Only Ray's
    # FutureWarning about that default changing is silenced:
    "PYTHONWARNINGS": "ignore:Tip:FutureWarning",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}


@dataclass
class SimulationRun:
    run_id: int
    status: str
    status_details: str
    run_dir: Path
    seconds: float
    flwr_home: Path
    log_text: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "finished:completed"

    def result(self) -> dict:
        path = self.run_dir / "result.json"
        if not path.is_file():
            raise RunFailed(f"run {self.run_id} ({self.status}) wrote no {path}")
        return json.loads(path.read_text())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cmdline(pid: int) -> str:
    """A process's command line as one string ("" if it is gone or not readable)."""
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except (psutil.Error, OSError):
        return ""


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants (a snapshot), parents first."""
    try:
        proc = psutil.Process(root)
        return [root, *(child.pid for child in proc.children(recursive=True))]
    except psutil.NoSuchProcess:
        return [root]


def find_superlinks(flwr_home: Path) -> list[int]:
    """PIDs of the local SuperLink that `flwr run` started for this FLWR_HOME (ours and nobody else's): a
    flower-superlink process whose --log-file is <FLWR_HOME>/local-superlink/superlink.log, the path Flower gives
    the SuperLink it manages. An exact argument, not a pattern: another FLWR_HOME whose path begins with this one,
    or a process that only mentions the path (a `tail -f` of the log), is not it."""
    log_file = (Path(flwr_home).expanduser() / "local-superlink" / "superlink.log").resolve()
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        args = proc.info["cmdline"] or []
        if not any(Path(arg).name == "flower-superlink" for arg in args[:2]) or "--log-file" not in args[:-1]:
            continue
        given = Path(args[args.index("--log-file") + 1])
        try:
            if not given.is_absolute():
                given = Path(proc.cwd()) / given
        except psutil.Error:
            continue
        if given.resolve() == log_file:
            found.append(proc.info["pid"])
    return found


def stop_local_superlink(flwr_home: Path) -> list[int]:
    """Stop the local SuperLink of `flwr_home` (find_superlinks) and every process it started, by PID (SIGTERM,
    then SIGKILL after a grace period). Returns the SuperLink PIDs it stopped."""
    pids = find_superlinks(flwr_home)
    for pid in pids:
        kill_tree(pid)
    return pids


def kill_tree(root: int, grace: float = 10.0) -> None:
    """SIGTERM a process and all its descendants (snapshotted first), SIGKILL what is left."""
    procs = []
    for pid in process_tree(root):
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    for proc in procs:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


def flwr_cli(*args: str, env: dict, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run the `flwr` CLI that sits beside this Python, capturing its output."""
    exe = shutil.which("flwr", path=str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")) or "flwr"
    return subprocess.run([exe, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _find_status(obj) -> tuple[str, str]:
    if isinstance(obj, dict):
        if "status" in obj and isinstance(obj["status"], str):
            return obj["status"], str(obj.get("status-details", obj.get("sub-status", "")))
        obj = list(obj.values())
    if isinstance(obj, list):
        for value in obj:
            found = _find_status(value)
            if found[0]:
                return found
    return "", ""


def check_run_config(overrides: dict):
    """pyproject defaults + overrides -> validated RunConfig (method parameters included), so a
    bad value fails before any process starts."""
    flat = merge_overrides(overrides)  # an unknown or retired key fails here, before anything imports torch
    from strategies import check_method_params  # the methods import torch (seconds)

    cfg = from_run_config(flat)
    check_method_params(cfg)
    return cfg


def datasets_read(cfg) -> dict[str, tuple[str, ...]]:
    """Dataset -> splits a run reads: its dataset's train split (the clients' shards) and test split (the
    server's evaluation, the clients' local accuracy), plus the public dataset of a method that distills
    on one (feddf.source='dataset': the train split of feddf.public-dataset)."""
    from oneshot_fl.data.datasets import DATASETS  # torch, as in check_run_config
    from strategies import strategy_class

    reads = {cfg.dataset: ("train", "test")}
    params = strategy_class(cfg.method).parse_params(cfg.flat)
    public = getattr(params, "public_dataset", "")
    if getattr(params, "source", None) == "dataset" and public in DATASETS and public not in reads:
        reads[public] = ("train",)
    return reads


def data_dir_origin(cfg) -> str:
    """Where the run's data folder came from, for the error that names it."""
    if cfg.data_dir:
        return "data-dir"
    if os.environ.get(DATA_DIR_ENV):
        return f"${DATA_DIR_ENV}, as data-dir is unset"
    return f"the default, as data-dir and ${DATA_DIR_ENV} are unset"


def check_data_files(cfg) -> None:
    """Every file the run will read is in its data folder before Flower starts; missing ones are fetched
    now with download=true (into a temporary folder, moved into place only when complete) or end the
    launch with DatasetNotFoundError (one line naming the expected files). Only looks and, on a successful
    download, adds files: a missing or empty data folder is left as it was."""
    from oneshot_fl.data.datasets import missing_files, require_files  # torch, as in check_run_config

    data_dir = resolve_data_dir(cfg)
    for dataset, splits in datasets_read(cfg).items():
        if cfg.download and missing_files(dataset, data_dir, splits):
            print(f"[oneshot-fl] {dataset}: files missing in {data_dir}; downloading them through torchvision "
                  "(download=true)", flush=True)
        require_files(dataset, data_dir, splits, download=cfg.download, origin=data_dir_origin(cfg))


def wait_for_status(run_id: int, *, env: dict, cwd: Path, superlink: str | None = None,
                    timeout: float | None = None, poll: float = 2.0, max_poll: float = 60.0,
                    marker: Path | None = None, control: LocalControl | None = None) -> tuple[str, str]:
    """Wait until the run is finished:*; past `timeout` stop it. Returns (status, details).

    With `control` (a local SuperLink's Control API, asked in this process: one HTTP request) the
    status is asked every `poll` seconds. Otherwise each ask is a `flwr ls` process (about a second
    of CPU), so the interval grows (`poll` doubling up to `max_poll`), and between asks only
    `marker` (the run folder's result.json, a cheap stat) is watched: when it appears or changes
    the run is about to end, so the next ask comes at once and the interval starts again from `poll`.
    """
    target = [superlink] if superlink else []
    if control is not None:
        max_poll = poll
    start = time.monotonic()
    interval, next_ask = poll, start
    seen = _mtime(marker)
    while True:
        now = time.monotonic()
        stamp = _mtime(marker)
        if stamp != seen:
            seen, interval, next_ask = stamp, poll, now
        if now >= next_ask:
            if control is not None:
                status, details = control.status(run_id)
            else:
                listing = flwr_cli("ls", *target, "--run-id", str(run_id), "--format", "json", env=env, cwd=cwd)
                try:
                    status, details = _find_status(json.loads(listing.stdout))
                except ValueError:
                    status, details = "", ""
            if status.startswith("finished"):
                return status, details
            next_ask = time.monotonic() + interval
            interval = min(interval * 2, max_poll)
        if timeout is not None and time.monotonic() - start > timeout:
            if control is not None:
                control.stop(run_id)
            else:
                flwr_cli("stop", str(run_id), *target, env=env, cwd=cwd)
            return "finished:stopped", f"oneshot-fl launcher timeout after {timeout:.0f}s"
        time.sleep(min(0.5, max(0.05, next_ask - time.monotonic())))


def _mtime(path: Path | None) -> float | None:
    try:
        return path.stat().st_mtime_ns if path is not None else None
    except OSError:
        return None


def check_client_resources(cpus_per_client: float, gpus_per_client: float) -> None:
    """Ray places a ClientApp only where its whole share fits; a share no machine here has ends the run
    ("ActorPool is empty") after the SuperLink and the simulation have started. Refused before."""
    cores = os.cpu_count() or 1
    if cpus_per_client > cores:
        raise ConfigError(f"--cpus-per-client {cpus_per_client:g}: this machine has {cores} CPU cores, so no "
                          "client could be placed; use at most that")
    if gpus_per_client <= 0:
        return
    import torch  # only a run that asks for GPUs pays for torch here

    gpus = torch.cuda.device_count()
    if gpus == 0:
        raise ConfigError(f"--gpus-per-client {gpus_per_client:g}: no CUDA GPU is visible here (torch sees none); "
                          "leave it at 0 and the clients train on the CPU")
    if gpus_per_client > gpus:
        raise ConfigError(f"--gpus-per-client {gpus_per_client:g}: this machine has {gpus} GPU(s), so no client "
                          "could be placed; a fraction (e.g. 0.5) lets clients share one")
    if gpus_per_client > 1 and gpus_per_client != int(gpus_per_client):
        raise ConfigError(f"--gpus-per-client {gpus_per_client:g}: Ray takes a fraction below 1 or whole GPUs")


def client_gpu_share(nodes: int, cpus_per_client: float, gpus: int, cores: int) -> float:
    """The GPU share (Ray's num_gpus) that puts every client Ray runs at once (min(nodes, cores / cpus_per_client))
    on the machine's GPUs side by side: at most one GPU each (a client trains on one), rounded down to a hundredth
    so that the shares of one GPU never add up to more than it has (0.01 at least: Ray then queues the rest); 0
    without GPUs.

    Clients sharing a GPU are separate processes, one ClientApp each, as Flower runs them; a ClientApp trains
    exactly one partition, so several clients in one process is not something a run can ask for. On a lent H100,
    10 such processes (5 VGG-9 classifiers at 40 epochs, 5 CVAEs at 20) all finished within one 169 s call
    (benchmarks/results/gpu_cells.md, tableiv-mnist), while 25 at once fell behind the epoch times they had
    measured as they started: 17 of the 25 were still training when the window those times had sized closed
    (benchmarks/results/gpu_cells_attempt1.json)."""
    if gpus <= 0:
        return 0.0
    concurrent = max(1, min(nodes, int(cores // cpus_per_client)))
    return min(1.0, max(1, 100 * gpus // concurrent) / 100)


@sigterm_unwinds()  # a SIGTERM still stops the SuperLink below, whoever calls (the CLI, a benchmark, a test)
def run_simulation(overrides: dict, *, app_dir: Path = PROJECT_ROOT, num_supernodes: int | None = None,
                   cpus_per_client: float = 1.0, gpus_per_client: float | None = 0.0, flwr_home: Path | None = None,
                   timeout: float | None = None, stream: bool = True, keep_superlink: bool = False,
                   force: bool = False) -> SimulationRun:
    """Validate, take the run folder, submit, follow and clean up one simulation run. Raises nothing on a
    failed run: the returned SimulationRun says what status it ended in (see `.ok`). `force` starts an
    unfinished run of another config in the named run folder over (pin_run_config). `gpus_per_client` None: every
    concurrent client shares this machine's GPUs (devices.client_gpu_share), none without GPUs."""
    cfg = check_run_config(overrides)
    nodes = num_supernodes or cfg.num_clients
    if gpus_per_client is None:
        import torch  # the launcher loads torch only where it must count GPUs

        gpus_per_client = client_gpu_share(nodes, cpus_per_client, torch.cuda.device_count(), os.cpu_count() or 1)
    check_client_resources(cpus_per_client, gpus_per_client)
    if nodes < cfg.required_clients:  # the server would wait node-wait-timeout for nodes that never come
        raise ConfigError(f"--num-supernodes {nodes} is fewer than the {cfg.required_clients} clients the run "
                          f"requires (num-clients={cfg.num_clients}, min-clients={cfg.min_clients}); "
                          "lower min-clients to simulate absent clients")
    check_data_files(cfg)  # before the output folder is made and before Flower starts
    # one torch thread pool per concurrent client, so cores are not oversubscribed
    run_config, run_dir = pin_run_config(cfg, overrides, threads=max(1, int(cpus_per_client)), resume=True,
                                         force=force)
    own_home, interrupted = flwr_home is None, False
    try:
        flwr_home = Path(flwr_home or tempfile.mkdtemp(prefix="oneshot-fl-flwr-")).resolve()
        if nodes < cfg.num_clients:
            print(f"[oneshot-fl] warning: {nodes} SuperNodes for num-clients={cfg.num_clients}: the server waits "
                  f"node-wait-timeout={cfg.node_wait_timeout:g}s for the other {cfg.num_clients - nodes}, then goes "
                  f"on with {nodes}", file=sys.stderr, flush=True)
        federation = (f"num-supernodes={nodes} client-resources-num-cpus={cpus_per_client:g} "
                      f"client-resources-num-gpus={gpus_per_client:g} init-args-log-to-driver=true")
        env = {**flwr_env(flwr_home), **launcher_env(),  # git state for result.json
               "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
               "FLWR_LOCAL_CONTROL_API_PORT": str(free_port())}
        return follow_run(app_dir, run_config, ["--federation-config", federation], env=env, run_dir=run_dir,
                          stream=stream, timeout=timeout)
    except (KeyboardInterrupt, Terminated):  # Ctrl-C / SIGTERM: stop what was started, then say where the run is
        interrupted = True
        raise
    finally:
        if not keep_superlink and flwr_home is not None:
            for pid in find_superlinks(flwr_home):
                kill_tree(pid)
            if own_home:
                shutil.rmtree(flwr_home, ignore_errors=True)
        release_run_folder(run_dir)  # after the SuperLink and its ServerApp are gone
        if interrupted:
            print(interrupted_message(run_dir), file=sys.stderr, flush=True)


def flwr_env(flwr_home: Path) -> dict[str, str]:
    """Environment for Flower processes and the CLI: private FLWR_HOME, quiet, Flower binaries
    beside this Python first on PATH."""
    bin_dir = str(Path(sys.executable).parent)
    warning_filters = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), QUIET_ENV["PYTHONWARNINGS"]]))
    return {**os.environ, **QUIET_ENV, "FLWR_HOME": str(flwr_home), "PYTHONWARNINGS": warning_filters,
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}


def check_output_dir_writable(output_dir: Path) -> None:
    """Create the output folder (the run would) and write a scratch file in it, so an unwritable output-dir
    fails here and not in the ServerApp once Flower and the clients have run."""
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"output-dir={str(output_dir)!r} cannot hold the run: it is a file, not a folder")
    try:
        output_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=output_dir):
            pass
    except OSError as exc:
        raise ConfigError(f"output-dir={str(output_dir)!r} cannot hold the run: {exc.strerror or exc}") from exc


def pin_run_config(cfg, overrides: dict, threads: int, paths: bool = True,
                   resume: bool = False, force: bool = False) -> tuple[str, Path]:
    """--run-config string with a fixed run name, (unless set) a torch thread count and, with
    `paths`, absolute data/output paths of this machine; plus the run folder the ServerApp will
    write (relative to its output dir when the paths are left to the ServerApp's machine).

    With `paths` the folder is this machine's, and this process takes it (run_folder.claim_run_folder)
    before anything starts, until `run_folder.release_run_folder`: a folder in use by another run, or
    holding an unfinished run of another config (unless `force`, which starts it over), is refused here.
    With `resume` and no run-name, the folder an earlier launch of the same config left unfinished is
    chosen again."""
    pinned = {"run-name": cfg.run_name or _default_name(cfg)}
    if paths:
        pinned.update({"data-dir": str(resolve_data_dir(cfg)), "output-dir": str(resolve_output_dir(cfg))})
        # the ServerApp refuses a finished run's folder too, but only after Flower and the clients have started
        run_folder.check_run_dir_free(Path(pinned["output-dir"]) / pinned["run-name"])
        check_output_dir_writable(Path(pinned["output-dir"]))
        pinned["run-name"] = run_folder.claim_run_folder(
            cfg, Path(pinned["output-dir"]), pinned["run-name"], {**pinned, "threads": cfg.threads or threads},
            resume=resume, force=force, command=provenance.user_command())
    if not cfg.threads:
        pinned["threads"] = threads
    run_config = " ".join(run_config_items({**overrides, **pinned}))
    return run_config, Path(pinned.get("output-dir", "")) / pinned["run-name"]


def stage_app(app_dir: Path, dest: Path) -> Path:
    """Copy the app into `dest` without the folders and files its .gitignore excludes; returns `dest`.

    `flwr run` walks every file under the app folder before it applies the .gitignore: with a
    virtual environment inside the project that is ~50,000 files and ~5 s of CPU per submit.
    Flower drops those paths from the FAB anyway, so the pruned copy bundles to the same FAB."""
    gitignore = app_dir / ".gitignore"
    ignored = pathspec.GitIgnoreSpec.from_lines(gitignore.read_text().splitlines() if gitignore.is_file() else [])
    for folder, subfolders, files in os.walk(app_dir):
        rel = Path(folder).relative_to(app_dir)
        subfolders[:] = [d for d in subfolders
                         if d != ".git" and not ignored.match_file(f"{(rel / d).as_posix()}/")
                         and not (Path(folder) / d).is_symlink()]
        for name in files:
            source, target = Path(folder) / name, dest / rel / name
            # a git worktree's .git is a file, which the folder filter above does not see
            if source.is_symlink() or name == ".git" or ignored.match_file((rel / name).as_posix()):
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    return dest


def local_control(env: dict, superlink: str | None) -> LocalControl | None:
    """The Control API of the local simulation SuperLink `flwr run` starts (its HTTP port is in
    `env`), asked in this process; None for a named SuperLink connection (deployments: TLS and
    account authentication are the Flower CLI's business)."""
    port = env.get("FLWR_LOCAL_SUPERLINK_HTTP_API_PORT")
    return LocalControl(port) if superlink is None and port else None


def follow_run(app_dir: Path, run_config: str, extra_args: list[str], *, env: dict, run_dir: Path,
               superlink: str | None = None, stream: bool = True, timeout: float | None = None) -> SimulationRun:
    """`flwr run` the app (to `superlink`, default the CLI's default connection), optionally stream
    its log, wait for its final status and keep the log as run.log in the run folder (also when
    Ctrl-C or SIGTERM ends the wait: what was logged until then). Raises RunFailed only if no run
    started. The run id goes into the run folder's lock file at once (run_folder.record_run_id): the
    ServerApp of this run, and no other, writes under this launcher's lock.

    On a local simulation SuperLink the status checks and the log are Control API requests from
    this process (see `local_control`); otherwise they are `flwr ls` / `flwr log` commands."""
    target = [superlink] if superlink else []
    start = time.perf_counter()
    log_proc = follower = control = None
    run_id, lines = None, []
    try:
        with tempfile.TemporaryDirectory(prefix="oneshot-fl-app-") as staged:
            submit = flwr_cli("run", str(stage_app(app_dir, Path(staged))), *target, "--format", "json",
                              "--run-config", run_config, *extra_args, env=env, cwd=app_dir, timeout=300)
        try:
            run_id = int(json.loads(submit.stdout)["run-id"])
        except (ValueError, KeyError, TypeError):
            raise RunFailed(f"flwr run did not start a run:\n{strip_ansi(submit.stdout)}\n"
                            f"{strip_ansi(submit.stderr)}") from None
        run_folder.record_run_id(run_dir, run_id)
        if stream:
            print(f"[oneshot-fl] run {run_id} submitted; run folder {run_dir}", flush=True)
        control = local_control(env, superlink)
        if control is not None:
            follower = control.follow_log(run_id, echo=stream)
        elif stream:
            log_proc = subprocess.Popen([shutil.which("flwr", path=env["PATH"]) or "flwr",
                                         "log", str(run_id), *target, "--stream"], env=env, cwd=app_dir,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            threading.Thread(target=echo_lines, args=(log_proc.stdout, lines), daemon=True).start()
        remaining = None if timeout is None else timeout - (time.perf_counter() - start)
        status, details = wait_for_status(run_id, env=env, cwd=app_dir, superlink=superlink, timeout=remaining,
                                          marker=run_dir / "result.json" if run_dir.is_absolute() else None,
                                          control=control)
        log_text = follower.text() if follower is not None else ""
        if not log_text:  # no Control API in this process, or its stream failed: ask the CLI
            shown = flwr_cli("log", str(run_id), *target, "--show", env=env, cwd=app_dir)
            log_text = shown.stdout + shown.stderr
        keep_log(run_dir, log_text)
        return SimulationRun(run_id, status, details, run_dir, time.perf_counter() - start,
                             Path(env["FLWR_HOME"]), log_text=log_text)
    except (KeyboardInterrupt, Terminated):  # what the run logged until now is the interrupted folder's run.log
        if run_id is not None:
            keep_log(run_dir, "".join(follower.chunks) if follower is not None else "".join(lines), interrupted=True)
        raise
    finally:
        if log_proc is not None:
            time.sleep(1.0)
            log_proc.terminate()
            try:
                log_proc.wait(5)
            except subprocess.TimeoutExpired:
                log_proc.kill()
        if control is not None:
            control.close()


def echo_lines(stream, kept: list[str]) -> None:
    """Copy a `flwr log --stream` process's output to stdout (without colour codes unless stdout is a terminal),
    keeping every line (also once stdout's reader has gone, control_api.echo)."""
    shown = True
    for line in stream:
        kept.append(line)
        shown = shown and echo(line)


RESUMED_MARK = "[oneshot-fl] ---- the run was continued here by a new launch; its log follows ----\n"


def keep_log(run_dir: Path, log_text: str, interrupted: bool = False) -> None:
    """Write the run's log, without colour codes, as run.log in its folder (a folder of this machine that the run
    has written to). A run continued in the folder of an earlier, interrupted launch keeps that launch's log before
    its own. `interrupted`: the run is not over; only a folder the run wrote files to gets the log (a folder with
    nothing but the launch's bookkeeping is removed as the launcher lets go)."""
    if not run_dir.is_absolute() or not run_dir.is_dir():
        return
    if interrupted and not [name for name in run_folder.run_files(run_dir) if name != "run.log"]:
        return
    path = run_dir / "run.log"
    earlier = path.read_text(errors="replace") if path.is_file() else ""
    try:
        path.write_text(earlier + (RESUMED_MARK if earlier else "") + strip_ansi(log_text))
    except OSError as exc:  # the log is a convenience: a full disk must not hide the run's status
        print(f"[oneshot-fl] could not write {path}: {exc.strerror or exc}", file=sys.stderr, flush=True)


def _default_name(cfg) -> str:
    return run_folder.default_run_name(cfg)
