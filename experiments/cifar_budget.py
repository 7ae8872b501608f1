"""CIFAR-10's budget on 2 cores, read off a curve on tuning fleets (seeds >= 100, never reported).

The paper-table CIFAR-10 cells run at the budget this curve chose (benchmarks/release_plan.py: CIFAR10_CLIENT,
CIFAR10_SERVER, the cpu preset's; docs/decisions.md). It measures what each budget buys on the same kind of fleet
(5 cnn3-bn clients, NIID-Bench, the cpu preset), so the budget is chosen from a curve and its cost is named:

  local   per local budget (epochs E, augmentation A): the fleet's clients trained once through the real
          simulation (the FedAvg row); client accuracies, their ensemble (the DENSE row's), client time
  server  per distillation budget (epochs T; generator and student steps the release's unless --set): each
          method replayed on those same uploads; its student and server time

One records file per local budget, results/cifar10_budget-e<E>-<A>.jsonl (its uploads under
benchmarks/runs/cifar10_budget-e<E>-<A>/); finished runs are skipped, so an interrupted curve resumes.

  python -m experiments.cifar_budget run --cell 0.1 --seed 100                     # the release's budget
  python -m experiments.cifar_budget run --cell 0.5 --seed 100 --local-epochs 3 6 --distill-epochs 10 20 \
      --set distill.generator-steps=10 --set distill.kd-steps=20                  # the report's cut rows
  python -m experiments.cifar_budget render          # results/cifar10_budget.md
Cost on the 2-core machine, one thread per run beside one other (this curve's records, NIID-Bench 0.5): a fleet's
five clients 3.5-5 min per local epoch (full shards, 623-754 s at 3 epochs, 2,994 at 10); DENSE and FedHydra 13-16 s per
distillation epoch at 10 generator / 20 student steps, about 27 s at the preset's 20 / 50, plus about a minute around
it, and FedHydra's stratification (33-41 s).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from benchmarks.fleets import Fleet, check_fleets, parse_sets, run_fleets
from benchmarks.records import RESULTS_DIR, load_records
from benchmarks.release_plan import CIFAR10_CLIENT, CIFAR10_SERVER, ONE_THREAD_CLIENT, ONE_THREAD_SERVER
from oneshot_fl.config import ConfigError
from oneshot_fl.logs import setup_logging

PREFIX = "cifar10_budget"
REPORT = RESULTS_DIR / f"{PREFIX}.md"
METHODS = ("fedavg", "dense", "fedhydra")
AUGMENTATIONS = ("none", "crop-flip")
SERVER_KEYS = ("distill.epochs", "distill.generator-steps", "distill.kd-steps")  # what tells two server budgets apart


def table_of(local_epochs: int, augment: str) -> str:
    """One local budget's records file and runs folder: a fleet's folder keeps the uploads of one client setting."""
    return f"{PREFIX}-e{local_epochs}-{augment}"


def client_sets(local_epochs: int, augment: str) -> dict:
    return {**CIFAR10_CLIENT, **ONE_THREAD_CLIENT, "local.epochs": local_epochs, "local.augment": augment}


def server_sets(distill_epochs: int, extra: dict) -> dict:
    return {**CIFAR10_SERVER, **ONE_THREAD_SERVER, "distill.epochs": distill_epochs, **extra}


def command_run(args) -> int:
    if args.seed < 100:
        print("oneshot-fl: error: a budget curve runs on tuning seeds (>= 100); seeds 0-2 are the reported cells",
              file=sys.stderr)
        return 2
    extra = parse_sets(args.set)
    # the local budgets in the order given: each fleet trains once, its replays at each distillation budget follow
    plan = [(Fleet(table_of(e, a), "cifar10", args.cell, args.seed, 5, client_sets(e, a)), server_sets(t, extra))
            for e in args.local_epochs for a in args.augment for t in args.distill_epochs]
    try:
        for fleet, sets in plan:
            check_fleets([fleet], list(args.methods), "cpu", sets)
    except ConfigError as exc:
        print(f"oneshot-fl: error: {exc}", file=sys.stderr)
        return 2
    failed = 0
    for fleet, sets in plan:
        failed += run_fleets([fleet], list(args.methods), "cpu", sets, jobs=1, force=False)
        render()
    return 1 if failed else 0


# --- the report -----------------------------------------------------------------------------------------------------

def budget_records() -> list[dict]:
    out = []
    for path in sorted(RESULTS_DIR.glob(f"{PREFIX}-e*.jsonl")):
        out += load_records(path.stem)
    return out


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def rows(records: list[dict]) -> list[dict]:
    """One row per fleet (cell, seed, local budget) and distillation budget (epochs, generator steps, student steps
    per epoch): the clients (from the training run), FedAvg, the ensemble and each method's student with its server
    seconds (the latest record of each)."""
    latest: dict[tuple, dict] = {}
    for r in sorted(records, key=lambda r: r.get("recorded_at", "")):
        o = r.get("overrides", {})
        fleet = (r.get("cell") or str(r.get("alpha")), r["seed"], o.get("local.epochs"), o.get("local.augment"))
        server = tuple(o.get(k) for k in SERVER_KEYS)
        latest[(*fleet, server, r["method"])] = r
    fleets: dict[tuple, dict] = defaultdict(dict)
    for (*fleet, server, method), r in latest.items():
        fleets[tuple(fleet)][(server, method)] = r
    out = []
    for fleet, runs in sorted(fleets.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2] or 0, kv[0][3] or "")):
        trainer = next((r for (_, m), r in runs.items() if m == "fedavg"), None)
        clients = (trainer or next(iter(runs.values()))).get("client_accuracy") or []
        servers = {b for b, m in runs if m != "fedavg" and b[0] is not None}
        for budget in sorted(servers, key=lambda b: tuple(v or 0 for v in b)):
            epochs, generator_steps, kd_steps = budget
            row = {"cell": fleet[0], "seed": fleet[1], "local_epochs": fleet[2], "augment": fleet[3],
                   "distill_epochs": epochs, "generator_steps": generator_steps, "kd_steps": kd_steps,
                   "clients": clients,
                   "client_s": (trainer or {}).get("wall_s", {}).get("local"),
                   "fedavg": (trainer or {}).get("accuracy_final")}
            for method in METHODS[1:]:
                r = runs.get((budget, method))
                row[method] = None if r is None else r.get("accuracy_final")
                row[f"{method}_s"] = None if r is None else r.get("wall_s", {}).get("server_total")
                if method == "dense" and r is not None:
                    row["ensemble"] = r.get("ensemble_accuracy")
                if method == "fedhydra" and r is not None:  # its SA teacher at the end of distillation
                    row["fedhydra_teacher"] = r.get("ensemble_accuracy")
            out.append(row)
    return out


def render(path: Path = REPORT) -> str:
    records = budget_records()
    versions = sorted({r.get("code_version", "?") for r in records})
    lines = ["# CIFAR-10 budget curve (tuning fleets)", "",
             "`python -m experiments.cifar_budget run ...` on tuning fleets (seeds >= 100, never reported): 5 cnn3-bn "
             "clients, NIID-Bench, cpu preset, one thread per run; each row names its server budget; the release's "
             f"CIFAR-10 cells run at {json.dumps({**CIFAR10_CLIENT, **CIFAR10_SERVER})}. Test accuracy %, wall "
             "seconds; "
             "ensemble: the clients' mean logits (DENSE's teacher); FedHydra's teacher (its SA) in brackets. Code: "
             f"{', '.join(versions) or '–'}.", "",
             "| cell | seed | local epochs | augment | clients (mean / best) | FedAvg | ensemble | client s | "
             "distillation (epochs / generator steps / student steps) | DENSE | s | FedHydra (teacher) | s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows(records):
        clients = row["clients"]
        mean_best = (f"{100 * statistics.mean(clients):.1f} / {100 * max(clients):.1f}" if clients else "–")
        seconds = [("–" if row.get(k) is None else f"{row[k]:.0f}") for k in ("client_s", "dense_s", "fedhydra_s")]
        lines.append(f"| {row['cell']} | {row['seed']} | {row['local_epochs']} | {row['augment']} | {mean_best} | "
                     f"{_pct(row['fedavg'])} | {_pct(row.get('ensemble'))} | {seconds[0]} | {row['distill_epochs']} / "
                     f"{row['generator_steps']} / {row['kd_steps']} | "
                     f"{_pct(row['dense'])} | {seconds[1]} | {_pct(row['fedhydra'])} "
                     f"({_pct(row.get('fedhydra_teacher'))}) | {seconds[2]} |")
    text = "\n".join(lines) + "\n"
    path.write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="train each local budget's fleet once and replay each method at each "
                                     "distillation budget")
    run.add_argument("--cell", default="0.5")
    run.add_argument("--seed", type=int, default=100)
    run.add_argument("--local-epochs", type=int, nargs="+", default=[CIFAR10_CLIENT["local.epochs"]])
    run.add_argument("--augment", nargs="+", choices=AUGMENTATIONS, default=["none"])
    run.add_argument("--distill-epochs", type=int, nargs="+", default=[CIFAR10_SERVER["distill.epochs"]])
    run.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    run.add_argument("--set", action="append", default=[], help="more server-side overrides for every replay")
    sub.add_parser("render", help=f"write {REPORT.relative_to(RESULTS_DIR.parents[1])}")
    args = parser.parse_args(argv)
    if args.command == "render":
        print(render(), end="")
        return 0
    setup_logging()
    logging.getLogger("oneshot_fl.bench").setLevel(logging.INFO)
    return command_run(args)


if __name__ == "__main__":
    sys.exit(main())
