"""The release's plan: every job of every table the README shows, what is done at a commit, and what the rest costs.

A step is one table command invocation with the release's settings (release_steps: the paper table's 12 cells at
seeds 0-2, CIFAR-10's at the cpu preset's budget named in the command; FedMHO's Table IV shape; the heterogeneous
tables; K = 5 to 100; DP; robustness; the 20-round FedLMD table); its jobs are the runs it leaves records of: a
fleet's training run ("clients", its method's row), a replay on its uploads ("replay"), a multi-round simulation
("simulation", one record per round). A job is done when its table holds its record at the commit; each job to run
gets the median wall time of its table's records of the same method, dataset, cell and clients at the job's budget
(else other cells, else the tables a step names in `estimate_from`); jobs with none are named. benchmarks.release
runs the plan.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass, field

from benchmarks.records import load_records
from benchmarks.render import _cell, method_label
from oneshot_fl.presets import PRESET_KEYS, PRESETS

SEEDS = (0, 1, 2)
GREY_CELLS = ("0.5", "0.3", "0.1", "0.01", "2c/c")
PAPER_METHODS = ("fedavg", "dense", "feddf", "coboosting", "fedhydra-paper", "fedhydra")
# CIFAR-10's paper-table cells at the cpu preset's budget, named in the command and the records: on the tuning fleets
# every cut of it scored lower (experiments.cifar_budget, results/cifar10_budget.md; docs/decisions.md). Their job
# times, until the paper table has records at this budget, come from that curve's runs at it
CIFAR10_CLIENT = {"local.epochs": PRESETS["cpu"]["local.epochs"]}
CIFAR10_SERVER = {k: PRESETS["cpu"][k] for k in ("distill.epochs", "distill.generator-steps", "distill.kd-steps")}
CIFAR10_ESTIMATES = ("cifar10_budget-e10-none",)
ONE_THREAD_CLIENT = {"threads": 1}
ONE_THREAD_SERVER = {"threads": 1, "server-threads": 1}
FEDMHO_METHODS = ("fedmho", "fedmho-md", "fedmho-sd", "fedcvae", "fedavg", "dense", "fedhydra")
HETERO_METHODS = ("fedhydra", "dense", "feddf", "coboosting")
CLIENT_NUMBERS = (5, 10, 20, 50, 100)
LARGE_K = 50  # from this K on, seed 0 only (the client-number command's --large-k)
CLIENTS_METHODS = ("fedavg", "dense", "coboosting", "fedhydra")
EPSILONS = (1.0, 3.0, 8.0, 0.0)
DP_METHODS = ("fedavg", "dense", "fedhydra", "fedmho-md")
ROBUSTNESS_VARIANTS = ("honest", "flip", "random", "scale10", "minus")
ROBUSTNESS_METHODS = ("fedhydra", "fedhydra-paper", "dense", "coboosting")
ROUNDS = 20
MULTIROUND_METHODS = ("fedavg", "fedlmd", "fedlmd-tf")
MULTIROUND_CLIENT = {"local.epochs": 5}  # FedLMD's E per round
# Two label-skewed cells with FedLMD's own numbers beside ours (benchmarks.render REFERENCES): its Table 3b has MNIST
# Dirichlet 0.1, its Table 3a MNIST with two label-sorted shards per client (our 2c/c: two classes per client)
MULTIROUND_CELLS = ("0.1", "2c/c")


@dataclass(frozen=True)
class Job:
    """One run a table needs: a fleet's training run ("clients", which gives its method's row), a replay on its
    uploads ("replay"), or a multi-round simulation ("simulation", one record per round), and the record it leaves."""

    kind: str
    table: str  # the records file (benchmarks/results/<table>.jsonl)
    label: str  # method or named variant
    dataset: str
    cell: str
    seed: int
    num_clients: int | None  # None: any (a replay on part of a fleet records fewer)
    match: tuple = ()  # more record fields it must have, e.g. (("variant", "flip"),)
    sets: tuple = ()  # settings the record's overrides must hold (the release's threads and budget)

    def describe(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.match)
        clients = f" K={self.num_clients}" if self.num_clients else ""
        return f"{self.kind} {self.label}: {self.table} {self.dataset} {self.cell} seed {self.seed}{clients}{extra}"

    def recorded_by(self, record: dict) -> bool:
        """`record` is this job's (at whatever code version)."""
        overrides = record.get("overrides") or {}
        return (method_label(record) == self.label and record.get("dataset") == self.dataset
                and _cell(record) == self.cell and record.get("seed") == self.seed
                and (self.num_clients is None or record.get("num_clients") == self.num_clients)
                and all(record.get(k) == v for k, v in self.match)
                and all(overrides.get(k) == v for k, v in self.sets))


@dataclass(frozen=True)
class Step:
    """One table command invocation of the release."""

    name: str
    table: str  # the table it (partly) regenerates, as RELEASE.toml names it
    command: str  # module
    args: tuple[str, ...]
    jobs: tuple[Job, ...]
    cores: int = 2
    after: tuple[str, ...] = ()  # steps whose clients it uses (their fleets first)
    estimate_from: tuple[str, ...] = ()  # records files whose times estimate a job its own table has none of

    def argv(self) -> list[str]:
        return [sys.executable, "-m", self.command, *self.args]


def set_args(option: str, sets: dict) -> tuple[str, ...]:
    return tuple(a for k, v in sets.items() for a in (option, f"{k}={v}"))


def fleet_jobs(table: str, datasets, cells, seeds, num_clients: int, methods, trained_by: str,
               sets: dict) -> list[Job]:
    """A fleet per dataset x cell x seed: its training run (trained_by's row), then a replay per other method."""
    frozen = tuple(sorted(sets.items()))
    return [Job("clients" if label == trained_by else "replay", table, label, dataset, cell, seed, num_clients,
                sets=frozen)
            for dataset in datasets for cell in cells for seed in seeds
            for label in [trained_by, *[m for m in methods if m != trained_by]]]


def paper_step(name: str, datasets, cells, client: dict, server: dict, estimate_from: tuple[str, ...] = ()) -> Step:
    sets = {**client, **server}
    return Step(name, "paper_table", "benchmarks.paper_table",
                ("--datasets", *datasets, "--cells", *cells, "--seeds", *map(str, SEEDS),
                 "--methods", *PAPER_METHODS, "--cores", "2", *set_args("--client-set", client),
                 *set_args("--set", server)),
                tuple(fleet_jobs("paper_table", datasets, cells, SEEDS, 5, PAPER_METHODS, "fedavg", sets)),
                estimate_from=estimate_from)


def fedmho_step(dataset: str) -> Step:
    """FedMHO's Table IV shape for one dataset (one process: the command trains and replays in turn)."""
    sets = tuple(sorted({**ONE_THREAD_CLIENT, **ONE_THREAD_SERVER}.items()))
    jobs = []
    for alpha in ("0.5", "0.1"):
        for seed in SEEDS:
            jobs.append(Job("clients", "fedmho_table", "fedmho-md", dataset, alpha, seed, 10, sets=sets))
            jobs += [Job("replay", "fedmho_table", m, dataset, alpha, seed, None, sets=sets)
                     for m in FEDMHO_METHODS if m not in ("fedmho-md", "fedcvae")]
            jobs.append(Job("clients", "fedmho_table", "fedcvae", dataset, alpha, seed, 10, sets=sets))
    return Step(f"fedmho-{dataset}", "fedmho_table", "benchmarks.fedmho_table",
                ("--datasets", dataset, "--alphas", "0.5", "0.1", "--seeds", *map(str, SEEDS),
                 "--methods", *FEDMHO_METHODS, *set_args("--client-set", ONE_THREAD_CLIENT),
                 *set_args("--set", ONE_THREAD_SERVER)), tuple(jobs), cores=1)


def hetero_step(name: str, table: str, conf: str, datasets) -> Step:
    return Step(name, table, "benchmarks.hetero_table",
                ("--conf", conf, "--table", table, "--datasets", *datasets, "--cells", "0.5", "0.1",
                 "--seeds", *map(str, SEEDS), "--methods", *HETERO_METHODS, "--train-method", "fedhydra",
                 "--cores", "2", *set_args("--client-set", ONE_THREAD_CLIENT), *set_args("--set", ONE_THREAD_SERVER)),
                tuple(fleet_jobs(table, datasets, ("0.5", "0.1"), SEEDS, 5, HETERO_METHODS, "fedhydra",
                                 {**ONE_THREAD_CLIENT, **ONE_THREAD_SERVER})))


def clients_step() -> Step:
    sets = {**ONE_THREAD_CLIENT, **ONE_THREAD_SERVER}
    jobs = [job for k in CLIENT_NUMBERS
            for job in fleet_jobs(f"clients-k{k}", ("fmnist",), ("0.5",), SEEDS if k < LARGE_K else (0,), k,
                                  CLIENTS_METHODS, "fedavg", sets)]
    return Step("clients", "clients", "benchmarks.clients_table",
                ("--ks", *map(str, CLIENT_NUMBERS), "--seeds", *map(str, SEEDS), "--large-k", str(LARGE_K),
                 "--large-k-seeds", "0", "--methods", *CLIENTS_METHODS, "--cores", "2",
                 *set_args("--client-set", ONE_THREAD_CLIENT), *set_args("--set", ONE_THREAD_SERVER)),
                tuple(jobs), after=("paper-grey",))  # K = 5 is the paper table's FMNIST 0.5 fleet


def dp_step() -> Step:
    sets = {**ONE_THREAD_CLIENT, **ONE_THREAD_SERVER}
    classifier = tuple(m for m in DP_METHODS if m != "fedmho-md")
    jobs = []
    for epsilon in EPSILONS:
        name = f"dp-eps{epsilon:g}"
        jobs += fleet_jobs(name, ("mnist", "fmnist"), ("0.5",), SEEDS, 5, classifier, "fedavg", sets)
        jobs += fleet_jobs(f"{name}-mixed", ("mnist", "fmnist"), ("0.5",), SEEDS, 10, ("fedmho-md",), "fedmho-md",
                           sets)
    return Step("dp", "dp", "benchmarks.dp_table",
                ("--datasets", "mnist", "fmnist", "--cells", "0.5", "--seeds", *map(str, SEEDS),
                 "--epsilons", *(f"{e:g}" for e in EPSILONS), "--methods", *DP_METHODS, "--cores", "2",
                 *set_args("--client-set", ONE_THREAD_CLIENT), *set_args("--set", ONE_THREAD_SERVER)), tuple(jobs))


def robustness_step() -> Step:
    sets = tuple(sorted({**ONE_THREAD_CLIENT, **ONE_THREAD_SERVER}.items()))
    jobs = [Job("replay", "robustness", m, dataset, cell, seed, None, (("variant", variant), ("victim", 0)), sets)
            for dataset in ("mnist", "fmnist") for cell in ("0.5", "0.1") for seed in SEEDS
            for variant in ROBUSTNESS_VARIANTS for m in ROBUSTNESS_METHODS]
    return Step("robustness", "robustness", "benchmarks.robustness",
                ("--datasets", "mnist", "fmnist", "--cells", "0.5", "0.1", "--seeds", *map(str, SEEDS),
                 "--variants", *ROBUSTNESS_VARIANTS, "--methods", *ROBUSTNESS_METHODS, "--jobs", "2",
                 *set_args("--client-set", ONE_THREAD_CLIENT), *set_args("--set", ONE_THREAD_SERVER)),
                tuple(jobs), after=("paper-grey",), estimate_from=("paper_table",))  # the paper table's uploads


def multiround_step(cell: str) -> Step:
    sets = tuple(sorted({**MULTIROUND_CLIENT, **ONE_THREAD_SERVER, "rounds": ROUNDS}.items()))
    jobs = [Job("simulation", "multiround_fedlmd", m, "mnist", cell, seed, 5, (("round", ROUNDS),), sets)
            for seed in SEEDS for m in MULTIROUND_METHODS]
    return Step(f"multiround-{cell.replace('/', '')}", "multiround_fedlmd", "benchmarks.multiround_table",
                ("--table", "multiround_fedlmd", "--dataset", "mnist", "--cell", cell, "--rounds", str(ROUNDS),
                 "--seeds", *map(str, SEEDS), "--methods", *MULTIROUND_METHODS,
                 *set_args("--set", {**MULTIROUND_CLIENT, **ONE_THREAD_SERVER})), tuple(jobs), cores=1,
                estimate_from=("paper_table",))


def release_steps() -> list[Step]:
    """Every step of the release, in the order they start (one-process steps in pairs)."""
    one_thread = {**ONE_THREAD_CLIENT}, {**ONE_THREAD_SERVER}
    return [
        paper_step("paper-grey", ("mnist", "fmnist"), GREY_CELLS, *one_thread),
        paper_step("paper-cifar10", ("cifar10",), ("0.5", "0.1"), {**CIFAR10_CLIENT, **ONE_THREAD_CLIENT},
                   {**CIFAR10_SERVER, **ONE_THREAD_SERVER}, estimate_from=CIFAR10_ESTIMATES),
        fedmho_step("mnist"), fedmho_step("fmnist"),
        hetero_step("hetero-grey", "hetero_grey", "benchmarks/conf/grey-hetero-cpu.toml", ("mnist", "fmnist")),
        hetero_step("hetero-cifar10", "hetero_cifar10", "benchmarks/conf/cifar10-hetero-cpu.toml", ("cifar10",)),
        clients_step(), dp_step(), robustness_step(),
        *(multiround_step(cell) for cell in MULTIROUND_CELLS),
    ]


# --- plan: what is done at this commit, what is left, what it costs --------------------------------------------

@dataclass
class Estimate:
    seconds: float | None
    source: str  # "this cell", "other cells", another table's records, or "none"


# a multi-round FedLMD round trains its clients as a one-shot FedAvg run does, plus the teacher's forward passes
# (FedLMD) or none (FedLMD-TF): where no multi-round record exists, a one-shot FedAvg run's time stands for a round
# (at the preset's local epochs: more than the multi-round table's 5, so the estimate errs long)
ESTIMATE_AS = {"fedlmd": "fedavg", "fedlmd-tf": "fedavg"}


@dataclass
class StepPlan:
    step: Step
    done: list[Job] = field(default_factory=list)
    todo: list[tuple[Job, Estimate]] = field(default_factory=list)

    def seconds(self) -> float:
        return sum(e.seconds for _, e in self.todo if e.seconds is not None)


def job_seconds(job: Job, record: dict) -> float | None:
    wall = record.get("wall_s") or {}
    return wall.get("total") if job.kind in ("clients", "simulation") else wall.get("server_total")


def estimate(job: Job, records: list[dict], fallback: dict[str, list[dict]] | None = None) -> Estimate:
    """The median wall time of the table's records of this job's method, dataset and clients: of its cell where there
    are some, else of the other cells; else the same from the `fallback` tables (name -> records: the paper table's
    for the replays of its poisoned uploads and for a multi-round job's rounds, ESTIMATE_AS's method standing for a
    FedLMD variant there). A multi-round simulation is that times its rounds."""
    rounds = dict(job.match).get("round", 1) if job.kind == "simulation" else 1

    def at_budget(r: dict) -> bool:  # a budget knob the job names has its value in the record (absent: the preset's)
        overrides = r.get("overrides") or {}
        return all(overrides.get(k, v) == v for k, v in job.sets if k in PRESET_KEYS)

    def alike(r: dict, label: str, same_cell: bool) -> bool:
        return (r.get("status") != "not-applicable" and method_label(r) == label and at_budget(r)
                and r.get("dataset") == job.dataset and (job.num_clients is None or r.get("num_clients") ==
                                                         job.num_clients) and (not same_cell or _cell(r) == job.cell))

    sources = [(records, job.label, "")] + [(rs, ESTIMATE_AS.get(job.label, job.label), name)
                                            for name, rs in (fallback or {}).items()]
    for found_in, label, name in sources:
        for same_cell, where in ((True, "this cell"), (False, "other cells")):
            found = [s for r in found_in if alike(r, label, same_cell) and (s := job_seconds(job, r)) is not None]
            if found:
                source = where if not name else f"{name}'s {label}, {where}" + (" per round" if rounds > 1 else "")
                return Estimate(statistics.median(found) * rounds, source)
    return Estimate(None, "none")


def plan(steps: list[Step], commit: str, records_of=None) -> list[StepPlan]:
    """Each step's jobs split into done (a record at `commit`) and to run (with their estimates); `records_of(table)`
    reads a records file (load_records)."""
    records_of = records_of or load_records
    records: dict[str, list[dict]] = {}
    plans = []
    for step in steps:
        p = StepPlan(step)
        for job in step.jobs:
            for name in (job.table, *step.estimate_from):
                if name not in records:
                    records[name] = records_of(name)
            table = records[job.table]
            if any(r.get("code_version") == commit and job.recorded_by(r) for r in table):
                p.done.append(job)
            else:
                p.todo.append((job, estimate(job, table, {name: records[name] for name in step.estimate_from})))
        plans.append(p)
    return plans


def hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h"


def plan_text(plans: list[StepPlan], commit: str, cores: int, every_job: bool = True) -> str:
    budget = ", ".join(f"{k}={v}" for k, v in {**CIFAR10_CLIENT, **CIFAR10_SERVER}.items())
    steps = f"{len(plans)} step" + ("s" if len(plans) != 1 else "")
    lines = [f"Release plan at {commit}: {steps}, at most {cores} processes at once (one torch thread each); the "
             f"cpu preset, CIFAR-10's paper-table cells at {budget} (the preset's), the multi-round cells at "
             + ", ".join(f"{k}={v}" for k, v in MULTIROUND_CLIENT.items()) + "."]
    unestimated: dict[str, list[str]] = defaultdict(list)
    for p in plans:
        others = sum(1 for _, e in p.todo if e.source not in ("this cell", "none"))
        lines += ["", f"step {p.step.name} ({p.step.table}, {p.step.cores} core{'s' if p.step.cores > 1 else ''}"
                  + (f", after {', '.join(p.step.after)}" if p.step.after else "") + f"): {len(p.step.jobs)} jobs, "
                  f"{len(p.done)} done at this commit, {len(p.todo)} to run, {hours(p.seconds())} of job time"
                  + (f" ({others} estimated from other cells or tables)" if others else ""),
                  "  python -m " + " ".join([p.step.command, *p.step.args])]
        for job, e in p.todo:
            if e.seconds is None:
                unestimated[p.step.name].append(job.describe())
            if every_job:
                lines.append(f"  {job.describe()}: " + (f"{e.seconds / 60:.1f} min ({e.source})" if e.seconds
                                                        is not None else "no estimate"))
    total = sum(p.seconds() for p in plans)
    todo = sum(len(p.todo) for p in plans)
    lines += ["", f"Total: {todo} jobs to run, {hours(total)} of job time as the records measured them; on {cores} "
              f"cores about {hours(total / cores)} if the jobs overlap fully (the records' times were measured alone "
              f"or beside one other job)."]
    if unestimated:
        lines += ["No estimate (no record of that method, dataset and clients to go by): "
                  + "; ".join(f"{name}: {len(jobs)} jobs" for name, jobs in unestimated.items())
                  + ", not in the total."]
    return "\n".join(lines)
