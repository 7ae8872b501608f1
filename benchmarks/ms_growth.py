"""Why FedHydra's model stratification (MS) grows faster than K, measured on the client-number table's fleets.

MS trains one generator per (client, class) pair for up to T_G steps; a pair stops once its client is convinced
(CE below the robust recipe's stop loss). Its time is therefore pairs x generator steps per pair x the cost of
one step, and this command measures each factor on the FMNIST NIID-Bench 0.5 fleets that
`python -m benchmarks.clients_table` trained and kept (benchmarks/runs/clients-k{K}/fmnist-0.5-s{seed}/uploads),
running MS as FedHydra runs it on a CPU (the sequential loop, the robust recipe, the cpu preset's generator and
T_G, the run's stratification seed), in this process, on one thread.

Then two ways to make it grow slower, on the same fleets:
  batched     every class of one client in one vmapped call (`stratify`, clients_per_call=1), the smallest fleet;
  plateau     stop a pair that is not convinced once its probability of the class rose by less than `rise` over
              the last `window` steps, the remaining steps counted at its last loss (as the stop loss pads),
              replayed on the recorded loss curves: the rule only looks back, so the replay is exact. Reports
              the generator steps it saves and how far it moves U and U_r.

  python -m benchmarks.ms_growth --fleets 5:2 10:2 20:2 50:0      # K:seed, fleets the table kept
Records: results/ms_growth.json (one entry per run); report: results/ms_growth.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import datetime
from pathlib import Path

import torch

from benchmarks.fleets import BENCH_DIR
from benchmarks.records import RESULTS_DIR, append_to_json_list, code_version, machine

JSON = RESULTS_DIR / "ms_growth.json"
REPORT = RESULTS_DIR / "ms_growth.md"
PLATEAU_RULES = ((5, 0.002), (5, 0.005), (3, 0.005))  # (window, rise) pairs replayed on every fleet
INPUT_SHAPE, NUM_CLASSES = (1, 28, 28), 10


def fleet_dir(k: int, seed: int) -> Path:
    return BENCH_DIR / "runs" / f"clients-k{k}" / f"fmnist-0.5-s{seed}" / "uploads"


def load_fleet(uploads: Path) -> list[torch.nn.Module]:
    from oneshot_fl.archive import load_uploads
    from oneshot_fl.models.registry import build

    if not (uploads / "manifest.json").is_file():
        raise SystemExit(f"{uploads}: no kept fleet; train it with `python -m benchmarks.clients_table --ks K "
                         "--seeds S --methods fedavg` first")
    models = []
    for up in load_uploads(uploads, NUM_CLASSES, INPUT_SHAPE, ("classifier",), skip_other_roles=True):
        model = build(up.arch, INPUT_SHAPE, NUM_CLASSES)
        model.load_state_dict(up.state)
        models.append(model.eval())
    return models


def plateau_stop(losses: torch.Tensor, steps_run: torch.Tensor, window: int, rise: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The plateau rule replayed on MS's recorded curves: (m, c, T) losses and (m, c) steps run -> the curves and
    steps the rule would have left. A pair that ran all T steps stops at the first step t >= window where
    exp(-L_t) - exp(-L_{t-window}) < rise, and its later steps count at L_t."""
    out, steps = losses.clone(), steps_run.clone()
    total = losses.shape[-1]
    probs = torch.exp(-losses.double())
    for k, j in (steps_run == total).nonzero().tolist():
        for t in range(window, total):
            if probs[k, j, t] - probs[k, j, t - window] < rise:
                out[k, j, t + 1:] = losses[k, j, t]
                steps[k, j] = t
                break
    return out, steps


def measure(k: int, seed: int, batched: bool) -> dict:
    from oneshot_fl.config import DistillConfig
    from oneshot_fl.engine.stratify import SCORES, normalise, stratify, stratify_sequential
    from oneshot_fl.models.generator import GeneratorSpec
    from oneshot_fl.presets import PRESETS
    from oneshot_fl.seeding import derive_seed
    from strategies.fedhydra import PEER_SAMPLES, RECIPES

    models = load_fleet(fleet_dir(k, seed))
    preset, recipe = PRESETS["cpu"], RECIPES["robust"]
    spec = GeneratorSpec(preset["distill.nz"], preset["distill.ngf"], INPUT_SHAPE[1], INPUT_SHAPE[0])
    steps, lr = preset["fedhydra.ms-steps"], DistillConfig().lr_generator  # the run config's default
    args = (models, NUM_CLASSES, spec, steps, recipe.ms_batch, lr, derive_seed(seed, "stratification"),
            torch.device("cpu"))
    kwargs = {"score": recipe.score, "stop_loss": recipe.stop_loss, "keep_samples": PEER_SAMPLES}
    stratify_sequential(models[:1], 1, spec, 2, recipe.ms_batch, lr, 0, torch.device("cpu"))  # warm-up, untimed
    start = time.perf_counter()
    ms = stratify_sequential(*args, **kwargs)
    seconds = time.perf_counter() - start
    pair_steps = int(ms.steps_run.sum())
    row = {"k": k, "seed": seed, "pairs": k * NUM_CLASSES, "t_g": steps, "ms_batch": recipe.ms_batch,
           "seconds": seconds, "generator_steps": pair_steps,
           "steps_per_pair": pair_steps / (k * NUM_CLASSES),
           "never_convinced": float((ms.steps_run == steps).float().mean()),
           "ms_per_step": 1000 * seconds / max(pair_steps, 1), "plateau": []}
    score = SCORES[recipe.score]
    for window, rise in PLATEAU_RULES:
        losses, kept = plateau_stop(ms.losses, ms.steps_run, window, rise)
        u = score(losses).T
        u_r, _ = normalise(u)
        row["plateau"].append({"window": window, "rise": rise, "steps_left": int(kept.sum()) / max(pair_steps, 1),
                               "max_du": float((u - ms.u).abs().max()), "max_du_r": float((u_r - ms.u_r).abs().max()),
                               "same_top_client": float((u_r.argmax(1) == ms.u_r.argmax(1)).float().mean())})
    if batched:
        start = time.perf_counter()
        stratify(*args, clients_per_call=1, **kwargs)
        row["batched_seconds"] = time.perf_counter() - start
    print(f"K={k}: MS {seconds:.1f} s, {row['steps_per_pair']:.1f} steps per pair, "
          f"{100 * row['never_convinced']:.0f}% never convinced, {row['ms_per_step']:.1f} ms per step", flush=True)
    return row


def render(records: list[dict]) -> Path:
    runs = [r for r in records if r.get("fleets")]
    if not runs:
        raise SystemExit(f"{JSON}: no records to render")
    run = runs[-1]
    fleets = sorted(run["fleets"], key=lambda r: r["k"])
    base = fleets[0]
    lines = ["# Model stratification against the number of clients", "",
             "FMNIST NIID-Bench 0.5, the client-number table's fleets, MS as FedHydra runs it "
             f"on a CPU (sequential loop, robust recipe: T_G = {base['t_g']}, noise batch {base['ms_batch']}, "
             "stop once the CE < 0.01), one process, one torch thread. Command: `python -m benchmarks.ms_growth`; "
             f"code {run['code_version']}, {run['date']}; machine {run['machine']}.", "",
             f"| K | seed | pairs | MS s | ratio to K = {base['k']} | generator steps | ratio to K = {base['k']} | "
             "steps per pair | never convinced | ms per generator step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in fleets:
        lines.append(f"| {r['k']} | {r['seed']} | {r['pairs']} | {r['seconds']:.1f} | "
                     f"{r['seconds'] / base['seconds']:.2f}x (K ratio {r['k'] / base['k']:.0f}x) | "
                     f"{r['generator_steps']:,} | {r['generator_steps'] / base['generator_steps']:.2f}x | "
                     f"{r['steps_per_pair']:.1f} | "
                     f"{100 * r['never_convinced']:.0f}% | {r['ms_per_step']:.1f} |")
    cost = [r["ms_per_step"] for r in fleets]
    last = fleets[-1]
    lines += ["", f"MS's work is its generator steps: {last['generator_steps'] / base['generator_steps']:.1f}x from "
              f"K = {base['k']} to K = {last['k']} for {last['k'] / base['k']:.0f}x the clients, while one step costs "
              f"{min(cost):.1f}-{max(cost):.1f} ms at every K (wall seconds on a shared machine; the step counts are "
              "exact). It grows faster than K because a pair needs more steps on a larger fleet, whose clients hold "
              "smaller shards and are convinced later or never within T_G.", ""]
    batched = [r for r in fleets if "batched_seconds" in r]
    for r in batched:
        lines.append(f"Batched pairs (every class of one client in one vmapped call), K = {r['k']}: "
                     f"{r['batched_seconds']:.1f} s against the loop's {r['seconds']:.1f} s "
                     f"({r['seconds'] / r['batched_seconds']:.2f}x speed): slower on this CPU (see scale.md part 1).")
    lines += ["", "Plateau stop replayed on the recorded curves (a pair never convinced stops once its class "
              "probability rose by less than `rise` over `window` steps): generator steps left, and how far U and "
              "U_r move.", "", "| K | window | rise | steps left | max abs dU | max abs dU_r | same top client |",
              "|---|---|---|---|---|---|---|"]
    for r in fleets:
        for p in r["plateau"]:
            lines.append(f"| {r['k']} | {p['window']} | {p['rise']:g} | {100 * p['steps_left']:.0f}% | "
                         f"{p['max_du']:.4f} | {p['max_du_r']:.4f} | {100 * p['same_top_client']:.0f}% |")
    left = [p["steps_left"] for r in fleets for p in r["plateau"] if (p["window"], p["rise"]) == PLATEAU_RULES[1]]
    if left:
        lines += ["", f"At window {PLATEAU_RULES[1][0]}, rise {PLATEAU_RULES[1][1]:g} the plateau stop leaves "
                  f"{100 * min(left):.0f}-{100 * max(left):.0f}% of the steps at every K: a constant factor on MS "
                  "(a share of FedHydra's server time, results/clients.md), not a slower growth, bought by moving U; "
                  "FedHydra keeps MS as it is."]
    REPORT.write_text("\n".join(lines) + "\n")
    return REPORT


def fleet_arg(text: str) -> tuple[int, int]:
    try:
        k, seed = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a fleet as K:seed, e.g. 20:2") from None
    return k, seed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fleets", type=fleet_arg, nargs="+", default=[(5, 2), (10, 2), (20, 2), (50, 0)],
                        help="K:seed of each kept fleet (default: 5:2 10:2 20:2 50:0)")
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args(argv)
    if not args.render_only:
        torch.set_num_threads(1)
        smallest = min(k for k, _ in args.fleets)
        fleets = [measure(k, seed, batched=k == smallest) for k, seed in sorted(args.fleets)]
        record = {"code_version": code_version(), "machine": machine(),
                  "date": datetime.now().isoformat(timespec="seconds"), "fleets": fleets}
        append_to_json_list(JSON, record)
    records = json.loads(JSON.read_text()) if JSON.is_file() else []
    print(render(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
