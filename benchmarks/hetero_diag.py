"""Why FedHydra's student stays under its teacher on a heterogeneous grey fleet: one server setting at a time.

Issue: on FMNIST NIID-Bench 0.5 (seed 0) the grey fleet's SA teacher scores 87.73 % and its ResNet-8 student 76.60 %,
under the best client (cnn3-bn, 83.45 %). This command serves FedHydra on a tuning fleet of the same shape (seed >= 100,
never reported) once per server setting, so each setting's effect is measured on the very same uploads: the student
architecture (capacity and inductive bias), the BN-statistics term of heterogeneous teachers, and the size of the
synthetic set the student learns from. The fleet is benchmarks/conf/grey-hetero-cpu.toml's (cpu preset); its clients are
trained once (their run is the baseline row) and every other setting replays their uploads.

  python -m benchmarks.hetero_diag --dataset fmnist --cell 0.5 --seed 100
  python -m benchmarks.hetero_diag --settings "distill.epochs=60"     # one more setting, same fleet
Records: results/hetero_diag.jsonl; report: results/hetero_diag.md (student, its teacher, the fleet's best client).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from benchmarks.paper_table import BENCH_DIR, check_grid, parse_sets, replay_methods, split_fleet, train_clients
from benchmarks.records import RESULTS_DIR, load_records
from oneshot_fl.config import ConfigError
from oneshot_fl.logs import setup_logging

TABLE = "hetero_diag"
CONF = BENCH_DIR / "conf" / "grey-hetero-cpu.toml"
# the settings measured so far, one replay each on the same uploads ("" = the fleet file's, from the training run)
SETTINGS = ["", "fedhydra.lambda-bn=0", "server-model='vgg9-small'", "server-model='cnn3-bn'",
            "distill.synth-batch=256"]
SERVER = {"server-threads": 1}  # every row's server runs on one thread
# keys that say which run a record is, not which server setting it tried
RUN_KEYS = {"method", "dataset", "num-clients", "seed", "preset", "alpha", "partition", "threads", "server-threads",
            "client-models"}


def setting_of(record: dict, fleet: dict) -> str:
    """A record's server setting: its overrides that differ from the fleet file's ('–' for none)."""
    changed = {k: v for k, v in record["overrides"].items() if k not in RUN_KEYS and fleet.get(k) != v}
    return ", ".join(f"{k}={v}" for k, v in sorted(changed.items())) or "– (the fleet file's)"


def render(fleet: dict, out: Path | None = None) -> Path:
    records = sorted(load_records(TABLE), key=lambda r: r.get("recorded_at", ""))
    latest: dict[tuple, dict] = {}
    for r in records:
        latest[(r["dataset"], r.get("cell"), r["seed"], setting_of(r, fleet))] = r
    lines = ["# hetero_diag", "",
             "FedHydra's student against its SA teacher and the fleet's best client on a tuning fleet of "
             f"`{CONF.relative_to(BENCH_DIR.parent)}` (LeNet / cnn2 / cnn3-bn / ResNet-8 / VGG-9/4 clients, server "
             "ResNet-8, cpu preset: 30 distillation epochs), one server setting per row on the same uploads. "
             "Test accuracy (%); server seconds on one thread of a shared 2-core CPU. Command: "
             "`python -m benchmarks.hetero_diag` (benchmarks/README.md).", "",
             "| dataset | cell | seed | server setting | student | SA teacher | best client | student - teacher | "
             "server s | code |", "|---|---|---|---|---|---|---|---|---|---|"]
    by_fleet = defaultdict(list)
    for (dataset, cell, seed, setting), r in latest.items():
        by_fleet[(dataset, cell, seed)].append((setting, r))
    for (dataset, cell, seed), rows in sorted(by_fleet.items()):
        for setting, r in sorted(rows, key=lambda x: (not x[0].startswith("–"), x[0])):
            best = max(range(len(r["client_accuracy"])), key=lambda i: r["client_accuracy"][i])
            teacher = r.get("ensemble_accuracy")
            teacher_text = f"{teacher * 100:.2f}" if teacher is not None else "–"
            gap = f"{(r['accuracy_final'] - teacher) * 100:+.2f}" if teacher is not None else "–"
            lines.append(f"| {dataset} | {cell} | {seed} | {setting} | {r['accuracy_final'] * 100:.2f} | "
                         f"{teacher_text} | {r['client_archs'][best]} {r['client_accuracy'][best] * 100:.2f} | "
                         f"{gap} | {r['wall_s']['server_total']:.0f} | {r['code_version']} |")
    seconds = [r["wall_s"]["server_total"] for r in latest.values()]
    if seconds:
        lines += ["", f"Server seconds: median {statistics.median(seconds):.0f} over the rows (one thread; rows ran "
                  "beside one or two other jobs)."]
    out = out or RESULTS_DIR / f"{TABLE}.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="fmnist")
    parser.add_argument("--cell", default="0.5")
    parser.add_argument("--seed", type=int, default=100)
    parser.add_argument("--settings", nargs="+", default=SETTINGS,
                        help="server settings, one replay each ('' = the fleet file's; 'k=v k2=v2' for several)")
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args(argv)
    fleet = parse_sets([str(CONF)])
    if args.render_only:
        print(render(fleet).read_text())
        return 0
    if args.seed < 100:
        parser.error(f"--seed {args.seed}: settings are tried on tuning fleets only (seed >= 100)")
    clients = {k: v for k, v in fleet.items() if k not in ("dataset", "num-clients", "preset")}
    clients["threads"] = 1
    num_clients, preset = fleet["num-clients"], fleet.get("preset", "cpu")
    try:
        per_setting = [{**SERVER, **parse_sets(s.split())} for s in args.settings]
        for sets in per_setting:
            check_grid([args.dataset], [args.cell], [args.seed], ["fedhydra"], num_clients, preset, clients, sets)
    except ConfigError as exc:
        parser.error(str(exc))
    setup_logging()
    logging.getLogger("oneshot_fl.bench").setLevel(logging.INFO)
    # the clients' training run serves the fleet file's setting (recorded as that row)
    uploads = train_clients(TABLE, args.dataset, args.cell, args.seed, num_clients, preset, clients, False,
                            method="fedhydra", server_sets=SERVER)
    for sets in per_setting:
        if sets != SERVER:  # each replay is told the fleet file's server settings too, as the training run was
            replay_methods(TABLE, uploads, ["fedhydra"], "dense", args.dataset, args.cell, args.seed, preset,
                           *split_fleet(clients, sets), False)
        print(render(fleet).read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
