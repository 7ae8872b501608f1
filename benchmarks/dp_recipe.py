"""DP-SGD client recipes on a tuning cell: which step size, batch and epochs make the best private clients.

DP-SGD clips each example's gradient to norm C and adds Gaussian noise of std sigma * C to their sum, so the
step a client takes is small and noisy where plain SGD's is not: the recipe that trains a good SGD client (the
cpu preset's SGD recipe: SGD 0.01, momentum 0.9, batch 128, 10 epochs) need not train a good DP-SGD client. This command
trains the five DP clients of the tuning cell MNIST NIID-Bench 0.5, seed 100 (no table reports it; `--seeds`
adds the tuning seeds 101, 102, ...), model `cnn2-gn`, at epsilon 8 once per recipe, through the ClientApp's own
training function, and records what a server gets from them: each client's test accuracy, their mean-logit
ensemble (the teacher every data-free method starts from) and one-shot FedAvg, served by the FedAvg strategy. The
no-DP row trains the same clients without DP (the bar). `--methods` serves data-free methods on a cached fleet, and
`--set` a server setting under test, summarised against the default on the same fleets.

  OMP_NUM_THREADS=1 python -m benchmarks.dp_recipe                 # every recipe not yet recorded
  OMP_NUM_THREADS=1 python -m benchmarks.dp_recipe --recipes lr0.1 --epsilon 3
  OMP_NUM_THREADS=1 python -m benchmarks.dp_recipe --recipes lr0.5-b512 --methods fedhydra   # a server on a fleet
  OMP_NUM_THREADS=1 python -m benchmarks.dp_recipe --recipes e20 --seeds 100 101 102 --methods fedhydra \\
      --set fedhydra.beta=0                                         # a server setting on three tuning fleets
Uploads are cached under benchmarks/runs/dp_recipe/ (git-ignored); records: results/dp_recipe.jsonl; report:
results/dp_recipe.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.records import RESULTS_DIR, append_record, code_version, load_records, machine

BENCH_DIR = Path(__file__).resolve().parent
TABLE = "dp_recipe"
DATASET, ALPHA, MODEL, CLIENTS = "mnist", 0.5, "cnn2-gn", 5
SEED = 100  # the tuning seed the recipes were chosen on; --seeds adds other tuning seeds (>= 100)
log = logging.getLogger("oneshot_fl.bench")

# name -> client-side overrides (local.*) over the cpu preset; "no-dp" trains without DP-SGD. Each DP recipe names
# its passes (local.dp.epochs), so that a recipe means the same clients whatever the preset's value: e20 is the cpu
# preset's DP recipe, e10 the one it replaced.
RECIPES: dict[str, dict] = {
    "no-dp": {},
    "e10": {"local.dp.epochs": 10},  # the cpu preset's SGD recipe under DP-SGD, at the SGD clients' 10 passes
    "lr0.1": {"local.lr": 0.1, "local.dp.epochs": 10},
    "lr0.5-b512": {"local.lr": 0.5, "local.batch-size": 512, "local.dp.epochs": 10},
    "lr0.2-b256": {"local.lr": 0.2, "local.batch-size": 256, "local.dp.epochs": 10},
    "lr0.5-b512-e20": {"local.lr": 0.5, "local.batch-size": 512, "local.dp.epochs": 20},
    "e20": {"local.dp.epochs": 20},  # the preset's step size, twice the passes (epsilon 1 and 8 clients train alike)
}


def run_config(recipe: str, epsilon: float, seed: int = SEED):
    from oneshot_fl.config import from_run_config, merge_overrides

    flat = {"method": "fedavg", "dataset": DATASET, "partition": "niid-bench", "alpha": ALPHA,
            "num-clients": CLIENTS, "seed": seed, "preset": "cpu", "model": MODEL, "threads": 1,
            "server-threads": 1, "save-uploads": False, **RECIPES[recipe]}
    if recipe != "no-dp":
        flat["local.dp.epsilon"] = float(epsilon)
    return from_run_config(merge_overrides(flat))


def fleet_dir(recipe: str, epsilon: float, seed: int = SEED) -> Path:
    name = "no-dp" if recipe == "no-dp" else f"{recipe}-eps{epsilon:g}"
    return BENCH_DIR / "runs" / TABLE / f"{DATASET}-a{ALPHA:g}-s{seed}" / name


def fleet(recipe: str, epsilon: float, seed: int = SEED) -> tuple[list, float]:
    """The recipe's five uploads (trained once, cached) and the mean client training seconds."""
    from benchmarks.inprocess_fleet import cached_uploads

    uploads, seconds = cached_uploads(fleet_dir(recipe, epsilon, seed), run_config(recipe, epsilon, seed),
                                      [(pid, "classifier", MODEL) for pid in range(CLIENTS)])
    return uploads, float(np.mean(seconds))


def measure(recipe: str, epsilon: float, seed: int = SEED) -> dict:
    """Client accuracies, their mean-logit ensemble and one-shot FedAvg (the FedAvg strategy serving them)."""
    from oneshot_fl.devices import set_threads
    from strategies import build_strategy

    set_threads(1)
    uploads, seconds = fleet(recipe, epsilon, seed)
    cfg = run_config(recipe, epsilon, seed)
    folder = fleet_dir(recipe, epsilon, seed)
    run_dir = folder.parent / f"serve-{folder.name}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    strategy = build_strategy(cfg, run_dir)
    strategy.serve(uploads, [])
    result = json.loads((run_dir / "result.json").read_text())
    teachers = teacher_accuracies_of(uploads, strategy)
    dp = [round(up.dp.epsilon, 4) for up in uploads if up.dp is not None]
    return {"table": TABLE, "recipe": recipe, "overrides": RECIPES[recipe],
            "epsilon": 0.0 if recipe == "no-dp" else float(epsilon), "dataset": DATASET, "alpha": ALPHA,
            "seed": seed, "model": MODEL, "num_clients": CLIENTS,
            "client_accuracy": [c["local_accuracy"] for c in result["clients"]],
            "ensemble_accuracy": teachers["mean"], "count_teacher_accuracy": teachers["counts"],
            "fedavg_accuracy": result["global"]["accuracy_final"],
            "claimed_epsilon": dp, "client_seconds": round(seconds, 1), "code_version": code_version(),
            "machine": machine(), "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def serve_method(recipe: str, epsilon: float, method: str, seed: int = SEED, server: dict | None = None) -> dict:
    """A data-free server method on the recipe's cached fleet: its teacher's and its global model's accuracy.
    `server`: server-side overrides (a setting under test on the tuning seeds), named in the record."""
    from oneshot_fl.devices import set_threads
    from strategies import build_strategy

    set_threads(1)
    server = dict(server or {})
    uploads, _ = fleet(recipe, epsilon, seed)
    cfg = server_config(recipe, epsilon, seed, method, server)
    folder = fleet_dir(recipe, epsilon, seed)
    variant = "".join(f"-{k}={v}" for k, v in sorted(server.items()))
    run_dir = folder.parent / f"{method}-{folder.name}{variant}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    start = time.perf_counter()
    build_strategy(cfg, run_dir).serve(uploads, [])
    g = json.loads((run_dir / "result.json").read_text())["global"]
    return {"table": TABLE, "kind": "server", "recipe": recipe, "method": method, "server_overrides": server,
            "epsilon": 0.0 if recipe == "no-dp" else float(epsilon), "dataset": DATASET, "alpha": ALPHA,
            "seed": seed, "teacher_accuracy": g.get("ensemble_accuracy"), "accuracy_final": g["accuracy_final"],
            "server_seconds": round(time.perf_counter() - start, 1), "code_version": code_version(),
            "machine": machine(), "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def server_config(recipe: str, epsilon: float, seed: int, method: str, server: dict):
    """The run config `method` serves the recipe's fleet with, `server` on top; every method section checked
    (ConfigError), so a bad --set fails before any client trains."""
    from oneshot_fl.config import from_run_config, merge_overrides
    from strategies import check_method_params

    cfg = from_run_config(merge_overrides({**run_config(recipe, epsilon, seed).flat, "method": method, **server}))
    check_method_params(cfg)
    return cfg


def teacher_accuracies_of(uploads: list, strategy) -> dict[str, float]:
    """Two teachers over the fleet's models, in one pass over the test set (strategies.datafree's evaluation):
    `mean`, their mean-logit ensemble (DENSE's), and `counts`, the teacher FedHydra builds on a DP fleet: its
    default SA (calibrated logits, routed by output class) over the released label histograms
    (strategies.fedhydra.released_scores)."""
    from oneshot_fl.engine.stratify import normalise
    from oneshot_fl.engine.teachers import ClientEnsemble, MeanLogits, StratifiedAggregation
    from strategies.datafree import client_models, teacher_accuracies
    from strategies.fedhydra import RECIPES, released_scores

    ctx, recipe = strategy.ctx, RECIPES["robust"]
    u_r, u_c = normalise(released_scores(uploads))
    ensemble = ClientEnsemble(client_models(uploads, ctx), [up.arch for up in uploads])
    try:
        return teacher_accuracies(ensemble, {
            "mean": (MeanLogits(), False),
            "counts": (StratifiedAggregation(u_r, u_c, recipe.sa_space, recipe.sa_route), False)}, ctx)
    finally:
        ensemble.close()


def render() -> Path:
    latest: dict[tuple, dict] = {}
    served: dict[tuple, dict] = {}
    for r in sorted(load_records(TABLE), key=lambda r: r.get("recorded_at", "")):
        seed = r.get("seed", SEED)
        if r.get("kind") == "server":
            settings = tuple(sorted(r.get("server_overrides", {}).items()))
            served[(r["recipe"], r["epsilon"], seed, r["method"], settings, r["code_version"])] = r
        else:
            latest[(r["recipe"], r["epsilon"], seed)] = r
    lines = [f"# {TABLE}", "",
             f"DP-SGD client recipes on tuning cells {DATASET.upper()} NIID-Bench {ALPHA:g}, seeds >= {SEED} (no table "
             f"reports them), {CLIENTS} clients of `{MODEL}` (cpu preset otherwise: SGD momentum 0.9, clip 1.0, delta "
             "1e-5); test accuracy (%) of each client, of their mean-logit ensemble, of FedHydra's DP-fleet teacher "
             "(its SA over the released label histograms) and of one-shot FedAvg; client training "
             "seconds (mean, one thread, shared 2-core CPU). Command: `OMP_NUM_THREADS=1 python -m "
             "benchmarks.dp_recipe`.", "",
             "| recipe | overrides | epsilon | seed | clients p0-p4 | ensemble | SA over counts | FedAvg | s / client "
             "| code |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for (recipe, epsilon, seed), r in sorted(latest.items(),
                                             key=lambda kv: (list(RECIPES).index(kv[0][0]), kv[0][1], kv[0][2])):
        sets = ", ".join(f"{k}={v}" for k, v in r["overrides"].items()) or "–"
        clients = " / ".join(f"{100 * a:.1f}" for a in r["client_accuracy"])
        by_counts = "–" if r.get("count_teacher_accuracy") is None else f"{100 * r['count_teacher_accuracy']:.2f}"
        lines.append(f"| {recipe} | {sets} | {'no DP' if not epsilon else f'{epsilon:g}'} | {seed} | {clients} | "
                     f"{100 * r['ensemble_accuracy']:.2f} | {by_counts} | {100 * r['fedavg_accuracy']:.2f} | "
                     f"{r['client_seconds']:.0f} | {r['code_version']} |")
    if served:
        lines += ["", "Server methods on the same cached fleets (`--methods`, server settings under test with "
                  "`--set`; the code version says which server code ran): the teacher's test accuracy (FedHydra: its "
                  "SA teacher) and the global model's.", "",
                  "| recipe | epsilon | seed | method | server settings | teacher | global model | server s | code |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for (recipe, epsilon, seed, method, settings, version), r in sorted(
                served.items(), key=lambda kv: kv[1]["recorded_at"]):
            teacher = "–" if r["teacher_accuracy"] is None else f"{100 * r['teacher_accuracy']:.2f}"
            sets = ", ".join(f"{k}={v}" for k, v in settings) or "–"
            lines.append(f"| {recipe} | {'no DP' if not epsilon else f'{epsilon:g}'} | {seed} | {method} | {sets} | "
                         f"{teacher} | {100 * r['accuracy_final']:.2f} | {r['server_seconds']:.0f} | {version} |")
        lines += settings_summary(served)
    out = RESULTS_DIR / f"{TABLE}.md"
    out.write_text("\n".join(lines) + "\n")
    return out


def settings_summary(served: dict[tuple, dict]) -> list[str]:
    """Each server setting under test against the default on the same fleets: the global model per tuning seed
    (the latest record per recipe whose fleets it ran on, at epsilon 8) and the mean change over the seeds both
    ran. A seed's fleet may have been trained again since (DP-SGD is not bit-for-bit reproducible): a setting is
    compared with the default served on the very fleet it ran on, the one whose teacher had the same accuracy."""
    latest: dict[tuple, dict] = {}
    defaults: dict[tuple, dict] = {}  # (recipe, method, seed, teacher accuracy) -> the latest default on that fleet
    for (recipe, epsilon, seed, method, settings, _), r in sorted(served.items(), key=lambda kv: kv[1]["recorded_at"]):
        if epsilon == 8.0:
            latest[(recipe, method, settings, seed)] = r
            if not settings:
                defaults[(recipe, method, seed, r.get("teacher_accuracy"))] = r
    tested = sorted({(rc, m, st) for rc, m, st, _ in latest if st})
    if not tested:
        return []
    seeds = sorted({seed for rc, m, st, seed in latest if (rc, m) in {(t[0], t[1]) for t in tested}})
    lines = ["", "Server settings under test at epsilon 8: the global model (%) per tuning seed, and its mean change "
             "against the default (–) served on the same fleet (a fleet trained again is another fleet: the default "
             "row shows the latest).", "",
             "| recipe | method | settings | " + " | ".join(f"seed {s}" for s in seeds) + " | mean change |",
             "|---|---|---|" + "---|" * len(seeds) + "---|"]
    for recipe, method in sorted({(rc, m) for rc, m, _ in tested}):
        for settings in [()] + [st for rc, m, st in tested if (rc, m) == (recipe, method)]:
            cells, changes = [], []
            for seed in seeds:
                r = latest.get((recipe, method, settings, seed))
                base = None if r is None else defaults.get((recipe, method, seed, r.get("teacher_accuracy")))
                cells.append("–" if r is None else f"{100 * r['accuracy_final']:.2f}")
                if r is not None and base is not None and settings:
                    changes.append(100 * (r["accuracy_final"] - base["accuracy_final"]))
            change = f"{np.mean(changes):+.2f} ({len(changes)})" if changes else "–"
            name = ", ".join(f"{k}={v}" for k, v in settings) or "– (default)"
            lines.append(f"| {recipe} | {method} | {name} | " + " | ".join(cells) + f" | {change} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    from oneshot_fl.errors import ConfigError
    from launcher.launch import parse_overrides
    from oneshot_fl.logs import setup_logging

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    parser.add_argument("--epsilon", type=float, default=8.0)
    parser.add_argument("--seeds", nargs="+", type=int, default=[SEED], help="tuning seeds (>= 100: no table reports "
                        "them); each gets its own cached fleet")
    parser.add_argument("--methods", nargs="*", default=[], help="data-free server methods to serve on each recipe's "
                        "fleet as well (e.g. fedhydra dense); one record per method, settings and code version")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a server setting under test "
                        "for the --methods runs (repeatable), e.g. --set fedhydra.lambda-adv=0.5")
    parser.add_argument("--force", action="store_true", help="measure recipes that have a record again")
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args(argv)
    if args.epsilon <= 0:
        parser.error("--epsilon must be > 0 (the no-dp recipe is the row without DP)")
    if any(seed < 100 for seed in args.seeds):
        parser.error("--seeds must be >= 100: recipes are chosen on tuning seeds, never on a reported cell")
    try:
        server = parse_overrides(args.set)
        for method in args.methods:
            server_config(args.recipes[0], args.epsilon, args.seeds[0], method, server)
    except ConfigError as exc:
        parser.error(str(exc))
    setup_logging()
    logging.getLogger("oneshot_fl.bench").setLevel(logging.INFO)
    torch.set_num_threads(1)
    if not args.render_only:
        for seed in args.seeds:
            for recipe in args.recipes:
                epsilon = 0.0 if recipe == "no-dp" else args.epsilon
                if args.force or not any(r["recipe"] == recipe and r["epsilon"] == epsilon
                                         and r.get("seed", SEED) == seed and r.get("kind") != "server"
                                         for r in load_records(TABLE)):
                    append_record(measure(recipe, args.epsilon, seed))
                    print(render().read_text(), flush=True)
                for method in args.methods:
                    version = code_version()
                    if args.force or not any(
                            r.get("kind") == "server" and r["recipe"] == recipe and r["epsilon"] == epsilon
                            and r.get("seed", SEED) == seed and r["method"] == method
                            and r.get("server_overrides", {}) == server and r["code_version"] == version
                            for r in load_records(TABLE)):
                        append_record(serve_method(recipe, args.epsilon, method, seed, server))
                        print(render().read_text(), flush=True)
    print(render().read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
