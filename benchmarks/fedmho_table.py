"""FedMHO Table IV: FedMHO / -MD / -SD, FedCVAE, and FedAvg / DENSE / FedHydra on the classifier clients.

Measures final test accuracy of every method beside FedMHO Table IV's numbers, and the upload size per client role.
For every dataset x alpha x seed (NIID-Bench Dirichlet, 10 clients):
  1. a mixed fleet through the real Flower simulation (benchmarks.fleets.fedmho_fleet): partition ids 0-4 train a
     classifier (resource-sufficient), 5-9 a CVAE and upload its decoder (resource-constrained); the server runs
     FedMHO-MD on it and the uploads are archived;
  2. on those identical uploads (`replay`): FedMHO, FedMHO-SD, and FedAvg / DENSE / FedHydra on the five classifier
     uploads (the paper's baselines; min-clients=5);
  3. FedCVAE-Ens through the simulation with every client constrained (10 decoders).
CPU budget: the `cpu` preset with classifier vgg9-small (FedMHO's VGG-9 at 1/4 width, no BN) trained 30 local epochs
(SGD 0.01, batch 64) and the paper's CVAE-small, N_syn, R_th, E_g and learning rates, except FedCVAE's server on
MNIST (Adam 1e-3 for the smaller global model: `fedcvae_server`). Records: results/<table>.jsonl; table with Table
IV beside ours: results/<table>.md.

Cost on the 2-core development machine (medians of results/fedmho_table.jsonl): a cell's mixed fleet trains in
35-45 min of CPU (MNIST / FMNIST), FedCVAE's all-decoder fleet in 10-16 min; each server method takes 2-7 min.

  nice -n 10 python -m benchmarks.fedmho_table --datasets mnist fmnist --alphas 0.5 0.1 \
      --seeds 0 1 2 --methods fedmho fedmho-md fedmho-sd fedcvae fedavg dense fedhydra
Finished records are skipped, so an interrupted table continues where it stopped (--force redoes them).
--uploads-from TABLE replays every method on the clients another table trained (server-side variants at server
cost only).
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path

from benchmarks import archives
from benchmarks.cells import best, dagger, tuned_notes, uploads_refusal
from benchmarks.fleets import BENCH_DIR, FEDMHO_CLIENT_DEFAULTS, fedmho_fleet
from benchmarks.records import (RESULTS_DIR, append_record, code_version, has_record, load_records, overrides_key,
                                record_from_result, release_version, run_code_version)
from benchmarks.render import render
from oneshot_fl.archive import load_manifest
from launcher.launch import parse_overrides, run_config_items, run_simulation
from oneshot_fl.logs import setup_logging
from launcher.replay import replay

log = logging.getLogger("oneshot_fl.bench")

# FedMHO Table IV (heterogeneous fleet, K = 10), top-1 %: (dataset, alpha) -> method -> mean.
TABLE_IV = {
    ("mnist", 0.5): {"fedavg": 85.91, "dense": 90.51, "fedcvae": 92.61, "fedmho": 93.45, "fedmho-md": 95.71,
                     "fedmho-sd": 95.67},
    ("mnist", 0.3): {"fedavg": 74.57, "dense": 86.12, "fedcvae": 91.37, "fedmho": 92.43, "fedmho-md": 93.98,
                     "fedmho-sd": 94.25},
    ("mnist", 0.1): {"fedavg": 49.12, "dense": 73.76, "fedcvae": 89.73, "fedmho": 88.48, "fedmho-md": 91.22,
                     "fedmho-sd": 91.55},
    ("fmnist", 0.5): {"fedavg": 60.24, "dense": 72.29, "fedcvae": 69.11, "fedmho": 75.30, "fedmho-md": 77.27,
                      "fedmho-sd": 77.73},
    ("fmnist", 0.3): {"fedavg": 47.36, "dense": 68.14, "fedcvae": 68.39, "fedmho": 72.36, "fedmho-md": 75.69,
                      "fedmho-sd": 76.45},
    ("fmnist", 0.1): {"fedavg": 30.37, "dense": 56.12, "fedcvae": 64.01, "fedmho": 62.14, "fedmho-md": 71.04,
                      "fedmho-sd": 69.65},
}
# In the form benchmarks/render.py takes references: label -> {(dataset, cell): value}
TABLE_IV_REFERENCES = {f"paper {m}": {(d, f"{a:g}"): row[m] for (d, a), row in TABLE_IV.items()}
                       for m in ("fedmho-md", "fedmho-sd", "fedmho", "fedcvae")}
METHODS = ["fedavg", "dense", "fedhydra", "fedcvae", "fedmho", "fedmho-md", "fedmho-sd"]
CLASSIFIER_ONLY = ("fedavg", "dense", "fedhydra")  # run on the classifier uploads only (FedMHO's baselines)
SIMULATED = ("fedmho-md", "fedcvae")  # the runs whose clients were trained (the others are replays)


def cell_name(dataset: str, alpha: float, seed: int) -> str:
    return f"{dataset}-a{alpha:g}-s{seed}"


def fedcvae_server(dataset: str, preset: str) -> dict:
    """FedCVAE's server settings of the CPU budget. On MNIST the FedMHO code trains FEDCVAE's fresh global VGG-9
    (69 M parameters) at Adam 1e-5; the cpu preset's vgg9-small (1/4 width, 4.3 M) at that lr is still climbing
    after its 10 epochs. Adam 1e-3 takes it from 71-72 % to 89.14 / 84.61 / 88.69 % on the tuning seeds
    100 / 101 / 102 (results/archive/fedmho_causes.md; Adam 1e-4 with N_syn 12,000 reached 85.11 / 83.44 on 101 / 102).
    The paper preset keeps the paper's values."""
    return {"fedcvae.lr": 1e-3} if dataset == "mnist" and preset == "cpu" else {}


def simulate(table: str, name: str, overrides: dict, force: bool) -> Path:
    """One run through the Flower simulation (skipped if its result is there; in a release run, only if the release
    commit made it); returns the run folder."""
    run_dir = BENCH_DIR / "runs" / table / name
    release = release_version()
    if (run_dir / "result.json").is_file() and (run_dir / "uploads" / "manifest.json").is_file() and not force:
        if release and not archives.trained_at(run_dir / "uploads", release):
            log.info("%s: the cached fleet is not the release commit's (%s): training it again", name, release)
        elif not (stale := stale_settings(run_dir, overrides)):
            return run_dir
        else:
            log.info("%s: the cached fleet ran other settings (%s): training it again", name, stale)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    log.info("simulating %s: %s", name, json.dumps(overrides))
    start = time.perf_counter()
    run = run_simulation({**overrides, "output-dir": str(run_dir.parent), "run-name": name}, stream=False)
    if not run.ok:
        raise RuntimeError(f"{name} failed ({run.status}): {run.status_details}\n{run.log_text[-4000:]}")
    result = run.result()
    log.info("%s: accuracy %.4f (%.0fs)", name, result["global"]["accuracy"], time.perf_counter() - start)
    archives.remember(BENCH_DIR / "runs", overrides, run_dir / "uploads", result.get("code_version") or
                      run_code_version(result) or code_version())
    return run_dir


def stale_settings(run_dir: Path, overrides: dict) -> str:
    """The overrides a cached run's archive disagrees with ("" = none): a cell's folder is named by dataset,
    alpha and seed only, so a changed client budget must not reuse the clients of the old one."""
    archived = load_manifest(run_dir / "uploads")["context"]["run_config"]
    return ", ".join(f"{k}={v!r} (cached: {archived.get(k)!r})" for k, v in sorted(overrides.items())
                     if archived.get(k) != v)


def record(table: str, result: dict, sets: dict, alpha: float, run_dir: Path, classifier: str,
           uploads: Path) -> None:
    """Append a run's record; `uploads`: the archive it ran on (the fleet's, for a replay)."""
    extra = {"cell": f"{alpha:g}", "run_dir": str(run_dir), "classifier": classifier,
             "upload_per_role": result["upload_bytes"].get("per_role"), "uploads_fp": archives.uploads_fp(uploads)}
    append_record(record_from_result(table, result, sets, extra))


def replay_method(table: str, uploads: Path, out: Path, method: str, server_sets: dict, classifier_only: bool) -> dict:
    if out.exists():
        shutil.rmtree(out)
    overrides = [f"method='{method}'", *run_config_items(server_sets)]
    if classifier_only:
        overrides.append("min-clients=5")
    start = time.perf_counter()
    result = replay(uploads, overrides, run_dir=out)
    log.info("%s: accuracy %.4f (%.0fs)", out.name, result["global"]["accuracy"], time.perf_counter() - start)
    return result


def run_cell(args, dataset: str, alpha: float, seed: int, client_sets: dict, server_sets: dict) -> None:
    table, name = args.table, cell_name(dataset, alpha, seed)

    def done(method: str, sets: dict) -> bool:
        key = {"method": method, "dataset": dataset, "cell": f"{alpha:g}", "seed": seed, "preset": args.preset,
               "overrides_key": overrides_key(sets)}
        return has_record(table, key) and not args.force

    # 1. the mixed fleet (5 classifiers + 5 decoders), FedMHO-MD on the server
    mixed = fedmho_fleet("fedmho-md", dataset, alpha, seed, args.preset, args.classifier, client_sets)
    mixed_sets = {**mixed, **server_sets}
    fleet_needed = any(m in args.methods for m in ("fedmho", "fedmho-md", "fedmho-sd", *CLASSIFIER_ONLY))
    if fleet_needed:
        run_dir = fleet_run(args, name, mixed_sets)
        # 2. the same uploads, other server methods (all of them with --uploads-from)
        replayed = ("fedmho", "fedmho-sd", *CLASSIFIER_ONLY) + (("fedmho-md",) if args.uploads_from else ())
        if "fedmho-md" in args.methods and not args.uploads_from and not done("fedmho-md", mixed_sets):
            record(table, json.loads((run_dir / "result.json").read_text()), mixed_sets, alpha, run_dir,
                   args.classifier, run_dir / "uploads")
        for method in replayed:
            sets = {**mixed_sets, "method": method, **({"min-clients": 5} if method in CLASSIFIER_ONLY else {})}
            if method not in args.methods or done(method, sets):
                continue
            out = BENCH_DIR / "runs" / table / f"{name}-{method}"
            result = replay_method(table, run_dir / "uploads", out, method, server_sets, method in CLASSIFIER_ONLY)
            record(table, result, sets, alpha, out, args.classifier, run_dir / "uploads")
    # 3. FedCVAE-Ens: every client constrained
    if "fedcvae" in args.methods:
        fedcvae_sets = {**fedcvae_server(dataset, args.preset), **server_sets}
        sets = {**fedmho_fleet("fedcvae", dataset, alpha, seed, args.preset, args.classifier, client_sets),
                **fedcvae_sets}
        if not done("fedcvae", sets):
            run_dir = fleet_run(args, f"{name}-fedcvae", sets)
            if args.uploads_from:
                out = BENCH_DIR / "runs" / table / f"{name}-fedcvae"
                result = replay_method(table, run_dir / "uploads", out, "fedcvae", fedcvae_sets, False)
                record(table, result, sets, alpha, out, args.classifier, run_dir / "uploads")
            else:
                record(table, json.loads((run_dir / "result.json").read_text()), sets, alpha, run_dir,
                       args.classifier, run_dir / "uploads")


def fleet_run(args, name: str, sets: dict) -> Path:
    """The clients of one fleet: simulated here, or (--uploads-from) the ones another table trained."""
    if not args.uploads_from:
        return simulate(args.table, name, sets, args.force)
    run_dir = BENCH_DIR / "runs" / args.uploads_from / name
    if not (run_dir / "uploads" / "manifest.json").is_file():
        raise FileNotFoundError(f"{run_dir}: no uploads archive; run table {args.uploads_from} first")
    return run_dir


def render_fedmho(table: str, out: Path | None = None) -> Path:
    """Our numbers beside Table IV, and the measured upload sizes per role (results/<table>.md, or `out`)."""
    records = load_records(table)
    latest: dict[tuple, dict] = {}
    for r in sorted(records, key=lambda r: r.get("recorded_at", "")):
        latest[(r["method"], r["dataset"], r["alpha"], r["seed"])] = r
    cells: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    shown: dict[tuple, list[dict]] = defaultdict(list)
    roles: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for r in latest.values():
        cells[(r["dataset"], r["alpha"])][r["method"]].append(100 * r["accuracy_final"])
        shown[(r["dataset"], r["alpha"])].append(r)
        if r["method"] not in SIMULATED:  # replays reuse the simulated runs' uploads: count those once
            continue
        for role, sizes in (r.get("upload_per_role") or {}).items():
            for received, raw in zip(sizes["received_bytes"], sizes["raw_bytes"]):
                roles[role].append((received, raw, sizes["label_count_bytes"]))
    methods = [m for m in METHODS if any(m in row for row in cells.values())]

    def stat(values):
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5
        return f"{mean:.2f} ± {std:.2f} ({len(values)})"

    lines = [f"# {table}", "", "Final-epoch top-1 test accuracy (%), mean ± std over seeds (n); "
             "[FedMHO Table IV] in brackets. Settings: see the records' `overrides`.", "",
             "| dataset | alpha | " + " | ".join(methods) + " | best |", "|---|---|" + "---|" * (len(methods) + 1)]
    for (dataset, alpha) in sorted(cells, key=lambda c: (c[0], -c[1])):
        head = f"| {dataset} | {alpha:g}{dagger(table, dataset, f'{alpha:g}')} | "
        # FedCVAE's clients are a fleet of their own (every client a decoder client)
        if refusal := uploads_refusal(f"{table} {dataset} {alpha:g}", shown[(dataset, alpha)], exempt=("fedcvae",)):
            lines.append(head + refusal + " |")
            continue
        row = []
        for m in methods:
            values = cells[(dataset, alpha)].get(m)
            paper = TABLE_IV.get((dataset, alpha), {}).get(m)
            row.append((stat(values) if values else "–") + (f" [{paper:.2f}]" if paper is not None else ""))
        winner = best({m: cells[(dataset, alpha)].get(m, []) for m in methods})
        lines.append(head + " | ".join(row) + f" | {winner} |")
    tuned = tuned_notes(table, {(d, f"{a:g}") for d, a in cells})
    lines += [""] + tuned if tuned else []
    lines += ["", "Client budget (the `cpu` preset otherwise): classifier clients "
              + ", ".join(f"{k}={v}" for k, v in FEDMHO_CLIENT_DEFAULTS.items()) + "; code: "
              + ", ".join(sorted({r["code_version"] for r in latest.values()})) + "."]
    decoder_archs = sorted({arch for r in latest.values() if r["method"] == "fedcvae"
                            for arch in ((r.get("upload_per_role") or {}).get("decoder") or {}).get("archs", [])})
    if decoder_archs:
        lines += ["", f"FedCVAE's clients trained {', '.join(decoder_archs)} (cvae-mlp: FedMHO's CVAE-small, "
                  "latent 2); Table IV's FEDCVAE ran CVAE-large (latent 20) on the five sufficient clients and "
                  "CVAE-small on the five constrained ones (FedMHO Table I), its Table IX CVAE-large on every client, "
                  "as `--preset paper` does (`fedcvae_cvae`; the CPU cost in results/archive/fedmho_causes.md)."]
    lines += ["", "FedAvg, DENSE and FedHydra run on the five classifier uploads of the mixed fleet (half the "
              "partitions). Table IV's FedAvg and DENSE ran on all ten clients (VGG-9 on the five sufficient ones, a "
              "small CNN on the five constrained ones; FedAvg votes between the two averages), so their bracketed "
              "numbers saw twice the data."]
    lines += ["", "Upload sizes per client role (bytes received by the server; raw = parameter bytes; "
              "counts = the int64 label histogram):", "",
              "| role | uploads (distinct) | received (max) | raw params | counts | max received / (raw + counts) |",
              "|---|---|---|---|---|---|"]
    for role, sizes in sorted(roles.items()):
        ratio = max(rec / (raw + cnt) for rec, raw, cnt in sizes)
        lines.append(f"| {role} | {len(sizes)} | {max(s[0] for s in sizes):,} | {max(s[1] for s in sizes):,} | "
                     f"{sizes[0][2]} | {ratio:.5f} |")
    out = out or RESULTS_DIR / f"{table}.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", default="fedmho_table")
    parser.add_argument("--datasets", nargs="+", default=["mnist", "fmnist"], choices=["mnist", "fmnist"])
    parser.add_argument("--alphas", nargs="+", type=float, default=[0.5, 0.3, 0.1])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--classifier", default="vgg9-small", help="classifier clients' and global architecture")
    parser.add_argument("--client-set", action="append", default=[],
                        help="client-side overrides (local.*, cvae.*) over "
                             + " ".join(f"{k}={v}" for k, v in FEDMHO_CLIENT_DEFAULTS.items()))
    parser.add_argument("--set", action="append", default=[], help="server-side overrides for every method")
    parser.add_argument("--force", action="store_true", help="redo runs that already have a record")
    parser.add_argument("--render-only", action="store_true", help="only render the table from its records")
    parser.add_argument("--uploads-from", default="", metavar="TABLE",
                        help="train no clients: replay every method on the uploads TABLE's runs archived "
                             "(server-side variants, e.g. --table fedmho_lr --uploads-from fedmho_table "
                             "--set fedcvae.lr=0.001)")
    args = parser.parse_args(argv)
    setup_logging()
    logging.getLogger("oneshot_fl.bench").setLevel(logging.INFO)
    client_sets = {**FEDMHO_CLIENT_DEFAULTS, **parse_overrides(args.client_set)}
    server_sets = parse_overrides(args.set)
    if args.render_only:
        print(render_fedmho(args.table).read_text())
        return 0
    for dataset in args.datasets:
        for alpha in args.alphas:
            for seed in args.seeds:
                run_cell(args, dataset, alpha, seed, client_sets, server_sets)
                print(render_fedmho(args.table).read_text(), flush=True)
    render()
    return 0


if __name__ == "__main__":
    sys.exit(main())
