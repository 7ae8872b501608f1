"""Robustness table: one poisoned client of K, every server method on identical uploads.

Measures final test accuracy of each method (variants such as fedhydra-paper allowed) on the paper table's uploads
with client `--victim` replaced (benchmarks.poisoning: flip, random, scale10, shuffled) or left out (minus: the
honest bar, min-clients K-1), and per seed each poisoned variant's loss against minus, bold where it exceeds 2
points. Records: results/robustness.jsonl (variant and victim named); report results/robustness.md.

Cost on the 2-core development machine (cpu preset, one torch thread per replay; medians of the records): ~3 min of
server per FedHydra or DENSE replay on MNIST / FMNIST; the clients are the paper table's (trained there if missing,
~5 min of CPU per cell); `shuffled` retrains one client (~1 min).

  python -m benchmarks.robustness --datasets mnist fmnist --cells 0.5 0.1 --seeds 0 1 \
      --variants honest flip random scale10 minus --methods fedhydra fedhydra-paper dense coboosting --jobs 2
Finished records are skipped (--force redoes them).
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from collections import defaultdict
from pathlib import Path

from benchmarks import archives
from benchmarks.cells import best, dagger, tuned_notes, uploads_refusal
from benchmarks.fleets import (BENCH_DIR, ReplayJob, ReplayRunner, cell_name, check_grid, parse_sets, train_clients,
                               uploads_id)
from benchmarks.poisoning import VARIANTS, make_variant
from benchmarks.render import _stat, method_label
from benchmarks.records import (RESULTS_DIR, has_record, load_records, overrides_key, provenance_line,
                                resolve_variant)
from launcher.cli import bounded
from oneshot_fl.config import ConfigError
from oneshot_fl.logs import setup_logging

TABLE = "robustness"
log = logging.getLogger("oneshot_fl.bench")


def plan(args, client_sets: dict, server_sets: dict) -> list[ReplayJob]:
    """Every (cell, seed, variant, method) run that has no record yet; trains missing clients."""
    jobs = []
    for dataset in args.datasets:
        for cell in args.cells:
            for seed in args.seeds:
                uploads = train_clients(args.uploads_from, dataset, cell, seed, args.num_clients, args.preset,
                                        client_sets, False)
                trained = json.loads((uploads / "manifest.json").read_text())["context"]["run_config"].get("preset")
                if trained != args.preset:
                    raise SystemExit(f"{uploads} was trained with preset {trained!r}, not {args.preset!r}: pass "
                                     f"--uploads-from a table trained at {args.preset!r}")
                source = uploads_id(uploads)  # the honest archive every variant of this cell is made from
                for variant in args.variants:
                    out = BENCH_DIR / "runs" / args.table / f"{cell_name(dataset, cell, seed)}-{variant}-v{args.victim}"
                    archive = make_variant(uploads, variant, args.victim, out / "uploads")
                    content = archives.uploads_fp(archive)  # what this variant's methods run on
                    for label in args.methods:
                        method, variant_sets = resolve_variant(label)
                        sets = {**server_sets, **variant_sets, "preset": args.preset, "threads": 1}
                        if variant == "minus":
                            sets["min-clients"] = args.num_clients - 1
                        key = {"method": method, "dataset": dataset, "cell": cell, "seed": seed, "variant": variant,
                               "victim": args.victim, "overrides_key": overrides_key({**client_sets, **sets}),
                               "uploads_id": source}
                        if has_record(args.table, key) and not args.force:
                            continue
                        run_dir = out / label
                        if args.force and run_dir.exists():
                            shutil.rmtree(run_dir)
                        extra = {"cell": cell, "variant": variant, "victim": args.victim, "run_dir": str(run_dir),
                                 "uploads_id": source, "uploads_fp": content,
                                 **({"label": label} if label != method else {})}
                        jobs.append(ReplayJob(args.table, archive, label, method, sets, run_dir,
                                              {**client_sets, **sets}, extra))
    return jobs


def run_jobs(jobs: list[ReplayJob], workers: int, table: str = TABLE) -> None:
    """benchmarks.fleets' runner: one fresh worker process per replay, each record appended (and the
    table rendered) as its replay ends."""
    runner = ReplayRunner(workers, on_record=lambda: render(table))
    for job in jobs:
        runner.submit(job)
    runner.close()


BAR = -0.02  # a poisoned fleet may lose at most 2 points against the victim left out


def bar_lines(records, labels: list[str]) -> list[str]:
    """Per seed: each poisoned variant's accuracy minus `minus` on the same source uploads (records
    without an uploads fingerprint cannot be paired and are left out), marked where it loses more than
    2 points: a mean over seeds can hide one seed that falls through."""
    acc = {(method_label(r), r["dataset"], r["cell"], r["seed"], r["victim"], r["uploads_id"], r["variant"]):
           r["accuracy_final"] for r in records if r.get("uploads_id")}
    rows = sorted({k[1:6] for k in acc if k[6] == "minus"})
    if not rows:
        return []
    poisoned = [v for v in VARIANTS if v not in ("honest", "minus")]
    lines = ["", "Per seed, each poisoned variant minus the victim left out (points, same source uploads); "
             "**bold**: more than 2 points lost.", "",
             "| dataset | cell | seed | victim | method | minus | " + " | ".join(poisoned) + " |",
             "|" + "---|" * (6 + len(poisoned))]
    for dataset, cell, seed, victim, uploads in rows:
        for label in labels:
            bar = acc.get((label, dataset, cell, seed, victim, uploads, "minus"))
            if bar is None:
                continue
            deltas = []
            for variant in poisoned:
                got = acc.get((label, dataset, cell, seed, victim, uploads, variant))
                if got is None:
                    deltas.append("-")
                    continue
                text = f"{100 * (got - bar):+.2f}"
                deltas.append(f"**{text}**" if got - bar < BAR else text)
            lines.append(f"| {dataset} | {cell} | {seed} | p{victim} | {label} | {100 * bar:.2f} | "
                         + " | ".join(deltas) + " |")
    return lines


def render(table: str = TABLE, out: Path | None = None) -> Path:
    """results/<table>.md: one row per (dataset, cell, variant), one column per method."""
    records = {}
    for r in sorted(load_records(table), key=lambda r: r.get("recorded_at", "")):
        records[(method_label(r), r["dataset"], r["cell"], r["seed"], r["variant"], r["victim"])] = r
    by = defaultdict(list)
    for (label, dataset, cell, _seed, variant, victim), r in records.items():
        by[(dataset, cell, variant, victim, label)].append(r)
    order = ["fedhydra", "fedhydra-capped", "fedhydra-paper", "dense", "coboosting"]
    labels = sorted({k[0] for k in records}, key=lambda m: order.index(m) if m in order else len(order))
    rows = sorted({k[:4] for k in by}, key=lambda k: (k[0], k[1], VARIANTS.index(k[2]) if k[2] in VARIANTS else 9))
    lines = ["# Robustness: one poisoned client", "",
             "Final-epoch test accuracy (%), mean ± std over seeds (n), every method on the same uploads; "
             "`victim` = the partition id replaced; `minus` = the victim left out (the honest bar). Command: "
             f"`python -m benchmarks.robustness` (see benchmarks/README.md); records: `{table}.jsonl`.", "",
             "| dataset | cell | variant | victim | " + " | ".join(labels) + " | best |",
             "|" + "---|" * (5 + len(labels))]
    for row in rows:
        head = f"| {row[0]} | {row[1]}{dagger(table, row[0], row[1])} | {row[2]} | p{row[3]} | "
        shown = [r for label in labels for r in by.get((*row, label), [])]
        if refusal := uploads_refusal(f"{table} {row[0]} {row[1]} {row[2]} p{row[3]}", shown):
            lines.append(head + refusal + " |")
            continue
        values = {label: [r["accuracy_final"] for r in by.get((*row, label), [])] for label in labels}
        lines.append(head + " | ".join(_stat(values[label]) for label in labels) + f" | {best(values)} |")
    tuned = tuned_notes(table, {row[:2] for row in rows})
    lines += [""] + tuned if tuned else []
    lines += bar_lines(records.values(), labels)
    lines += ["", provenance_line(records.values()), ""]
    out = out or RESULTS_DIR / f"{table}.md"
    out.write_text("\n".join(lines))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["mnist", "fmnist"])
    parser.add_argument("--cells", nargs="+", default=["0.5", "0.1"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--victim", type=int, default=0, help="partition id of the poisoned client")
    parser.add_argument("--methods", nargs="+", default=["fedhydra", "fedhydra-paper", "dense", "coboosting"])
    parser.add_argument("--num-clients", type=int, default=5)
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--table", default=TABLE, help="records file (results/<table>.jsonl) and run folder")
    parser.add_argument("--uploads-from", default="paper_table",
                        help="the paper-table records whose uploads are poisoned (trained there if missing)")
    parser.add_argument("--client-set", action="append", default=[], help="client-side overrides (local.*)")
    parser.add_argument("--set", action="append", default=[], help="server-side overrides for every method")
    parser.add_argument("--jobs", type=bounded(1, int), default=1, help="replays run at once (one torch thread each)")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args(argv)
    if not 0 <= args.victim < args.num_clients:
        parser.error(f"--victim {args.victim}: a partition id in 0..{args.num_clients - 1}")
    try:
        client_sets, server_sets = parse_sets(args.client_set), parse_sets(args.set)
        check_grid(args.datasets, args.cells, args.seeds, args.methods, args.num_clients, args.preset, client_sets,
                   server_sets)
    except ConfigError as exc:
        parser.error(str(exc))
    setup_logging()
    logging.getLogger("oneshot_fl.bench").setLevel(logging.INFO)
    if not args.render_only:
        jobs = plan(args, client_sets, server_sets)
        log.info("%d replays to run, %d at a time", len(jobs), args.jobs)
        run_jobs(jobs, args.jobs, args.table)
    print(render(args.table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
