"""FedHydra's student against its teacher and the fleet's best client on a heterogeneous tuning fleet: one server
setting per row, on the very same uploads.

On a tuning fleet (benchmarks.fleets: a heterogeneous fleet file at seed >= 100, never reported) this serves
FedHydra once per server setting (the student architecture, the generator's loss terms, the student's optimiser,
the size of the synthetic set), so each setting's effect is measured on identical clients. `--method` serves
another method's rows instead (a baseline given the same setting); `--reference` replays other methods once on the
same uploads at the fleet file's settings. The clients are trained once (their run is the FedHydra row at the fleet
file's settings) and every other row replays their uploads.

  python -m experiments.hetero_diag --dataset fmnist --cell 0.5 --seed 100
  python -m experiments.hetero_diag --settings "distill.epochs=60"     # one more setting, same fleet
  python -m experiments.hetero_diag --dataset cifar10 --seed 100 --settings "" --reference feddf
  python -m experiments.hetero_diag --dataset cifar10 --seed 100 --method dense --settings "" "dense.lambda-bn=0"
Records: benchmarks/results/hetero_diag.jsonl; report: benchmarks/results/hetero_diag.md (student, its teacher, the
fleet's best client). Cost on the 2-core machine: a grey fleet's clients ~20 min, ~10 min of server per row; the
CIFAR-10 fleet's clients ~35 min, ~30 min of server per row (one thread).
"""
from __future__ import annotations

import argparse
import logging
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from benchmarks.fleets import (BENCH_DIR, TUNING_SERVER, TUNING_TABLE, check_grid, fleet_file, fleet_of, parse_sets,
                               replay_methods, split_fleet, tuning_fleet, tuning_uploads)
from benchmarks.records import RESULTS_DIR, load_records, overrides_key
from oneshot_fl.config import ConfigError, default_run_config
from oneshot_fl.logs import setup_logging
from oneshot_fl.presets import PRESETS, apply_preset
from strategies import STRATEGIES

TABLE = TUNING_TABLE  # the tuning fleets' training runs are this report's rows at the fleet file's settings
# the settings measured so far, one replay each on the same uploads ("" = the fleet file's, from the training run)
SETTINGS = ["", "fedhydra.lambda-bn=0", "server-model='vgg9-small'", "server-model='cnn3-bn'",
            "distill.synth-batch=256"]
SERVER = TUNING_SERVER  # every row's server runs on one thread
# keys that say which run a record is, not which server setting it tried
RUN_KEYS = {"method", "dataset", "num-clients", "seed", "preset", "alpha", "partition", "threads", "server-threads",
            "client-models"}


def _resolved(overrides: dict) -> dict:
    """A run's value of every key: the defaults under its overrides, the "= preset" ones from its preset."""
    return apply_preset({**default_run_config(), **overrides}, overrides.get("preset", "cpu"))


def setting_of(record: dict, fleet: dict) -> str:
    """A record's server setting: where its run's values differ from the fleet file's ('–' for none). Both sides are
    resolved, so a row made before the file set a key shows the value it ran at (e.g. `fedhydra.lambda-bn=1.0` once
    the file sets 0.03); another method's knobs are not this record's setting."""
    ran, file = _resolved(record["overrides"]), _resolved(fleet)
    others = tuple(f"{name}." for name in STRATEGIES if name != record["method"])
    keys = (set(record["overrides"]) | set(fleet)) - RUN_KEYS
    changed = {k: ran.get(k) for k in keys if not k.startswith(others) and ran.get(k) != file.get(k)}
    return ", ".join(f"{k}={v}" for k, v in sorted(changed.items())) or "– (the fleet file's)"


def describe(fleet: dict) -> str:
    """A fleet file in words, from its settings (distillation epochs from its preset where the file sets none)."""
    epochs = fleet.get("distill.epochs", PRESETS[fleet.get("preset", "cpu")]["distill.epochs"])
    return (f"{fleet['client-models'].replace(',', ' / ')} clients, server {fleet['server-model']}, "
            f"{epochs} distillation epochs")


def render(fleet_for=fleet_of, out: Path | None = None) -> Path:
    """The report: one row per (fleet, method, server setting), the latest record of each; `fleet_for(dataset)` gives
    the fleet file's settings a row's setting is read against."""
    records = sorted(load_records(TABLE), key=lambda r: r.get("recorded_at", ""))
    fleets = {dataset: fleet_for(dataset) for dataset in {r["dataset"] for r in records}}  # each file read once
    latest: dict[tuple, dict] = {}
    for r in records:
        latest[(r["dataset"], r.get("cell"), r["seed"], r["method"], setting_of(r, fleets[r["dataset"]]))] = r
    files = {fleet_file(dataset): fleet for dataset, fleet in fleets.items()}
    lines = ["# hetero_diag", "",
             "FedHydra's student against its teacher and the fleet's best client on tuning fleets (cpu preset) of "
             + "; ".join(f"`{f.relative_to(BENCH_DIR.parent)}` ({describe(fleet)})"
                         for f, fleet in sorted(files.items(), key=lambda item: str(item[0])))
             + ": one server setting per row on the same uploads; rows of other methods replay the same uploads at "
             "the fleet file's settings. `teacher` is the one the method distils from (FedHydra: SA; FedDF, DENSE: the "
             "mean of the clients' logits), on the test set without labels. FedDF's student keeps its own Adam step "
             "(`feddf.lr`), so `distill.lr-student` on a FedDF row changes nothing. Test accuracy (%); server seconds "
             "on one thread of a shared 2-core CPU. Command: `python -m experiments.hetero_diag` "
             "(experiments/README.md).", "",
             "| dataset | cell | seed | method | server setting | student | teacher | best client | "
             "student - teacher | server s | code |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    by_fleet = defaultdict(list)
    for (dataset, cell, seed, method, setting), r in latest.items():
        by_fleet[(dataset, cell, seed)].append((method, setting, r))
    for (dataset, cell, seed), rows in sorted(by_fleet.items()):
        for method, setting, r in sorted(rows, key=lambda x: (x[0] != "fedhydra", x[0], not x[1].startswith("–"),
                                                              x[1])):
            best = max(range(len(r["client_accuracy"])), key=lambda i: r["client_accuracy"][i])
            teacher = r.get("ensemble_accuracy")
            teacher_text = f"{teacher * 100:.2f}" if teacher is not None else "–"
            gap = f"{(r['accuracy_final'] - teacher) * 100:+.2f}" if teacher is not None else "–"
            lines.append(f"| {dataset} | {cell} | {seed} | {method} | {setting} | {r['accuracy_final'] * 100:.2f} | "
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
    parser.add_argument("--method", default="fedhydra",
                        help="the server method the settings are tried on (the clients are trained by FedHydra's run)")
    parser.add_argument("--settings", nargs="+", default=SETTINGS,
                        help="server settings, one replay each ('' = the fleet file's; 'k=v k2=v2' for several)")
    parser.add_argument("--reference", nargs="*", default=[], metavar="METHOD",
                        help="other server methods replayed once on the same uploads at the fleet file's settings")
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args(argv)
    if args.render_only:
        print(render().read_text())
        return 0
    try:
        clients, num_clients, preset = tuning_fleet(args.dataset)
    except ConfigError as exc:
        parser.error(str(exc))
    if args.seed < 100:
        parser.error(f"--seed {args.seed}: settings are tried on tuning fleets only (seed >= 100)")
    try:
        per_setting = [{**SERVER, **parse_sets(s.split())} for s in args.settings]
        for sets in per_setting:
            check_grid([args.dataset], [args.cell], [args.seed], [args.method], num_clients, preset, clients, sets)
        if args.reference:
            check_grid([args.dataset], [args.cell], [args.seed], args.reference, num_clients, preset, clients, SERVER)
    except ConfigError as exc:
        parser.error(str(exc))
    setup_logging()
    logging.getLogger("oneshot_fl.bench").setLevel(logging.INFO)
    # the clients' training run serves the fleet file's setting (recorded as that row)
    client_side, file_server = split_fleet(clients, SERVER)
    uploads = tuning_uploads(args.dataset, args.cell, args.seed)
    for sets in per_setting:
        if args.method != "fedhydra" or sets != SERVER:  # FedHydra at the file's settings is the training run's row
            # each replay is told the fleet file's server settings too, as the training run was; FedHydra's setting
            # rows are replayed, since the training run's row is at the file's settings (trainer_recorded)
            replay_methods(TABLE, uploads, [args.method], "fedhydra", args.dataset, args.cell, args.seed, preset,
                           *split_fleet(clients, sets), False, folder_tag=overrides_key(sets)[:8])
        print(render().read_text(), flush=True)
    if args.reference:
        replay_methods(TABLE, uploads, args.reference, "fedhydra", args.dataset, args.cell, args.seed, preset,
                       client_side, file_server, False)
        print(render().read_text(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
