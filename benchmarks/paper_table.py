"""Paper-table benchmark (FedHydra Tables 1-2 shape) on identical client uploads.

For every dataset x cell x seed: train the clients once through the real Flower simulation
(method fedavg, which also gives the FedAvg row) and keep their uploads; then run every other
server method on those saved uploads (`replay`). One JSON record per run is appended to
benchmarks/results/<table>.jsonl; `python -m benchmarks.render` turns them into tables.

  python -m benchmarks.paper_table --datasets mnist fmnist --cells 0.5 0.3 0.1 0.01 2c/c \
      --seeds 0 1 2 --methods fedavg dense fedhydra
A cell is a Dirichlet alpha (papers' NIID-Bench partitioner) or "2c/c". Finished records are
skipped, so an interrupted benchmark continues where it stopped (--force redoes them).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

from benchmarks.records import append_record, has_record, overrides_key, record_from_result
from oneshot_fl.logs import setup_logging

BENCH_DIR = Path(__file__).resolve().parent
log = logging.getLogger("oneshot_fl.bench")


def cell_overrides(cell: str) -> dict:
    if cell == "2c/c":
        return {"partition": "2c/c", "alpha": 0.5}
    return {"partition": "niid-bench", "alpha": float(cell)}


def cell_name(dataset: str, cell: str, seed: int) -> str:
    return f"{dataset}-{cell.replace('/', '')}-s{seed}"


def parse_sets(items: list[str]) -> dict:
    from oneshot_fl.launch import parse_overrides

    return parse_overrides(items)


def train_clients(table: str, dataset: str, cell: str, seed: int, num_clients: int, preset: str,
                  client_sets: dict, force: bool) -> Path:
    """Clients through the real simulation once per cell; returns the uploads archive folder."""
    from oneshot_fl.launch import run_simulation

    name = cell_name(dataset, cell, seed)
    run_dir = BENCH_DIR / "runs" / table / name
    uploads = run_dir / "uploads"
    overrides = {"method": "fedavg", "dataset": dataset, "num-clients": num_clients, "seed": seed,
                 "preset": preset, **cell_overrides(cell), **client_sets,
                 "output-dir": str(run_dir.parent), "run-name": name}
    if (uploads / "manifest.json").is_file() and not force:
        return uploads
    if run_dir.exists():
        shutil.rmtree(run_dir)
    log.info("training %d clients for %s (%s)", num_clients, name, json.dumps(client_sets))
    run = run_simulation(overrides, stream=False)
    if not run.ok:
        raise RuntimeError(f"client training for {name} failed ({run.status}): {run.status_details}\n"
                           f"{run.log_text[-4000:]}")
    result = run.result()
    sets = {k: v for k, v in overrides.items() if k not in ("output-dir", "run-name")}
    append_record(record_from_result(table, result, sets, {"cell": cell, "run_dir": str(run_dir)}))
    return uploads


def run_method(table: str, uploads: Path, method: str, dataset: str, cell: str, seed: int,
               server_sets: dict) -> dict:
    from oneshot_fl.replay import replay

    name = f"{cell_name(dataset, cell, seed)}-{method}"
    out = BENCH_DIR / "runs" / table / name
    if out.exists():
        shutil.rmtree(out)
    start = time.perf_counter()
    result = replay(uploads, [f"method='{method}'"] + [f"{k}={json.dumps(v)}" for k, v in server_sets.items()],
                    run_dir=out)
    log.info("%s: accuracy %.4f (%.0fs)", name, result["global"]["accuracy"], time.perf_counter() - start)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", default="paper_table")
    parser.add_argument("--datasets", nargs="+", default=["mnist", "fmnist"])
    parser.add_argument("--cells", nargs="+", default=["0.5", "0.3", "0.1", "0.01", "2c/c"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=["fedavg", "dense", "fedhydra"])
    parser.add_argument("--num-clients", type=int, default=5)
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--client-set", action="append", default=[],
                        help="client-side run-config overrides (local.*), e.g. \"local.epochs=5\"")
    parser.add_argument("--set", action="append", default=[], help="server-side overrides for every method")
    parser.add_argument("--force", action="store_true", help="redo runs that already have a record")
    args = parser.parse_args(argv)
    setup_logging()
    logging.getLogger("oneshot_fl.bench").setLevel(logging.INFO)
    client_sets, server_sets = parse_sets(args.client_set), parse_sets(args.set)
    for dataset in args.datasets:
        for cell in args.cells:
            for seed in args.seeds:
                uploads = train_clients(args.table, dataset, cell, seed, args.num_clients, args.preset,
                                        client_sets, args.force)
                for method in args.methods:
                    if method == "fedavg":
                        continue  # recorded by train_clients from the same simulation
                    sets = {**server_sets, "preset": args.preset}
                    key = {"method": method, "dataset": dataset, "cell": cell, "seed": seed,
                           "preset": args.preset, "overrides_key": overrides_key({**client_sets, **sets})}
                    if has_record(args.table, key) and not args.force:
                        continue
                    result = run_method(args.table, uploads, method, dataset, cell, seed, sets)
                    append_record(record_from_result(args.table, result, {**client_sets, **sets},
                                                     {"cell": cell, "run_dir": str(BENCH_DIR / "runs" / args.table)}))
    from benchmarks.render import render

    render()
    return 0


if __name__ == "__main__":
    sys.exit(main())
