"""FedHydra ablation: the robust default with one component removed at a time, on identical uploads.

Measures each variant's label-free teacher accuracy on the test set (stage `teacher`: no distillation), the seconds
of model stratification and of the peer check, and whom expel left out; stage `replay` measures full replays
(distillation included) of chosen variants. Fleets: the paper table's uploads of MNIST / FMNIST NIID-Bench 0.1 and
FMNIST 2c/c, seeds 0-2, honest; MNIST / FMNIST 0.1, seeds 0-1, with client 0 label-flipped (`flip`), its weights
x10 (`scale10`) and left out (`minus`; benchmarks.poisoning); and the grey heterogeneous tuning fleets
(benchmarks.fleets: LeNet / CNN / CNN / ResNet-8 / VGG-9, MNIST / FMNIST NIID-Bench 0.1 and 0.5, seed 100, never
reported), honest and with client 0 (LeNet) or 2 (cnn3-bn) label-flipped. Variants (VARIANTS): the default, the
default without

  ms           model stratification: U uniform (every client speaks for every class), no expel
  prob-auc     the bounded score: Eq. 2's relative loss range, every run taking all T_G steps
  expel        expel, and with it the peer check (the check serves only expel)
  calibrated   calibrated SA: SA on raw logits
  class-route  routing by output class: routed by the synthetic label (its uniform-prior average on test data)
  bn-cap       the BN cap: the plain mean of the clients' BN losses (teacher unchanged: replays only)
  running      the running calibration statistics (started from MS's images): each batch standardised by its own

(Earlier records also hold `+reweight`, the peer check's reweighting of U added back; the engine no longer computes
it, so it is rendered from the records but not measured: docs/decisions.md.)
Records: results/ablation.jsonl; report: results/ablation.md.

Cost on the 2-core development machine: the teacher stage ~2 min per fleet and process (MS about 70 s of it); a
full replay 9-20 min of server (medians of the records: MNIST 9 min, FMNIST 19 min, one thread beside another job).
Fleets missing their uploads are trained first (~5 min of CPU for a paper-table fleet, ~20 min for a grey one).

  python -m benchmarks.ablation --stage teacher --jobs 2
  python -m benchmarks.ablation --stage replay --variants default bn-cap --jobs 2
"""
from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from datetime import datetime
from multiprocessing import get_context
from pathlib import Path

import numpy as np
import torch

from benchmarks.fleets import BENCH_DIR, cell_name, train_clients, tuning_server_sets, tuning_uploads
from benchmarks.poisoning import make_variant
from benchmarks.records import RESULTS_DIR, append_record, code_version, load_records, machine, record_from_result
from oneshot_fl.archive import load_uploads
from oneshot_fl.config import from_run_config
from oneshot_fl.data.datasets import to_tensor
from oneshot_fl.devices import set_threads
from oneshot_fl.engine.teachers import ClientEnsemble, RunningCalibration, StratifiedAggregation
from oneshot_fl.engine.trust import peer_distributions, peer_graph
from oneshot_fl.evaluation import evaluate_logits
from launcher.launch import run_config_items
from oneshot_fl.logs import setup_logging
from launcher.replay import replay, replay_config
from strategies import build_strategy
from strategies.datafree import client_models
from strategies.fedhydra import RECIPES, FedHydra, reference_calibration, weigh

log = logging.getLogger("oneshot_fl.bench")
TABLE = "ablation"
HONEST_CELLS = (("mnist", "0.1"), ("fmnist", "0.1"), ("fmnist", "2c/c"))
HONEST_SEEDS = (0, 1, 2)
POISONED_CELLS = (("mnist", "0.1"), ("fmnist", "0.1"))
POISONED_SEEDS = (0, 1)
POISONS = ("flip", "scale10", "minus")
VICTIM = 0
# the grey tuning fleets (benchmarks.fleets, conf/grey-hetero-cpu.toml): every client another architecture
HETERO_CELLS = (("mnist", "0.1"), ("fmnist", "0.1"), ("mnist", "0.5"), ("fmnist", "0.5"))
HETERO_SEED = 100
HETERO_VICTIMS = (0, 2)  # LeNet, cnn3-bn
# earlier passes, relative to the default of their time: rendered on their own (--code-version), not mixed in
EARLIER_PASSES = {"334c8b7": "the first pass, whose default also reweighted U by the peer check's trust "
                             "(columns 'check': neither reweighting nor expel; 'reweight': the reweighting removed)"}

# variant -> fields of the robust recipe it changes ("ms": no stratification at all)
VARIANTS: dict[str, dict] = {
    "default": {},
    "ms": {"uniform": True, "expel": False},
    "prob-auc": {"score": "paper", "stop_loss": 0.0},
    "expel": {"expel": False},
    "calibrated": {"sa_space": "logits"},
    "class-route": {"sa_route": "label"},
    "bn-cap": {"bn_cap": 0.0},
    "running": {"calibration": "batch"},
}
TEACHER_VARIANTS = tuple(v for v in VARIANTS if v != "bn-cap")  # the BN cap changes only the generator
REPLAY_VARIANTS = tuple(v for v in VARIANTS if v != "ms")


def recipe_of(variant: str, base: str = "robust"):
    """(recipe, uniform): the base recipe with the variant's fields changed; uniform = no stratification."""
    fields = dict(VARIANTS[variant])
    uniform = fields.pop("uniform", False)
    return replace(RECIPES[base], **fields), uniform


def ablated(recipe):
    """FedHydra running `recipe` instead of its mode's: the strategy class a variant's replay and MS use."""
    return type("Ablated", (FedHydra,), {"recipe": recipe})


@dataclass(frozen=True)
class Fleet:
    dataset: str
    cell: str
    seed: int
    poison: str = "honest"
    hetero: bool = False  # the grey tuning fleet instead of the paper table's one-architecture fleet
    victim: int = VICTIM

    @property
    def honest_name(self) -> str:
        return ("hetero-" if self.hetero else "") + cell_name(self.dataset, self.cell, self.seed)

    @property
    def name(self) -> str:
        if self.poison == "honest":
            return self.honest_name
        return f"{self.honest_name}-{self.poison}" + (f"-v{self.victim}" if self.hetero else "")

    def uploads(self) -> Path:
        """The fleet's uploads archive (the paper table's or the tuning fleet's, or a poisoned variant of it, kept
        with the robustness table's)."""
        honest = (tuning_uploads(self.dataset, self.cell, self.seed) if self.hetero
                  else train_clients("paper_table", self.dataset, self.cell, self.seed, 5, "cpu", {}, False))
        name = f"{self.honest_name}-{self.poison}-v{self.victim}"
        return make_variant(honest, self.poison, self.victim, BENCH_DIR / "runs" / "robustness" / name / "uploads")

    def server_sets(self) -> dict:
        """What every server run on the fleet is told besides its archive: the fleet file's server settings for
        the tuning fleets (as their training runs got them), nothing for the paper table's."""
        return tuning_server_sets(self.dataset) if self.hetero else {}


def fleets() -> list[Fleet]:
    honest = [Fleet(d, c, s) for d, c in HONEST_CELLS for s in HONEST_SEEDS]
    poisoned = [Fleet(d, c, s, p) for d, c in POISONED_CELLS for s in POISONED_SEEDS for p in POISONS]
    hetero = [Fleet(d, c, HETERO_SEED, hetero=True) for d, c in HETERO_CELLS]
    hetero_flip = [Fleet(d, c, HETERO_SEED, "flip", hetero=True, victim=v) for d, c in HETERO_CELLS
                   for v in HETERO_VICTIMS]
    return honest + poisoned + hetero + hetero_flip


def load_fleet(uploads: Path, run_dir: Path, server_sets: dict | None = None):
    """(strategy, uploads, ClientEnsemble) of a default `fedhydra` replay of the archive told `server_sets`, as
    replay builds them."""
    cfg = from_run_config(replay_config(uploads, {"method": "fedhydra", "threads": 1, **(server_sets or {})}))
    set_threads(cfg.threads)
    strategy = build_strategy(cfg, run_dir)
    ctx = strategy.ctx
    ups = load_uploads(uploads, ctx.num_classes, ctx.input_shape, strategy.roles, skip_other_roles=True)
    return strategy, ups, ClientEnsemble(client_models(ups, ctx), [up.arch for up in ups])


def start_calibration(recipe, uniform: bool, ensemble: ClientEnsemble, ms: dict, kept: torch.Tensor):
    """The running calibration the run's teacher starts from (fedhydra.stratified_teacher): the kept clients'
    statistics on the kept clients' MS images; None (each batch's own) where the variant has none."""
    if uniform or recipe.sa_space != "calibrated" or recipe.calibration != "running":
        return None
    stratification = ms[(recipe.score, recipe.stop_loss)][0]
    start = reference_calibration(ensemble, stratification.samples[kept])  # every client's statistics ...
    return RunningCalibration(initial=start.subset(kept))  # ... the kept ones'


def teacher_pass(fleet: Fleet) -> list[dict]:
    """Every teacher variant's label-free accuracy on one fleet: one MS run per score, shared by the variants."""
    setup_logging()
    version = code_version()
    uploads = fleet.uploads()
    with tempfile.TemporaryDirectory() as tmp:
        strategy, ups, ensemble = load_fleet(uploads, Path(tmp) / "run", fleet.server_sets())
        ctx = strategy.ctx
        test_logits = torch.cat([ensemble.logits(to_tensor(ctx.test.images[f:f + 512]).to(ctx.device)).float().cpu()
                                 for f in range(0, len(ctx.test), 512)], dim=1)  # (m, n, c)
        ms = {}  # (score, stop_loss) -> (Stratification, distributions, check seconds)
        rows = []
        for variant in TEACHER_VARIANTS:
            recipe, uniform = recipe_of(variant)
            start = time.perf_counter()
            if uniform:
                m = len(ups)
                weighting_u_r = torch.full((ctx.num_classes, m), 1.0 / m)
                weighting_u_c = torch.full_like(weighting_u_r, 1.0 / ctx.num_classes)
                left_out, ms_s, check_s = None, 0.0, 0.0
            else:
                key = (recipe.score, recipe.stop_loss)
                if key not in ms:
                    runner = ablated(recipe)(strategy.cfg, ctx)
                    result = runner.stratify(ensemble, ctx)
                    started = time.perf_counter()
                    peers = peer_graph(len(ensemble), ctx.seed("peer-graph"))  # as the strategy builds it
                    with ensemble.bn_paused():
                        distributions = peer_distributions(ensemble.models, result.samples, ctx.device, peers=peers)
                    ms[key] = (result, distributions, peers, time.perf_counter() - started)
                result, distributions, peers, peer_s = ms[key]
                started = time.perf_counter()
                weighting = weigh(result.u, distributions, recipe, peers)
                weighting_u_r, weighting_u_c, left_out = weighting.u_r, weighting.u_c, weighting.left_out
                ms_s = result.seconds
                check_s = (peer_s + time.perf_counter() - started) if recipe.expel else 0.0
            kept = torch.ones(len(ups), dtype=torch.bool) if left_out is None else ~left_out
            teacher = StratifiedAggregation(weighting_u_r[:, kept], weighting_u_c[:, kept], recipe.sa_space,
                                            recipe.sa_route, calibration=start_calibration(recipe, uniform, ensemble,
                                                                                           ms, kept))
            with teacher.frozen():  # as the run scores its teacher before distillation: over batches of 512
                logits = torch.cat([teacher(test_logits[kept, f:f + 512])
                                    for f in range(0, test_logits.shape[1], 512)])
            accuracy = evaluate_logits(logits, ctx.test.labels, ctx.num_classes).accuracy
            rows.append({
                "table": TABLE, "stage": "teacher", "fleet": fleet.name, "dataset": fleet.dataset, "cell": fleet.cell,
                "seed": fleet.seed, "poison": fleet.poison,
                "victim": fleet.victim if fleet.poison != "honest" else None,
                "variant": variant, "teacher_accuracy": accuracy, "ms_seconds": ms_s, "check_seconds": check_s,
                "left_out": [] if left_out is None else [ups[k].partition_id for k in left_out.nonzero().flatten()],
                "clients": [up.partition_id for up in ups], "code_version": version, "machine": machine(),
                "recorded_at": datetime.now().isoformat(timespec="seconds")})
            log.info("%s %s: teacher %.4f (%.1fs)", fleet.name, variant, accuracy, time.perf_counter() - start)
        ensemble.close()
    return rows


def replay_pass(fleet: Fleet, variant: str, runs: Path) -> dict:
    """One full replay of a variant (distillation included) -> its record."""
    setup_logging()
    version = code_version()
    recipe, uniform = recipe_of(variant)
    if uniform:
        raise SystemExit(f"the {variant!r} variant has no replay here (stage teacher only)")
    uploads = fleet.uploads()
    run_dir = runs / f"{fleet.name}-{variant}"
    if run_dir.exists():
        shutil.rmtree(run_dir)
    sets = (run_config_items(fleet.server_sets()) + ["method='fedhydra'", "threads=1"]
            + (["min-clients=4"] if fleet.poison == "minus" else []))
    cls = ablated(recipe) if variant != "default" else None
    result = replay(uploads, sets, run_dir=run_dir, strategy_cls=cls)
    record = record_from_result(TABLE, {**result, "code_version": version}, {"variant": variant},
                                {"stage": "replay", "fleet": fleet.name, "cell": fleet.cell, "poison": fleet.poison,
                                 "variant": variant, "run_dir": str(run_dir)})
    return record


def latest(records: list[dict], stage: str) -> dict:
    """(fleet, variant) -> the newest record of the stage."""
    out = {}
    for r in records:
        if r.get("stage") == stage:
            out[(r["fleet"], r["variant"])] = r
    return out


def render(code_version: str | None = None, out: Path | None = None) -> Path:
    """results/ablation.md: teacher accuracy per fleet and variant, the effect of removing each component per
    group of fleets, its cost, and the full replays. `code_version`: only that version's records (an earlier
    pass, whose variants were relative to the default of its time), written to `out`."""
    records = [r for r in load_records(TABLE) if r["code_version"] == code_version
               or (code_version is None and r["code_version"] not in EARLIER_PASSES)]
    # the variants the records hold, in VARIANTS order (an earlier pass may name others: after them)
    named = [v for v in VARIANTS if any(r["variant"] == v for r in records)]
    variants = tuple(named + sorted({r["variant"] for r in records} - set(named)))
    teacher_variants = tuple(v for v in variants if v != "bn-cap")
    teacher, replays = latest(records, "teacher"), latest(records, "replay")
    names = [f.name for f in fleets()]
    lines = ["# FedHydra ablation", "",
             "Generated by `python -m benchmarks.ablation` (benchmarks/README.md). Each column is the robust default "
             "with one component removed (or, marked +, added back); cells are test accuracy (%). Code versions: "
             + ", ".join(sorted({r["code_version"] for r in records})) + "."
             + (f" This is {EARLIER_PASSES[code_version]}." if code_version in EARLIER_PASSES else ""), "",
             "## Label-free teacher (no distillation)", "",
             "| fleet | " + " | ".join(teacher_variants) + " | left out (default) |",
             "|---|" + "---|" * (len(teacher_variants) + 1)]
    for name in names:
        row = [teacher.get((name, v)) for v in teacher_variants]
        if not any(row):
            continue
        cells = [f"{100 * r['teacher_accuracy']:.2f}" if r else "" for r in row]
        left_out = teacher.get((name, "default"), {}).get("left_out", "")
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {left_out} |")
    lines += ["", "Each variant against the default: mean change of the teacher's accuracy (points) per group of "
              "fleets; for a removed component, negative = the component helps; for an added one (+), positive = it "
              "would help. The seed-to-seed noise is the mean over the honest cells of the default's standard "
              "deviation across seeds; seconds are the mean MS and peer-check time per fleet.", ""]
    every = fleets()
    groups = {("hetero " if hetero else "") + poison: [f for f in every if f.poison == poison and f.hetero == hetero]
              for hetero, poison in ((False, "honest"), (False, "flip"), (False, "scale10"), (True, "honest"),
                                     (True, "flip"))}
    spreads = []
    for dataset, cell in HONEST_CELLS:
        values = [teacher[(Fleet(dataset, cell, s).name, "default")]["teacher_accuracy"] for s in HONEST_SEEDS
                  if (Fleet(dataset, cell, s).name, "default") in teacher]
        if len(values) > 1:
            spreads.append(100 * float(np.std(values, ddof=1)))
    noise = float(np.mean(spreads)) if spreads else float("nan")
    lines += [f"Seed-to-seed noise: {noise:.2f} points.", "",
              "| variant | " + " | ".join(groups) + " | MS s | check s |", "|---|" + "---|" * (len(groups) + 2)]
    for variant in teacher_variants[1:]:
        cells = []
        for fl in groups.values():
            diffs = [100 * (teacher[(f.name, variant)]["teacher_accuracy"]
                            - teacher[(f.name, "default")]["teacher_accuracy"])
                     for f in fl if (f.name, variant) in teacher and (f.name, "default") in teacher]
            cells.append(f"{np.mean(diffs):+.2f} (n={len(diffs)})" if diffs else "")
        rows = [r for (n, v), r in teacher.items() if v == variant]
        ms_s = np.mean([r["ms_seconds"] for r in rows]) if rows else float("nan")
        check_s = np.mean([r["check_seconds"] for r in rows]) if rows else float("nan")
        lines.append(f"| {variant} | " + " | ".join(cells) + f" | {ms_s:.1f} | {check_s:.1f} |")
    default_rows = [r for (n, v), r in teacher.items() if v == "default"]
    if default_rows:
        ms_s, check_s = (np.mean([r[k] for r in default_rows]) for k in ("ms_seconds", "check_seconds"))
        lines.append("| (default) | " + "| " * len(groups) + f"{ms_s:.1f} | {check_s:.1f} |")
    if replays:
        variants = [v for v in VARIANTS if any(k[1] == v for k in replays)]
        lines += ["", "## Full replays (distillation included)", "",
                  "Final accuracy (%), teacher in brackets, server seconds after the slash.", "",
                  "| fleet | " + " | ".join(variants) + " |", "|---|" + "---|" * len(variants)]
        for name in names:
            row = [replays.get((name, v)) for v in variants]
            if not any(row):
                continue
            lines.append(f"| {name} | " + " | ".join(
                f"{100 * r['accuracy_final']:.2f} ({100 * (r['ensemble_accuracy'] or 0):.2f}) / "
                f"{r['wall_s']['server_total']:.0f}" if r else "" for r in row) + " |")
    lines += ["", f"Machine: {records[0]['machine']['processor']}, {records[0]['machine']['cpus']} CPUs, "
              f"GPU {records[0]['machine']['gpu']}; one torch thread per process." if records else ""]
    path = out or RESULTS_DIR / f"{TABLE}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stage", choices=("teacher", "replay"), default="teacher")
    parser.add_argument("--variants", nargs="+", choices=REPLAY_VARIANTS, default=None,
                        help="replay stage: which variants (default: default and bn-cap)")
    parser.add_argument("--fleets", nargs="+", default=None, help="fleet names (default: all), e.g. mnist-0.1-s0-flip")
    parser.add_argument("--jobs", type=int, default=1, help="fleets at once, one process and torch thread each")
    parser.add_argument("--force", action="store_true", help="redo what already has a record")
    parser.add_argument("--render-only", action="store_true")
    parser.add_argument("--code-version", default=None, help="--render-only: that code version's records only")
    parser.add_argument("--out", type=Path, default=None, help="--render-only: the markdown file to write")
    args = parser.parse_args(argv)
    setup_logging()
    logging.getLogger("oneshot_fl.bench").setLevel(logging.INFO)
    if args.render_only:
        print(render(args.code_version, args.out))
        return 0
    chosen = [f for f in fleets() if args.fleets is None or f.name in args.fleets]
    if args.fleets and (unknown := set(args.fleets) - {f.name for f in chosen}):
        parser.error(f"unknown fleet(s) {sorted(unknown)}; known: {[f.name for f in fleets()]}")
    done = latest(load_records(TABLE), args.stage)
    runs = BENCH_DIR / "runs" / TABLE
    if args.stage == "teacher":
        jobs = [(teacher_pass, (f,)) for f in chosen if args.force or (f.name, "default") not in done]
    else:
        variants = args.variants or ["default", "bn-cap"]
        jobs = [(replay_pass, (f, v, runs)) for f in chosen for v in variants if args.force or (f.name, v) not in done]
    failed = 0
    # each job in a fresh process: the code it imports is the code its record names
    with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=get_context("spawn"),
                             max_tasks_per_child=1) as pool:
        futures = {pool.submit(fn, *fargs): fargs for fn, fargs in jobs}
        for future in as_completed(futures):
            try:
                out = future.result()
            except Exception as exc:  # one failed fleet must not cost the others' records
                log.error("%s failed: %s", futures[future], exc)
                failed += 1
                continue
            for record in out if isinstance(out, list) else [out]:
                append_record(record)
            render()
    print(render())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
