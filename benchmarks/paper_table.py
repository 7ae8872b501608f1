"""Paper-table benchmark (FedHydra Tables 1-2 shape) on identical client uploads.

For every dataset x cell x seed: train the clients once through the real Flower simulation
(method fedavg, which also gives the FedAvg row) and keep their uploads; then run every other
server method on those saved uploads (`replay`). One JSON record per run is appended to
benchmarks/results/<table>.jsonl; `python -m benchmarks.render` turns them into tables.

  python -m benchmarks.paper_table --datasets mnist fmnist --cells 0.5 0.3 0.1 0.01 2c/c \
      --seeds 0 1 2 --methods fedavg ot feddf dense coboosting fedhydra
A cell is a Dirichlet alpha (papers' NIID-Bench partitioner) or "2c/c". Finished records are
skipped, so an interrupted benchmark continues where it stopped (--force redoes them). A method
that cannot run on the cell's fleet (FleetNotSupported) gets a "not applicable" record with the reason.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

from benchmarks.records import (append_record, has_record, not_applicable_record, overrides_key,
                                record_from_result, resolve_variant)
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
                  client_sets: dict, force: bool, method: str = "fedavg") -> Path:
    """Clients through the real simulation once per cell (the run of `method`, recorded too);
    returns the uploads archive folder."""
    from oneshot_fl.launch import run_simulation

    name = cell_name(dataset, cell, seed)
    run_dir = BENCH_DIR / "runs" / table / name
    uploads = run_dir / "uploads"
    overrides = {"method": method, "dataset": dataset, "num-clients": num_clients, "seed": seed,
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


def run_method(table: str, uploads: Path, label: str, dataset: str, cell: str, seed: int,
               server_sets: dict, force: bool = False, method: str | None = None) -> dict:
    """Replay `method` (default: `label`) on the uploads into runs/<table>/<cell>-<label>."""
    from oneshot_fl.replay import replay

    method = method or label
    name = f"{cell_name(dataset, cell, seed)}-{label}"
    out = BENCH_DIR / "runs" / table / name
    # An interrupted replay left a distillation checkpoint here: replaying into the same folder
    # resumes it (the checkpoint's fingerprint refuses other settings or uploads). A finished run
    # found here was never recorded (or force): run it again; replay never overwrites a result.
    if out.exists() and (force or (out / "result.json").exists()):
        shutil.rmtree(out)
    start = time.perf_counter()
    result = replay(uploads, [f"method='{method}'"] + [f"{k}={json.dumps(v)}" for k, v in server_sets.items()],
                    run_dir=out)
    log.info("%s: accuracy %.4f (%.0fs)", name, result["global"]["accuracy"], time.perf_counter() - start)
    return result


def replay_methods(table: str, uploads: Path, methods: list[str], trained_by: str, dataset: str, cell: str,
                   seed: int, preset: str, client_sets: dict, server_sets: dict, force: bool) -> None:
    """Every method but the one that trained the clients, on the same uploads (or "not applicable").
    A method may be a named variant (benchmarks.records.VARIANTS, e.g. fedhydra-paper)."""
    from oneshot_fl.config import FleetNotSupported
    from oneshot_fl.replay import replay_config

    for label in methods:
        if label == trained_by:
            continue  # recorded by train_clients from the same simulation
        method, variant_sets = resolve_variant(label)
        sets = {**server_sets, **variant_sets, "preset": preset}
        key = {"method": method, "dataset": dataset, "cell": cell, "seed": seed, "preset": preset,
               "overrides_key": overrides_key({**client_sets, **sets}),
               "label": label if label != method else None}  # a relabelled old record is not this method's
        if has_record(table, key) and not force:
            continue
        extra = {"cell": cell, "run_dir": str(BENCH_DIR / "runs" / table)}
        if label != method:
            extra["label"] = label
        try:
            result = run_method(table, uploads, label, dataset, cell, seed, sets, force, method=method)
        except FleetNotSupported as exc:
            log.info("%s is not applicable to %s: %s", label, cell_name(dataset, cell, seed), exc)
            flat = replay_config(uploads, {"method": method, **sets})
            append_record(not_applicable_record(table, method, flat, str(exc), {**client_sets, **sets}, extra))
            continue
        append_record(record_from_result(table, result, {**client_sets, **sets}, extra))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", default="paper_table")
    parser.add_argument("--datasets", nargs="+", default=["mnist", "fmnist"])
    parser.add_argument("--cells", nargs="+", default=["0.5", "0.3", "0.1", "0.01", "2c/c"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=["fedavg", "ot", "feddf", "dense", "coboosting", "fedhydra"])
    parser.add_argument("--num-clients", type=int, default=5)
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--client-set", action="append", default=[],
                        help="client-side run-config overrides (local.*), e.g. \"local.epochs=5\"")
    parser.add_argument("--set", action="append", default=[], help="server-side overrides for every method")
    parser.add_argument("--force", action="store_true", help="redo runs that already have a record")
    parser.add_argument("--redo-replays", action="store_true",
                        help="redo the replays that have a record, on the uploads already kept (no retraining)")
    args = parser.parse_args(argv)
    setup_logging()
    logging.getLogger("oneshot_fl.bench").setLevel(logging.INFO)
    client_sets, server_sets = parse_sets(args.client_set), parse_sets(args.set)
    for dataset in args.datasets:
        for cell in args.cells:
            for seed in args.seeds:
                uploads = train_clients(args.table, dataset, cell, seed, args.num_clients, args.preset,
                                        client_sets, args.force)
                replay_methods(args.table, uploads, args.methods, "fedavg", dataset, cell, seed, args.preset,
                               client_sets, server_sets, args.force or args.redo_replays)
    from benchmarks.render import render

    render()
    return 0


if __name__ == "__main__":
    sys.exit(main())
