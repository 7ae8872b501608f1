"""Fleets: the client uploads a table's methods share, trained once, and the replays that serve them.

A fleet is one cell of a table (dataset, NIID-Bench alpha or 2c/c, seed, K clients, client-side settings). Its
clients are trained once through the real Flower simulation (the run of `trained_by`, which gives that method's row);
every other method replays the kept uploads archive (`launcher.replay`) in a fresh process, so a table compares
methods on identical client models and an interrupted table resumes where it stopped. Every table command builds its
grid of `Fleet`s and calls `run_fleets`; probes under experiments/ use the same functions.

Also here, because more than one command reads them: the tuning fleets (seed >= 100, never reported) of the
heterogeneous fleet files, and the FedMHO Table IV fleet (5 classifier + 5 decoder clients).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

from benchmarks import archives
from benchmarks.records import (append_record, code_version, has_record, load_records, not_applicable_record,
                                overrides_key, record_from_result, release_version, resolve_variant)
from launcher.cli import bounded
from oneshot_fl.config import ConfigError, FleetNotSupported
from launcher.launch import check_run_config, parse_overrides, run_config_items, run_simulation
from oneshot_fl.logs import setup_logging
from launcher.replay import CLIENT_SIDE_KEYS, CLIENT_SIDE_PREFIXES, replay, replay_config

BENCH_DIR = Path(__file__).resolve().parent
log = logging.getLogger("oneshot_fl.bench")
TRAINING_RUN_KEYS = ("method", "seed", "preset")  # what a training run's record says besides its settings


def cell_overrides(cell: str) -> dict:
    """A table cell's partition settings: a NIID-Bench Dirichlet alpha ("0.1") or "2c/c"."""
    if cell == "2c/c":
        return {"partition": "2c/c", "alpha": 0.5}
    return {"partition": "niid-bench", "alpha": float(cell)}


def check_grid(datasets: list[str], cells: list[str], seeds: list[int], methods: list[str], num_clients: int,
               preset: str, client_sets: dict, server_sets: dict) -> None:
    """Every dataset x cell and every method's settings checked before the first run starts (ConfigError):
    a typo in the last cell or method would otherwise surface hours into the grid."""
    for cell in cells:
        if cell != "2c/c":
            try:
                float(cell)
            except ValueError:
                raise ConfigError(f"cell {cell!r}: a NIID-Bench Dirichlet alpha (e.g. 0.1) or '2c/c'") from None
    if bad := [seed for seed in seeds if seed < 0]:
        raise ConfigError(f"seeds {bad}: a seed is >= 0")
    for dataset in datasets:  # the server settings too: a heterogeneous fleet's clients need its server model
        for cell in cells:
            check_run_config({"method": "fedavg", "dataset": dataset, "num-clients": num_clients, "seed": seeds[0],
                              "preset": preset, **cell_overrides(cell), **client_sets, **server_sets})
    for label in methods:
        method, variant_sets = resolve_variant(label)
        check_run_config({"method": method, "dataset": datasets[0], "num-clients": num_clients, "preset": preset,
                          **cell_overrides(cells[0]), **client_sets, **server_sets, **variant_sets})


def cell_name(dataset: str, cell: str, seed: int) -> str:
    """A fleet's folder name under benchmarks/runs/<table>/."""
    return f"{dataset}-{cell.replace('/', '')}-s{seed}"


def parse_sets(items: list[str]) -> dict:
    """`k=v` items or override files, as `oneshot-fl run -c` reads them."""
    return parse_overrides(items)


def train_clients(table: str, dataset: str, cell: str, seed: int, num_clients: int, preset: str,
                  client_sets: dict, force: bool, method: str = "fedavg", server_sets: dict | None = None) -> Path:
    """Clients through the real simulation once per cell (the run of `method`, recorded too);
    returns the uploads archive folder. `server_sets` reach that run's server as they reach every
    replay's: its row runs the same server settings (server-threads included) as the others'.
    In a release run (records.release_version) the clients are the release commit's: an archive another table
    trained at that commit with the same settings is served from the fleet store (benchmarks.archives), a kept
    archive of other code is trained again."""
    name = cell_name(dataset, cell, seed)
    run_dir = BENCH_DIR / "runs" / table / name
    uploads = run_dir / "uploads"
    overrides = {"method": method, "dataset": dataset, "num-clients": num_clients, "seed": seed,
                 "preset": preset, **cell_overrides(cell), **client_sets, **(server_sets or {}),
                 "output-dir": str(run_dir.parent), "run-name": name}
    fleet = fleet_settings(method, dataset, cell, seed, num_clients, preset, client_sets)
    release = release_version()
    settings_file = run_dir / "client_sets.json"  # what the kept uploads were trained with
    if (uploads / "manifest.json").is_file() and not force:
        if release and not archives.trained_at(uploads, release):
            log.info("%s: the kept uploads are not the release commit's (%s): training them again", name, release)
        else:
            kept = json.loads(settings_file.read_text()) if settings_file.is_file() else None
            if kept is not None and kept != json.loads(json.dumps(client_sets)):
                raise RuntimeError(f"{run_dir} keeps uploads trained with {json.dumps(kept)}, not "
                                   f"{json.dumps(client_sets)}: --force trains them again (or move that folder)")
            return uploads
    if release and not force and (stored := archives.recall(BENCH_DIR / "runs", fleet, release)):
        log.info("%s: serving the fleet trained at %s with the same settings, %s", name, release, stored)
        return stored
    if run_dir.exists():
        shutil.rmtree(run_dir)
    log.info("training %d clients for %s (%s)", num_clients, name, json.dumps(client_sets))
    run = run_simulation(overrides, stream=False)
    if not run.ok:
        raise RuntimeError(f"client training for {name} failed ({run.status}): {run.status_details}\n"
                           f"{run.log_text[-4000:]}")
    result = run.result()
    settings_file.write_text(json.dumps(client_sets, sort_keys=True))
    sets = {k: v for k, v in overrides.items() if k not in ("output-dir", "run-name")}
    record = record_from_result(table, result, sets, {"cell": cell, "run_dir": str(run_dir),
                                                       "uploads_id": uploads_id(uploads),
                                                       "uploads_fp": archives.uploads_fp(uploads)})
    archives.remember(BENCH_DIR / "runs", fleet, uploads, record["code_version"])
    append_record(record)
    return uploads


def fleet_settings(method: str, dataset: str, cell: str, seed: int, num_clients: int, preset: str,
                   client_sets: dict) -> dict:
    """What fixes a fleet's clients (the fleet store's key, with the code version): the run that trains them, its
    cell, seed, size, preset and client-side settings."""
    return {"method": method, "dataset": dataset, "cell": cell, "seed": seed, "num-clients": num_clients,
            "preset": preset, **client_sets}


def uploads_id(uploads: Path) -> str:
    """A short id of one training run's uploads archive (the hash of its manifest: node ids, label counts, local
    metrics): the table commands pair records with the kept archive they ran on by it when they resume. What the
    uploads hold is `archives.uploads_fp`: two trainings of identical clients have other ids, the same fingerprint."""
    return hashlib.sha256((Path(uploads) / "manifest.json").read_bytes()).hexdigest()[:12]


def replay_in_worker(uploads: str, method: str, sets: dict, run_dir: str) -> dict:
    """One replay (in a worker process: torch threads from the run config's `threads`).
    A method that cannot run on the fleet returns {"not_applicable": reason, "flat": run config}."""
    setup_logging()
    version = code_version()  # the code this process imports now, not the tree when the record is written
    args = [f"method='{method}'", *run_config_items(sets)]
    try:
        return {**replay(Path(uploads), args, run_dir=Path(run_dir)), "code_version": version}
    except FleetNotSupported as exc:
        return {"not_applicable": str(exc), "flat": replay_config(Path(uploads), {"method": method, **sets}),
                "code_version": version}


@dataclass
class ReplayJob:
    """One server method replayed on a kept uploads archive, and the record it will append."""
    table: str
    uploads: Path
    label: str
    method: str
    sets: dict
    run_dir: Path
    overrides: dict  # what the record lists as run (client and server settings)
    extra: dict

    def run(self) -> dict:
        return replay_in_worker(str(self.uploads), self.method, self.sets, str(self.run_dir))

    def record(self, result: dict) -> None:
        if "not_applicable" in result:
            log.info("%s is not applicable to %s: %s", self.label, self.run_dir.name, result["not_applicable"])
            ran = result.get("code_version") or code_version()
            append_record(not_applicable_record(self.table, self.method, result["flat"], result["not_applicable"],
                                                self.overrides, {**self.extra, "code_version": ran}))
            return
        log.info("%s: accuracy %.4f", self.run_dir.name, result["global"]["accuracy"])
        append_record(record_from_result(self.table, result, self.overrides, self.extra))


def split_fleet(fleet: dict, server_sets: dict) -> tuple[dict, dict]:
    """(client-side settings, server settings of every replay): a replay takes the clients from the archive but no
    server method knob (replay_config), so the fleet file's server settings (its distillation budget, server model)
    must reach each replay as overrides, as they reached the run that trained the clients."""
    client = {k: v for k, v in fleet.items() if k in CLIENT_SIDE_KEYS or k.startswith(CLIENT_SIDE_PREFIXES)}
    return client, {**{k: v for k, v in fleet.items() if k not in client}, **server_sets}


def replay_key(label: str, dataset: str, cell: str, seed: int, preset: str, client_sets: dict,
               server_sets: dict) -> tuple[str, dict, dict]:
    """A replayed method's (method, server settings, record key without the uploads it ran on)."""
    method, variant_sets = resolve_variant(label)
    sets = {**server_sets, **variant_sets, "preset": preset}
    key = {"method": method, "dataset": dataset, "cell": cell, "seed": seed, "preset": preset,
           "overrides_key": overrides_key({**client_sets, **sets}),
           "label": label if label != method else None}  # a relabelled old record is not this method's
    return method, sets, key


def fleet_recorded(fleet: "Fleet", methods: list[str], preset: str, server_sets: dict) -> bool:
    """Every replayed method of the fleet has a record at these settings (on some training of the same seed).
    A fleet whose uploads are no longer kept is then not trained again for nothing. (A fleet trained again has the
    seed's partitions and initialisations, but its uploads are not bit-identical to the first training's across
    code versions: --force retrains it and replays every method on the new uploads.)"""
    wanted = list(fleet.methods or methods)
    replayed = [label for label in wanted if label != fleet.trained_by]
    if fleet.trained_by in wanted and not has_record(fleet.table, {
            "method": fleet.trained_by, "dataset": fleet.dataset, "cell": fleet.cell, "seed": fleet.seed,
            "preset": preset}):
        return False  # its row comes from the training run itself
    return bool(replayed) and all(
        has_record(fleet.table, replay_key(label, fleet.dataset, fleet.cell, fleet.seed, preset, fleet.client_sets,
                                           server_sets)[2]) for label in replayed)


def trainer_recorded(table: str, upload_fp: str, trained_by: str, client_sets: dict, server_sets: dict) -> bool:
    """The run that trained these uploads recorded its method's row at these server settings. Kept uploads are
    served again when a table is resumed with other server settings (a new distillation budget): the training
    method then has no row at them and is replayed like every other method."""
    def server_part(overrides: dict) -> dict:
        return {k: v for k, v in split_fleet(overrides, {})[1].items() if k not in TRAINING_RUN_KEYS}

    wanted = server_part({**client_sets, **server_sets})
    release = release_version()
    return any(r.get("method") == trained_by and r.get("uploads_id") == upload_fp and not r.get("label")
               and server_part(r.get("overrides") or {}) == wanted
               and (release is None or r.get("code_version") == release) for r in load_records(table))


def plan_replays(table: str, uploads: Path, methods: list[str], trained_by: str, dataset: str, cell: str,
                 seed: int, preset: str, client_sets: dict, server_sets: dict, force: bool,
                 folder_tag: str = "") -> list[ReplayJob]:
    """Every method that has no record on these very uploads; the one that trained the clients only where its
    training run's row is at other server settings (trainer_recorded). A method may be a named variant
    (benchmarks.records.VARIANTS, e.g. fedhydra-paper). `folder_tag` names the replays' run folders apart when one
    method is replayed at several server settings (hetero_diag), so that processes side by side never share one."""
    upload_fp = uploads_id(uploads)
    content = archives.uploads_fp(uploads)
    jobs = []
    for label in methods:
        method, sets, key = replay_key(label, dataset, cell, seed, preset, client_sets, server_sets)
        key["uploads_id"] = upload_fp
        if has_record(table, key) and not force:
            continue
        if label == trained_by and (force or trainer_recorded(table, upload_fp, label, client_sets, server_sets)):
            continue  # its row came from the training run itself
        name = f"{cell_name(dataset, cell, seed)}-{label}" + (f"-{folder_tag}" if folder_tag else "")
        out = BENCH_DIR / "runs" / table / name
        # An interrupted replay left a distillation checkpoint here: replaying into the same folder
        # resumes it (the checkpoint's fingerprint refuses other settings or uploads). A finished run
        # found here was never recorded (or force): run it again; replay never overwrites a result.
        if out.exists() and (force or (out / "result.json").exists()):
            shutil.rmtree(out)
        extra = {"cell": cell, "run_dir": str(out), "uploads_id": upload_fp, "uploads_fp": content,
                 **({"label": label} if label != method else {})}
        jobs.append(ReplayJob(table, uploads, label, method, sets, out, {**client_sets, **sets}, extra))
    return jobs


def replay_methods(table: str, uploads: Path, methods: list[str], trained_by: str, dataset: str, cell: str,
                   seed: int, preset: str, client_sets: dict, server_sets: dict, force: bool,
                   folder_tag: str = "") -> None:
    """plan_replays, run one after the other in this process."""
    for job in plan_replays(table, uploads, methods, trained_by, dataset, cell, seed, preset, client_sets,
                            server_sets, force, folder_tag):
        job.record(job.run())


class ReplayRunner:
    """Runs replay jobs `workers` at a time in spawned processes (one torch thread each, from the run
    config) while the caller trains the next cell's clients; each record is appended as its replay
    ends, so an interrupted grid loses only the runs in flight. Each replay gets a fresh process, so it
    runs (and its record names) the code as it is when it starts. workers=0 runs them inline."""

    def __init__(self, workers: int, on_record=None):
        self.workers = workers
        self.on_record = on_record or (lambda: None)
        # one replay per worker process: each imports the code as it is when the replay starts
        self.pool = (ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"), max_tasks_per_child=1)
                     if workers > 0 else None)
        self.pending: set = set()
        self.lock = threading.Lock()
        self.failed = 0

    def submit(self, job: ReplayJob) -> None:
        if self.pool is None:
            self._finish(job, job.run)
            return
        future = self.pool.submit(job.run)
        with self.lock:
            self.pending.add(future)
        future.add_done_callback(lambda f, job=job: self._done(f, job))

    def _done(self, future, job: ReplayJob) -> None:
        self._finish(job, future.result)
        with self.lock:
            self.pending.discard(future)

    def _finish(self, job: ReplayJob, result_of) -> None:
        try:
            result = result_of()
        except Exception as exc:  # one failed replay must not cost the others' records
            log.error("%s on %s failed: %s", job.label, job.uploads, exc)
            self.failed += 1
            return
        with self.lock:
            job.record(result)
            try:
                self.on_record()
            except Exception as exc:  # a table that does not render must not stop the grid (nor hang its wait)
                log.error("rendering after %s on %s failed: %s", job.label, job.uploads, exc)

    def wait(self, at_most: int = 0) -> None:
        """Block until no more than `at_most` replays are queued or running."""
        while True:
            with self.lock:
                futures = list(self.pending)
            if len(futures) <= at_most:
                return
            wait_futures(futures, return_when=FIRST_COMPLETED)
            time.sleep(0.05)  # let the done-callbacks drop the finished ones

    def close(self) -> None:
        self.wait(0)
        if self.pool is not None:
            self.pool.shutdown()


# --- a grid of fleets: train each once, replay every method on its uploads -------------------------------------

@dataclass(frozen=True)
class Fleet:
    """One fleet of a table: the records file it goes to, its cell and seed, its size and client-side settings."""

    table: str
    dataset: str
    cell: str
    seed: int
    num_clients: int
    client_sets: dict
    trained_by: str = "fedavg"  # the method whose simulation trains the clients (its row comes from that run)
    methods: tuple[str, ...] | None = None  # the methods this fleet serves (None: the table's)


def add_fleet_arguments(parser: argparse.ArgumentParser, methods: list[str]) -> None:
    """The options every fleet table shares (methods, preset, overrides, jobs, force)."""
    parser.add_argument("--methods", nargs="+", default=methods)
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--client-set", action="append", default=[],
                        help="client-side run-config overrides (local.*), e.g. \"local.epochs=5\"")
    parser.add_argument("--set", action="append", default=[], help="server-side overrides for every method")
    add_concurrency_arguments(parser)
    parser.add_argument("--force", action="store_true", help="redo runs that already have a record")
    parser.add_argument("--redo-replays", action="store_true",
                        help="redo the replays that have a record, on the uploads already kept (no retraining)")


def add_concurrency_arguments(parser: argparse.ArgumentParser) -> None:
    """--jobs (replays at once, beside a fleet's training) and --cores (processes at once, the training counted)."""
    parser.add_argument("--jobs", type=bounded(1, int), default=1,
                        help="replays run at once, each in a fresh process, while the next fleet's clients train")
    parser.add_argument("--cores", type=bounded(1, int), default=None,
                        help="processes at once, a fleet's training counted: N replays while no fleet trains, N - 1 "
                             "beside a training (replaces --jobs)")


def concurrency(args: argparse.Namespace) -> dict:
    """run_fleets' `jobs` and `beside_training` from --jobs / --cores."""
    if args.cores:
        return {"jobs": args.cores, "beside_training": args.cores - 1}
    return {"jobs": args.jobs}


def check_fleets(fleets: list[Fleet], methods: list[str], preset: str, server_sets: dict) -> None:
    """Every fleet's settings checked before the first one trains (ConfigError)."""
    for f in fleets:
        check_grid([f.dataset], [f.cell], [f.seed], list(f.methods or methods), f.num_clients, preset, f.client_sets,
                   server_sets)


def run_fleets(fleets: list[Fleet], methods: list[str], preset: str, server_sets: dict, jobs: int, force: bool,
               on_record=None, redo_replays: bool = False, beside_training: int | None = None) -> int:
    """Train each fleet through the real simulation (of its trained_by method, which gives that method's row) and
    replay its other methods on its uploads, `jobs` at a time, at most `beside_training` of them (default `jobs`)
    while the next fleet trains; returns the number of failed replays (logged)."""
    runner = ReplayRunner(jobs, on_record=on_record)
    beside = jobs if beside_training is None else beside_training
    try:
        for f in fleets:
            runner.wait(at_most=beside)  # train the next fleet while the last replays run, not ahead of a queue
            if not (force or redo_replays) and fleet_recorded(f, methods, preset, server_sets):
                log.info("%s: every method has a record for this seed; not training its clients again",
                         cell_name(f.dataset, f.cell, f.seed))
                continue
            uploads = train_clients(f.table, f.dataset, f.cell, f.seed, f.num_clients, preset, f.client_sets, force,
                                    method=f.trained_by, server_sets=server_sets)
            for job in plan_replays(f.table, uploads, list(f.methods or methods), f.trained_by, f.dataset, f.cell,
                                    f.seed, preset, f.client_sets, server_sets, force or redo_replays):
                runner.submit(job)
    finally:
        runner.close()
    if runner.failed:
        print(f"{runner.failed} replay(s) failed (see the log above)", file=sys.stderr)
    return runner.failed




# --- tuning fleets: the heterogeneous fleet files at seeds >= 100 -----------------------------------------------

# The records file and runs folder of the tuning fleets' training runs (the diagnostics of experiments/hetero_diag
# add their rows beside them).
TUNING_TABLE = "hetero_diag"
GREY = BENCH_DIR / "conf" / "grey-hetero-cpu.toml"
TUNING_FLEET_FILES = {"mnist": GREY, "fmnist": GREY, "cifar10": BENCH_DIR / "conf" / "cifar10-hetero-cpu.toml"}
TUNING_SERVER = {"server-threads": 1}  # every tuning run's server on one thread


def fleet_file(dataset: str) -> Path:
    """The fleet file of a dataset's heterogeneous tuning fleet."""
    if dataset not in TUNING_FLEET_FILES:
        raise ConfigError(f"dataset {dataset!r}: there are tuning fleet files for {', '.join(TUNING_FLEET_FILES)}")
    return TUNING_FLEET_FILES[dataset]


def fleet_of(dataset: str) -> dict:
    """The fleet file's settings of a dataset's tuning fleet."""
    return parse_sets([str(fleet_file(dataset))])


def tuning_fleet(dataset: str) -> tuple[dict, int, str]:
    """(client settings of every run on the dataset's tuning fleet, number of clients, preset): the fleet file's
    settings, one torch thread per client."""
    fleet = fleet_of(dataset)
    clients = {k: v for k, v in fleet.items() if k not in ("dataset", "num-clients", "preset")}
    return {**clients, "threads": 1}, fleet["num-clients"], fleet.get("preset", "cpu")


def tuning_server_sets(dataset: str) -> dict:
    """What every server run on a tuning fleet is told besides its archive: the fleet file's server settings."""
    return split_fleet(tuning_fleet(dataset)[0], {})[1]


def tuning_uploads(dataset: str, cell: str, seed: int) -> Path:
    """The uploads archive of a tuning fleet, its clients trained (by FedHydra's run at the fleet file's settings,
    recorded in TUNING_TABLE) where no archive is kept. Kept uploads are checked against the client-side settings
    only, so a later change of the file's server settings still finds them."""
    if seed < 100:
        raise ConfigError(f"seed {seed}: tuning fleets have seeds >= 100 (reported seeds are never tuned on)")
    clients, num_clients, preset = tuning_fleet(dataset)
    client_side, file_server = split_fleet(clients, TUNING_SERVER)
    return train_clients(TUNING_TABLE, dataset, cell, seed, num_clients, preset, client_side, False,
                         method="fedhydra", server_sets=file_server)


# --- FedMHO Table IV's fleet: 5 classifier + 5 decoder clients ------------------------------------------------

# The CPU budget of the classifier clients (the `cpu` preset otherwise): 30 local epochs reach FedMHO-MD 91.48 % on
# the MNIST NIID-Bench 0.5 tuning fleet (seed 100) where 10 reach 89.55 and 50 add nothing for 1.8x the client time
# (benchmarks/results/archive/fedmho_causes.md, rows `clients`).
FEDMHO_CLIENT_DEFAULTS = {"local.epochs": 30, "local.batch-size": 64, "local.lr": 0.01}


def fedcvae_cvae(preset: str) -> str:
    """The CVAE of the FedCVAE fleet's clients. FedMHO's Table IV ran FEDCVAE with CVAE-large (latent 20, Adam 1e-3)
    on the five sufficient clients and CVAE-small on the five constrained ones (Table I); its Table IX with
    CVAE-large on every client, which the paper preset does (one CVAE per fleet). On the CPU presets the clients keep
    CVAE-small: CVAE-large trains at ~1.2 s per batch of 64 on one core here (~55 min per MNIST client for its
    30 epochs, ~9 h per cell), and the CPU-sized CVAEs with latent 20 (cvae-mlp, cvae-conv at Adam 1e-3) learn to
    ignore the label (benchmarks/results/archive/fedmho_causes.md): CVAE-small's samples carry their class (99 %)."""
    return "cvae-large" if preset == "paper" else ""


def fedmho_fleet(method: str, dataset: str, alpha: float, seed: int, preset: str, classifier: str,
                 client_sets: dict) -> dict:
    """The run config of FedMHO's fleet (10 clients, NIID-Bench alpha, the upper five constrained) for `method`;
    FedCVAE's fleet (every client a decoder client) when `method` is fedcvae."""
    cvae = {"cvae.arch": fedcvae_cvae(preset)} if method == "fedcvae" and fedcvae_cvae(preset) else {}
    return {"method": method, "dataset": dataset, "partition": "niid-bench", "alpha": alpha, "num-clients": 10,
            "seed": seed, "preset": preset, "model": classifier, "fedmho.constrained-clients": 5,
            **cvae, **client_sets}
