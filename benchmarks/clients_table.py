"""Client-number table (FedHydra Table 4 shape): the same training set split over K = 5 ... 100 clients.

Measures final test accuracy per method and K, each method's server time and its ratio to the smallest K on the same
seeds, and FedHydra's model-stratification and distillation seconds per K. For each K the clients are trained once
by the FedAvg simulation (its row) and every other method replays their uploads (benchmarks.fleets); records go to
one records file per K (`results/clients-k{K}.jsonl`), the report to `results/clients.md`.

Cost on the 2-core development machine (FMNIST NIID-Bench 0.5, cpu preset, one torch thread per replay; medians of
the records): the clients of one fleet train in 5-15 min of CPU; a FedHydra or DENSE replay takes ~6 min of server
at K = 5, ~17 min at K = 20, 35-50 min at K = 50 and ~1.5 h at K = 100; Co-Boosting up to twice DENSE's.

  python -m benchmarks.clients_table --ks 5 10 20 50 100 --seeds 0 1 2 --large-k-seeds 0 \
      --methods fedavg dense coboosting fedhydra --jobs 2 --set threads=1 --client-set threads=1
Finished records are skipped (--force redoes them); --render-only rewrites the report from the records.
"""
from __future__ import annotations

import argparse
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from benchmarks.cells import best, dagger, tuned_notes, uploads_refusal
from benchmarks.fleets import Fleet, add_fleet_arguments, check_fleets, concurrency, parse_sets, run_fleets
from benchmarks.records import RESULTS_DIR, load_records, provenance_line
from benchmarks.render import NOT_RUN, _stat, latest, method_label
from launcher.cli import bounded
from oneshot_fl.config import ConfigError
from oneshot_fl.logs import setup_logging

METHOD_ORDER = ("fedavg", "dense", "coboosting", "fedhydra")


def table_name(k: int) -> str:
    return f"clients-k{k}"


def seeds_for(k: int, seeds: list[int], large_k: int, large_k_seeds: list[int]) -> list[int]:
    """The paper's protocol at CPU cost: every seed for small fleets, fewer where K >= large_k."""
    return large_k_seeds if k >= large_k else seeds


def server_seconds(records: list[dict]) -> list[float]:
    """The server time of each record that has one."""
    return [s for r in records if (s := (r.get("wall_s") or {}).get("server_total")) is not None]


def collect(ks: list[int], dataset: str, cell: str) -> dict[tuple[int, str], list[dict]]:
    """(K, method) -> the latest record per seed of that K's table for the dataset and cell."""
    by: dict[tuple[int, str], list[dict]] = defaultdict(list)
    for k in ks:
        records = [r for r in load_records(table_name(k)) if r.get("status") != "not-applicable"
                   and r["dataset"] == dataset and r.get("cell") == cell]
        for r in latest(records):
            by[(k, method_label(r))].append(r)
    return by


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def recorded_ks(results_dir: Path | None = None) -> list[int]:
    """Every K with a records file, in increasing order: the report shows all of them (times as ratios to the
    smallest), whichever K one invocation ran."""
    return sorted(int(m.group(1)) for path in (results_dir or RESULTS_DIR).glob("clients-k*.jsonl")
                  if (m := re.fullmatch(r"clients-k(\d+)\.jsonl", path.name)))


def render(ks: list[int] | None = None, dataset: str = "fmnist", cell: str = "0.5", out: Path | None = None) -> Path:
    ks = recorded_ks() if ks is None else ks
    by = collect(ks, dataset, cell)
    methods = [m for m in METHOD_ORDER if any((k, m) in by for k in ks)]
    methods += sorted({m for _k, m in by} - set(methods))
    base_k = ks[0]
    lines = [f"# Client number: {dataset} NIID-Bench {cell}, the same training set split over K clients", "",
             "Final test accuracy (%), mean ± std over seeds (n); every method on the same uploads per K and seed. "
             "Command: `python -m benchmarks.clients_table` (benchmarks/README.md); records: "
             + ", ".join(f"`{table_name(k)}.jsonl`" for k in ks) + ".", "",
             "| K | " + " | ".join(methods) + " | best |", "|" + "---|" * (len(methods) + 2)]
    for k in ks:
        row = f"| {k}{dagger(table_name(k), dataset, cell)} | "
        shown = [r for m in methods for r in by.get((k, m), [])]
        if refusal := uploads_refusal(f"{table_name(k)} {dataset} {cell}", shown):
            lines.append(row + refusal + " |")
            continue
        values = {m: [r["accuracy_final"] for r in by.get((k, m), [])] for m in methods}
        lines.append(row + " | ".join(_stat(values[m]) for m in methods) + f" | {best(values)} |")
    tuned = [f"K = {k}: {note}" for k in ks for note in tuned_notes(table_name(k), {(dataset, cell)})]
    lines += [""] + tuned if tuned else []
    lines += ["", f"Server time (s, mean over seeds) and its ratio to K = {base_k} on the same seeds (same method: a K "
              f"run on seed 0 alone is compared with K = {base_k}'s seed 0, whose fleet holds the same training set):",
              "", "| K | " + " | ".join(methods) + " |", "|" + "---|" * (len(methods) + 1)]
    for k in ks:
        cells = []
        for m in methods:
            records = by.get((k, m), [])
            t = _mean(server_seconds(records))
            seeds = {r["seed"] for r in records}
            base = _mean(server_seconds([r for r in by.get((base_k, m), []) if r["seed"] in seeds]))
            if t is None:
                cells.append(NOT_RUN)
            elif base:
                cells.append(f"{t:.1f} ({t / base:.2f}x)")
            else:
                cells.append(f"{t:.1f}")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    hydra = [(k, by[(k, "fedhydra")]) for k in ks if (k, "fedhydra") in by]
    if hydra:
        lines += ["", "FedHydra's server time by stage (s, mean over seeds): model stratification runs K x C generator "
                  "trainings, distillation queries K teachers per step.", "",
                  "| K | stratification | distillation | stratification share |", "|---|---|---|---|"]
        for k, rs in hydra:
            ms = _mean([r["wall_s"].get("stratification", 0.0) for r in rs])
            dist = _mean([r["wall_s"].get("distillation", 0.0) for r in rs])
            lines.append(f"| {k} | {ms:.1f} | {dist:.1f} | {ms / max(ms + dist, 1e-9):.0%} |")
    lines += ["", "Times are wall seconds, one torch thread per replay; a replay beside other jobs runs up to ~2x "
              "slower on these 2 cores: compare ratios of replays made in the same conditions.",
              provenance_line(r for rs in by.values() for r in rs), ""]
    out = out or RESULTS_DIR / "clients.md"
    out.write_text("\n".join(lines))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fmnist")
    parser.add_argument("--cell", default="0.5", help="NIID-Bench Dirichlet alpha (or 2c/c)")
    parser.add_argument("--ks", nargs="+", type=bounded(2, int), default=[5, 10, 20, 50, 100])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--large-k", type=int, default=50, help="from this K on, only --large-k-seeds run")
    parser.add_argument("--large-k-seeds", nargs="+", type=int, default=[0])
    add_fleet_arguments(parser, list(METHOD_ORDER))
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args(argv)
    if sorted(args.ks) != args.ks:
        parser.error("--ks: give the client numbers in increasing order (ratios are taken to the first)")
    failed = 0
    if not args.render_only:
        try:
            client_sets, server_sets = parse_sets(args.client_set), parse_sets(args.set)
            fleets = [Fleet(table_name(k), args.dataset, args.cell, seed, k, client_sets)
                      for k in args.ks for seed in seeds_for(k, args.seeds, args.large_k, args.large_k_seeds)]
            check_fleets(fleets, args.methods, args.preset, server_sets)
        except ConfigError as exc:
            parser.error(str(exc))
        setup_logging()
        failed = run_fleets(fleets, args.methods, args.preset, server_sets, force=args.force, **concurrency(args),
                            redo_replays=args.redo_replays,
                            on_record=lambda: render(None, args.dataset, args.cell))
    print(render(None, args.dataset, args.cell))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
