"""DP table: accuracy against the clients' privacy budget, every server method on the same uploads per cell.

Measures final test accuracy per method at epsilon 1, 3, 8 and without DP (delta 1e-5), and each fleet's client
training time per client. For each epsilon the clients are trained once by the FedAvg simulation (its row) with
`local.dp.epsilon` set and the DP variant of the model (GroupNorm, `cnn2-gn`: a DP client has no BatchNorm); the
no-DP column trains the same architecture without DP, so the columns differ by the privacy mechanism alone.
FedMHO-MD serves a fleet of its own, twice --num-clients, whose second half are decoder clients (FedMHO's K = 10:
5 classifier + 5 CVAE clients), trained by its simulation. Records: one file per epsilon
(`results/dp-eps{epsilon}.jsonl`, `dp-eps0` = no DP; FedMHO-MD's `dp-eps{epsilon}-mixed.jsonl`); report
`results/dp.md` (a server budget named with `--set distill.epochs=N` gets rows of its own).

Cost on the 2-core development machine (MNIST / FMNIST NIID-Bench 0.5, cpu preset; medians of the records): a DP
fleet's five clients train in 15-25 min of CPU at 20 DP-SGD passes, a plain fleet's in 10-17 min; a FedHydra or DENSE
replay takes 3-9 min of server; FedMHO-MD's mixed fleet 10-20 min of clients and 2-9 min of server.

  python -m benchmarks.dp_table --datasets mnist fmnist --cells 0.5 --seeds 0 1 2 --epsilons 1 3 8 0 \
      --methods fedavg dense fedhydra fedmho-md --jobs 2 --set threads=1 --client-set threads=1
Finished records are skipped (--force redoes them); --render-only rewrites the report from the records.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from benchmarks.cells import best, dagger, uploads_refusal
from benchmarks.fleets import Fleet, add_fleet_arguments, check_fleets, concurrency, parse_sets, run_fleets
from benchmarks.records import RESULTS_DIR, load_records, provenance_line
from benchmarks.render import _stat, latest, method_label
from launcher.cli import bounded
from oneshot_fl.config import ConfigError
from oneshot_fl.logs import setup_logging
from oneshot_fl.presets import PRESETS

METHOD_ORDER = ("fedavg", "dense", "coboosting", "fedhydra", "fedmho-md")
DP_MODEL = "cnn2-gn"  # the DP variant of the papers' MNIST CNN (GroupNorm in place of BatchNorm)


MIXED = "fedmho-md"  # serves its own fleet: 5 classifier + 5 decoder clients (FedMHO's K = 10)


def table_name(epsilon: float, mixed: bool = False) -> str:
    return f"dp-eps{epsilon:g}" + ("-mixed" if mixed else "")


def epsilon_label(epsilon: float) -> str:
    return "no DP" if epsilon == 0 else f"{epsilon:g}"


def client_sets_for(epsilon: float, model: str, extra: dict, preset: str = "cpu") -> dict:
    """A fleet's client settings. A DP fleet names its DP-SGD passes (the preset's unless --client-set gives them),
    so that its records say how long its clients trained (client_epochs)."""
    sets = {"model": model, "local.dp.epsilon": float(epsilon), **extra}
    if epsilon > 0:
        sets.setdefault("local.dp.epochs", PRESETS[preset]["local.dp.epochs"])
    return sets


def fleets_for(datasets: list[str], cells: list[str], seeds: list[int], epsilons: list[float], methods: list[str],
               model: str, num_clients: int, extra: dict, preset: str = "cpu") -> list[Fleet]:
    """Per dataset, cell, seed and epsilon: the classifier fleet the classifier methods share (FedAvg trains it),
    and FedMHO-MD's own mixed fleet of 2 x num_clients (the second half decoder clients)."""
    classifier_methods = tuple(m for m in methods if m != MIXED)
    fleets = []
    for dataset in datasets:
        for cell in cells:
            for seed in seeds:
                for epsilon in epsilons:
                    sets = client_sets_for(epsilon, model, extra, preset)
                    if classifier_methods:
                        fleets.append(Fleet(table_name(epsilon), dataset, cell, seed, num_clients, sets,
                                            methods=classifier_methods))
                    if MIXED in methods:
                        fleets.append(Fleet(table_name(epsilon, True), dataset, cell, seed, 2 * num_clients,
                                            {**sets, "fedmho.constrained-clients": num_clients}, trained_by=MIXED,
                                            methods=(MIXED,)))
    return fleets


def client_seconds(record: dict) -> float | None:
    """Mean local training seconds per client of the run that trained the fleet (clients train one after the
    other in these simulations, so wall_s.local is their sum)."""
    local = (record.get("wall_s") or {}).get("local")
    return local / record["num_clients"] if local is not None and record.get("num_clients") else None


def recorded_epsilons(results_dir: Path | None = None) -> list[float]:
    """Every epsilon with a records file, no DP last: the report shows all of them, whichever subset one
    invocation ran."""
    found = {float(m.group(1)) for path in (results_dir or RESULTS_DIR).glob("dp-eps*.jsonl")
             if (m := re.fullmatch(r"dp-eps([0-9.]+)(?:-mixed)?\.jsonl", path.name))}
    return sorted(found, key=lambda e: (e == 0, e))


def distill_epochs(record: dict) -> int | None:
    """The distillation budget a record's server ran at: its `distill.epochs` override, else its preset's
    (None for a preset that sets none)."""
    overrides = record.get("overrides") or {}
    return overrides.get("distill.epochs", PRESETS.get(record.get("preset", "cpu"), {}).get("distill.epochs"))


def client_epochs(record: dict, epsilon: float) -> int | None:
    """The passes each client of the record's fleet trained: `local.dp.epochs` in a DP fleet, `local.epochs`
    without DP (the override, else the preset's). Records from before `local.dp.epochs` existed name neither: their
    DP clients trained `local.epochs` passes."""
    overrides, preset = record.get("overrides") or {}, PRESETS.get(record.get("preset", "cpu"), {})
    if epsilon > 0 and "local.dp.epochs" in overrides:
        return overrides["local.dp.epochs"]
    return overrides.get("local.epochs", preset.get("local.epochs"))


def render(epsilons: list[float] | None = None, out: Path | None = None) -> Path:
    """One row per dataset, cell, client epochs, distillation budget and epsilon (a setting run on some fleets only
    gets rows of its own, never mixed into another's means); the client time is the fleet's, whichever budget."""
    epsilons = recorded_epsilons() if epsilons is None else epsilons
    by: dict[tuple[str, str, float, tuple, str], list[dict]] = defaultdict(list)
    seconds: dict[tuple[str, str, float, int | None], list[float]] = defaultdict(list)
    for epsilon in epsilons:
        records = [r for mixed in (False, True) for r in load_records(table_name(epsilon, mixed))
                   if r.get("status") != "not-applicable"]
        by_setting = defaultdict(list)
        for r in records:
            by_setting[(client_epochs(r, epsilon), distill_epochs(r))].append(r)
        for setting, group in by_setting.items():
            for r in latest(group):
                by[(r["dataset"], r["cell"], epsilon, setting, method_label(r))].append(r)
            trainings = [r for r in group if method_label(r) == "fedavg" and client_seconds(r)]
            for r in latest(trainings):  # a fleet's training, once per seed (replays train nothing)
                seconds[(r["dataset"], r["cell"], epsilon, setting[0])].append(client_seconds(r))
    methods = [m for m in METHOD_ORDER if any(k[4] == m for k in by)]
    methods += sorted({k[4] for k in by} - set(methods))
    rows = sorted({k[:2] for k in by})
    settings = sorted({k[3] for k in by}, key=lambda s: tuple((v is None, v or 0) for v in s))
    lines = ["# Differentially private clients: accuracy against epsilon", "",
             "Final test accuracy (%), mean ± std over seeds (n); every method on the same uploads per cell and "
             f"epsilon; clients `{DP_MODEL}` (GroupNorm) with and without DP-SGD, delta 1e-5; {MIXED} on its own "
             "fleet of 10 (5 of them decoder clients, their CVAEs trained with DP-SGD too). Distill epochs: the "
             "generator-based servers' distillation budget (`distill.epochs`; FedAvg and FedMHO-MD do not use it); "
             "client epochs: each client's passes over its shard (`local.dp.epochs` with DP, `local.epochs` "
             "without). "
             "Command: `python -m benchmarks.dp_table` (benchmarks/README.md); records: "
             + ", ".join(f"`{table_name(e)}.jsonl`" for e in epsilons) + f" (and `-mixed` for {MIXED}).", "",
             "| dataset | cell | epsilon | client epochs | distill epochs | " + " | ".join(methods)
             + " | best | client training s (mean per client) |",
             "|" + "---|" * (len(methods) + 7)]
    for dataset, cell in rows:
        for setting in settings:
            for epsilon in epsilons:
                if not any(by.get((dataset, cell, epsilon, setting, m)) for m in methods):
                    continue
                values = {m: [r["accuracy_final"] for r in by.get((dataset, cell, epsilon, setting, m), [])]
                          for m in methods}
                trained = seconds.get((dataset, cell, epsilon, setting[0]))
                client_s = f"{statistics.fmean(trained):.1f}" if trained else "not run"
                epochs, budget = (value if value else "–" for value in setting)
                row = (f"| {dataset} | {cell}{dagger(table_name(epsilon), dataset, cell)} | "
                       f"{epsilon_label(epsilon)} | {epochs} | {budget} | ")
                shown = [r for m in methods for r in by.get((dataset, cell, epsilon, setting, m), [])]
                # FedMHO-MD serves a fleet of its own: its uploads are not the classifier fleet's
                if refusal := uploads_refusal(f"{table_name(epsilon)} {dataset} {cell}", shown, exempt=(MIXED,)):
                    lines.append(row + refusal + " |")
                    continue
                lines.append(row + " | ".join(_stat(values[m]) for m in methods) + f" | {best(values)} | {client_s} |")
    lines += ["", "Client time is wall seconds on a shared machine: compare the DP and no-DP rows of one cell.",
              provenance_line(r for rs in by.values() for r in rs), ""]
    out = out or RESULTS_DIR / "dp.md"
    out.write_text("\n".join(lines))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["mnist", "fmnist"])
    parser.add_argument("--cells", nargs="+", default=["0.5"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epsilons", nargs="+", type=bounded(0.0, float), default=[1.0, 3.0, 8.0, 0.0],
                        help="client privacy budgets; 0 = the same clients without DP")
    parser.add_argument("--model", default=DP_MODEL, help="client (and server) architecture, a DP one")
    parser.add_argument("--num-clients", type=int, default=5)
    add_fleet_arguments(parser, ["fedavg", "dense", "fedhydra", MIXED])
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args(argv)
    failed = 0
    if not args.render_only:
        try:
            extra, server_sets = parse_sets(args.client_set), parse_sets(args.set)
            fleets = fleets_for(args.datasets, args.cells, args.seeds, args.epsilons, args.methods, args.model,
                                args.num_clients, extra, args.preset)
            check_fleets(fleets, args.methods, args.preset, server_sets)
        except ConfigError as exc:
            parser.error(str(exc))
        setup_logging()
        failed = run_fleets(fleets, args.methods, args.preset, server_sets, force=args.force, **concurrency(args),
                            redo_replays=args.redo_replays,
                            on_record=render)
    print(render())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
