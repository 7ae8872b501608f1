"""Multi-round table (FedHydra Table 5 shape; the FedLMD comparison): T global rounds per method, one cell.

Measures the global model's test accuracy after each round T = 1..rounds. Every method (or named variant, e.g.
`fedlmd` = FedAvg with FedLMD's label-masked local loss, `fedlmd-tf` its teacher-free form; benchmarks.records
VARIANTS) runs its own simulation with rounds=T: its global model goes back to the clients each round, so methods
cannot share uploads after round 1, which is identical for all (same seed, init and shards). One record per method,
seed and round, read from the run's round-<T>/result.json; rendered by `python -m benchmarks.render`.

Cost: one simulation per method and seed, T times a one-shot run's client training plus T server fusions (on the
2-core machine an MNIST round of 5 clients at the cpu preset trains in ~5 min of CPU; FedAvg's fusion takes seconds,
a data-free method's ~5 min). No records of this table are committed yet.

  python -m benchmarks.multiround_table --dataset mnist --cell 0.1 --rounds 3 --seeds 0 \
      --methods fedavg ot feddf dense coboosting fedhydra
  python -m benchmarks.multiround_table --dataset fmnist --cell 0.1 --rounds 20 --seeds 0 1 2 \
      --methods fedavg fedlmd fedlmd-tf --table multiround_fedlmd
Finished runs are skipped (--force redoes them).
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys

from benchmarks.fleets import BENCH_DIR, cell_name, cell_overrides, check_grid, parse_sets
from benchmarks.records import append_record, has_record, overrides_key, record_from_result, resolve_variant
from benchmarks.render import render
from oneshot_fl.config import ConfigError
from launcher.launch import run_simulation
from oneshot_fl.logs import setup_logging

log = logging.getLogger("oneshot_fl.bench")


def run_rounds(table: str, label: str, dataset: str, cell: str, seed: int, rounds: int, num_clients: int,
               preset: str, sets: dict) -> list[dict]:
    """One simulation of `label` (a method or a named variant) over `rounds` global rounds; the per-round
    results."""
    method, variant_sets = resolve_variant(label)
    name = f"{cell_name(dataset, cell, seed)}-{label}-T{rounds}"
    run_dir = BENCH_DIR / "runs" / table / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    overrides = {"method": method, "dataset": dataset, "num-clients": num_clients, "seed": seed, "rounds": rounds,
                 "preset": preset, **cell_overrides(cell), **sets, **variant_sets, "output-dir": str(run_dir.parent),
                 "run-name": name}
    run = run_simulation(overrides, stream=False)
    if not run.ok:
        raise RuntimeError(f"{name} failed ({run.status}): {run.status_details}\n{run.log_text[-4000:]}")
    return [json.loads((run_dir / f"round-{r}" / "result.json").read_text()) for r in range(1, rounds + 1)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", default="multiround")
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--cell", default="0.1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--methods", nargs="+", default=["fedavg", "ot", "feddf", "dense", "coboosting", "fedhydra"])
    parser.add_argument("--num-clients", type=int, default=5)
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--set", action="append", default=[], help="run-config overrides for every method")
    parser.add_argument("--force", action="store_true", help="redo runs that already have records")
    args = parser.parse_args(argv)
    if args.rounds < 2:
        parser.error("--rounds must be >= 2 (one round is the paper table)")
    try:
        sets = parse_sets(args.set)
        check_grid([args.dataset], [args.cell], args.seeds, args.methods, args.num_clients, args.preset, {},
                   {**sets, "rounds": args.rounds})
    except ConfigError as exc:
        parser.error(str(exc))
    setup_logging()
    log.setLevel(logging.INFO)
    for seed in args.seeds:
        for label in args.methods:
            method, variant_sets = resolve_variant(label)
            ran = {**sets, **variant_sets, "rounds": args.rounds}  # what the records list as run
            key = {"method": method, "dataset": args.dataset, "cell": args.cell, "seed": seed, "preset": args.preset,
                   "round": args.rounds, "overrides_key": overrides_key(ran),
                   "label": label if label != method else None}
            if has_record(args.table, key) and not args.force:
                continue
            results = run_rounds(args.table, label, args.dataset, args.cell, seed, args.rounds, args.num_clients,
                                 args.preset, sets)
            for result in results:
                log.info("%s seed %d round %d: accuracy %.4f", label, seed, result["round"],
                         result["global"]["accuracy"])
                extra = {"cell": args.cell, "run_dir": str(BENCH_DIR / "runs" / args.table),
                         **({"label": label} if label != method else {})}
                append_record(record_from_result(args.table, result, ran, extra))
    render()
    return 0


if __name__ == "__main__":
    sys.exit(main())
