"""Robustness benchmark: one poisoned client of K, every server method on identical uploads.

For every dataset x cell x seed the clients are trained once (the paper table's runs and uploads
are reused), then variants of the uploads archive are built with client `--victim` replaced:
  honest   the archive as trained
  flip     the victim's classifier rows rolled by one: it answers y+1 wherever it would have
           answered y (a confident, wrong client; no retraining)
  random   the victim's model replaced by a fresh random initialisation
  scale10  every weight and bias of the victim multiplied by 10 (BN statistics kept)
  shuffled the victim retrained the way it was trained (same init, shard, batches) on its own shard
           with the labels shuffled among its samples: a trained model that knows no class, with the
           label counts it reports still true (costs one client training)
  minus    the victim left out (K-1 honest clients, min-clients = K-1): the bar a method that
           ignores the poisoner would reach
and every method (`--methods`, variants such as fedhydra-paper allowed) is replayed on each. One
record per run goes to benchmarks/results/robustness.jsonl (variant and victim named) and the
table to benchmarks/results/robustness.md.

  python -m benchmarks.robustness --datasets mnist fmnist --cells 0.5 0.1 --seeds 0 1 \
      --variants honest flip random scale10 minus --methods fedhydra fedhydra-paper dense coboosting --jobs 2
Finished records are skipped (--force redoes them); `--jobs N` replays N runs at once (one torch
thread each).
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
from collections import defaultdict
from pathlib import Path

import torch

from benchmarks.paper_table import (BENCH_DIR, ReplayJob, ReplayRunner, cell_name, check_grid, parse_sets,
                                    train_clients, uploads_id)
from benchmarks.render import _stat, method_label
from benchmarks.records import (RESULTS_DIR, has_record, load_records, overrides_key, provenance_line,
                                resolve_variant)
from launcher.cli import bounded
from oneshot_fl.config import ConfigError
from oneshot_fl.logs import setup_logging

TABLE = "robustness"
VARIANTS = ("honest", "flip", "random", "scale10", "shuffled", "minus")
log = logging.getLogger("oneshot_fl.bench")


def classifier_keys(state: dict[str, torch.Tensor], num_classes: int) -> tuple[str, str | None]:
    """The last 2-D weight with one row per class (the classifier) and its bias."""
    weight = [k for k, v in state.items() if k.endswith("weight") and v.dim() == 2 and v.shape[0] == num_classes][-1]
    bias = weight[: -len("weight")] + "bias"
    return weight, bias if bias in state else None


def poisoned_state(state: dict[str, torch.Tensor], variant: str, arch: str, input_shape, num_classes: int,
                   seed: int) -> dict[str, torch.Tensor]:
    from oneshot_fl.models.registry import build

    state = {k: v.clone() for k, v in state.items()}
    if variant == "flip":  # new row j = old row j-1: logit j now fires where logit j-1 did
        for key in classifier_keys(state, num_classes):
            if key is not None:
                state[key] = torch.roll(state[key], 1, dims=0)
    elif variant == "random":
        state = build(arch, input_shape, num_classes, seed=seed).state_dict()
    elif variant == "scale10":
        model = build(arch, input_shape, num_classes)
        params = {name for name, _ in model.named_parameters()}
        state = {k: v * 10.0 if k in params else v for k, v in state.items()}
    else:
        raise ValueError(f"unknown poisoning {variant!r}")
    return state


def retrained_state(run_config: dict, victim: int, arch: str, shuffle_seed: int | None) -> dict[str, torch.Tensor]:
    """The victim's classifier trained again as its ClientApp trained it (client_app.task.train_classifier:
    seeded shared init, its shard, its batch order), with its labels permuted among its samples unless
    `shuffle_seed` is None (then the honest upload comes back: tests check that)."""
    import numpy as np

    from client_app.task import ClientJob, load_shard, start_model
    from oneshot_fl.config import from_run_config
    from oneshot_fl.data.datasets import DATASETS, Split
    from oneshot_fl.devices import pick_device
    from oneshot_fl.local.train import train_local
    from oneshot_fl.seeding import torch_generator

    run_config = dict(run_config)
    if run_config.get("data-dir") and not Path(run_config["data-dir"]).is_dir():
        run_config["data-dir"] = ""  # trained on another machine: this one's data folder ($ONESHOT_FL_DATA_DIR)
    cfg = from_run_config(run_config)
    if cfg.local.loss != "ce" or cfg.rounds != 1:
        raise ConfigError(f"the shuffled variant retrains one-shot cross-entropy clients; this archive's clients "
                          f"used local.loss={cfg.local.loss!r}, rounds={cfg.rounds}")
    shard = load_shard(cfg, victim)
    if shuffle_seed is not None:
        shard = Split(shard.images, np.random.default_rng(shuffle_seed).permutation(shard.labels))
    model = start_model(ClientJob(cfg, victim, arch, {}), DATASETS[cfg.dataset])
    train_local(model, shard, cfg.local, pick_device(), torch_generator(cfg.seed, "local", victim),
                label=f"client p{victim} (shuffled labels)")
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def make_variant(uploads: Path, variant: str, victim: int, out: Path) -> Path:
    """A copy of the archive with the victim (partition id) poisoned or left out."""
    manifest = json.loads((uploads / "manifest.json").read_text())
    if variant == "honest":
        return uploads
    source = uploads_id(uploads)
    if (out / "manifest.json").is_file() and json.loads((out / "manifest.json").read_text()).get("source") == source:
        return out
    if out.exists():  # made from another training run of this cell: not this archive's variant
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = manifest["context"]
    entries = []
    for entry in manifest["uploads"]:
        if entry["partition_id"] == victim:
            if variant == "minus":
                continue
            state = torch.load(uploads / entry["file"], map_location="cpu", weights_only=True)
            if variant == "shuffled":  # in the archive's dtypes (a half-precision upload stays one)
                retrained = retrained_state(ctx["run_config"], victim, entry["arch"], shuffle_seed=10_000 + victim)
                state = {k: retrained[k].to(v.dtype) for k, v in state.items()}
            else:
                state = poisoned_state(state, variant, entry["arch"], tuple(ctx["input_shape"]), ctx["num_classes"],
                                       seed=10_000 + victim)
            torch.save(state, out / entry["file"])
            # what the victim measured of its honest model is not true of this one: only its shard size and
            # training time (the run's local timings) stay
            entry = {**entry, "metrics": {k: v for k, v in entry["metrics"].items()
                                          if k in ("train-seconds", "num-examples")}, "poisoned": variant}
        else:
            shutil.copy2(uploads / entry["file"], out / entry["file"])
        entries.append(entry)
    (out / "manifest.json").write_text(json.dumps({**manifest, "uploads": entries, "source": source}, indent=2))
    return out


def plan(args, client_sets: dict, server_sets: dict) -> list[ReplayJob]:
    """Every (cell, seed, variant, method) run that has no record yet; trains missing clients."""
    jobs = []
    for dataset in args.datasets:
        for cell in args.cells:
            for seed in args.seeds:
                uploads = train_clients(args.uploads_from, dataset, cell, seed, args.num_clients, args.preset,
                                        client_sets, False)
                trained = json.loads((uploads / "manifest.json").read_text())["context"]["run_config"].get("preset")
                if trained != args.preset:
                    raise SystemExit(f"{uploads} was trained with preset {trained!r}, not {args.preset!r}: pass "
                                     f"--uploads-from a table trained at {args.preset!r}")
                source = uploads_id(uploads)  # the honest archive every variant of this cell is made from
                for variant in args.variants:
                    out = BENCH_DIR / "runs" / args.table / f"{cell_name(dataset, cell, seed)}-{variant}-v{args.victim}"
                    archive = make_variant(uploads, variant, args.victim, out / "uploads")
                    for label in args.methods:
                        method, variant_sets = resolve_variant(label)
                        sets = {**server_sets, **variant_sets, "preset": args.preset, "threads": 1}
                        if variant == "minus":
                            sets["min-clients"] = args.num_clients - 1
                        key = {"method": method, "dataset": dataset, "cell": cell, "seed": seed, "variant": variant,
                               "victim": args.victim, "overrides_key": overrides_key({**client_sets, **sets}),
                               "uploads_id": source}
                        if has_record(args.table, key) and not args.force:
                            continue
                        run_dir = out / label
                        if args.force and run_dir.exists():
                            shutil.rmtree(run_dir)
                        extra = {"cell": cell, "variant": variant, "victim": args.victim, "run_dir": str(run_dir),
                                 "uploads_id": source, **({"label": label} if label != method else {})}
                        jobs.append(ReplayJob(args.table, archive, label, method, sets, run_dir,
                                              {**client_sets, **sets}, extra))
    return jobs


def run_jobs(jobs: list[ReplayJob], workers: int, table: str = TABLE) -> None:
    """The paper table's runner: one fresh worker process per replay, each record appended (and the
    table rendered) as its replay ends."""
    runner = ReplayRunner(workers, on_record=lambda: render(table))
    for job in jobs:
        runner.submit(job)
    runner.close()


BAR = -0.02  # a poisoned fleet may lose at most 2 points against the victim left out


def bar_lines(records, labels: list[str]) -> list[str]:
    """Per seed: each poisoned variant's accuracy minus `minus` on the same source uploads (records
    without an uploads fingerprint cannot be paired and are left out), marked where it loses more than
    2 points: a mean over seeds can hide one seed that falls through."""
    acc = {(method_label(r), r["dataset"], r["cell"], r["seed"], r["victim"], r["uploads_id"], r["variant"]):
           r["accuracy_final"] for r in records if r.get("uploads_id")}
    rows = sorted({k[1:6] for k in acc if k[6] == "minus"})
    if not rows:
        return []
    poisoned = [v for v in VARIANTS if v not in ("honest", "minus")]
    lines = ["", "Per seed, each poisoned variant minus the victim left out (points, same source uploads); "
             "**bold**: more than 2 points lost.", "",
             "| dataset | cell | seed | victim | method | minus | " + " | ".join(poisoned) + " |",
             "|" + "---|" * (6 + len(poisoned))]
    for dataset, cell, seed, victim, uploads in rows:
        for label in labels:
            bar = acc.get((label, dataset, cell, seed, victim, uploads, "minus"))
            if bar is None:
                continue
            deltas = []
            for variant in poisoned:
                got = acc.get((label, dataset, cell, seed, victim, uploads, variant))
                if got is None:
                    deltas.append("-")
                    continue
                text = f"{100 * (got - bar):+.2f}"
                deltas.append(f"**{text}**" if got - bar < BAR else text)
            lines.append(f"| {dataset} | {cell} | {seed} | p{victim} | {label} | {100 * bar:.2f} | "
                         + " | ".join(deltas) + " |")
    return lines


def render(table: str = TABLE, out: Path | None = None) -> Path:
    """results/<table>.md: one row per (dataset, cell, variant), one column per method."""
    records = {}
    for r in sorted(load_records(table), key=lambda r: r.get("recorded_at", "")):
        records[(method_label(r), r["dataset"], r["cell"], r["seed"], r["variant"], r["victim"])] = r
    by = defaultdict(list)
    for (label, dataset, cell, _seed, variant, victim), r in records.items():
        by[(dataset, cell, variant, victim, label)].append(r["accuracy_final"])
    order = ["fedhydra", "fedhydra-capped", "fedhydra-paper", "dense", "coboosting"]
    labels = sorted({k[0] for k in records}, key=lambda m: order.index(m) if m in order else len(order))
    rows = sorted({k[:4] for k in by}, key=lambda k: (k[0], k[1], VARIANTS.index(k[2]) if k[2] in VARIANTS else 9))
    lines = ["# Robustness: one poisoned client", "",
             "Final-epoch test accuracy (%), mean ± std over seeds (n), every method on the same uploads; "
             "`victim` = the partition id replaced; `minus` = the victim left out (the honest bar). Command: "
             f"`python -m benchmarks.robustness` (see benchmarks/README.md); records: `{table}.jsonl`.", "",
             "| dataset | cell | variant | victim | " + " | ".join(labels) + " |", "|" + "---|" * (4 + len(labels))]
    for row in rows:
        cells = []
        for label in labels:
            cells.append(_stat(by.get((*row, label), [])))
        lines.append(f"| {row[0]} | {row[1]} | {row[2]} | p{row[3]} | " + " | ".join(cells) + " |")
    lines += bar_lines(records.values(), labels)
    lines += ["", provenance_line(records.values()), ""]
    out = out or RESULTS_DIR / f"{table}.md"
    out.write_text("\n".join(lines))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["mnist", "fmnist"])
    parser.add_argument("--cells", nargs="+", default=["0.5", "0.1"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--victim", type=int, default=0, help="partition id of the poisoned client")
    parser.add_argument("--methods", nargs="+", default=["fedhydra", "fedhydra-paper", "dense", "coboosting"])
    parser.add_argument("--num-clients", type=int, default=5)
    parser.add_argument("--preset", default="cpu")
    parser.add_argument("--table", default=TABLE, help="records file (results/<table>.jsonl) and run folder")
    parser.add_argument("--uploads-from", default="paper_table",
                        help="the paper-table records whose uploads are poisoned (trained there if missing)")
    parser.add_argument("--client-set", action="append", default=[], help="client-side overrides (local.*)")
    parser.add_argument("--set", action="append", default=[], help="server-side overrides for every method")
    parser.add_argument("--jobs", type=bounded(1, int), default=1, help="replays run at once (one torch thread each)")
    parser.add_argument("--force", action="store_true")
    parser.add_argument("--render-only", action="store_true")
    args = parser.parse_args(argv)
    if not 0 <= args.victim < args.num_clients:
        parser.error(f"--victim {args.victim}: a partition id in 0..{args.num_clients - 1}")
    try:
        client_sets, server_sets = parse_sets(args.client_set), parse_sets(args.set)
        check_grid(args.datasets, args.cells, args.seeds, args.methods, args.num_clients, args.preset, client_sets,
                   server_sets)
    except ConfigError as exc:
        parser.error(str(exc))
    setup_logging()
    logging.getLogger("oneshot_fl.bench").setLevel(logging.INFO)
    if not args.render_only:
        jobs = plan(args, client_sets, server_sets)
        log.info("%d replays to run, %d at a time", len(jobs), args.jobs)
        run_jobs(jobs, args.jobs, args.table)
    print(render(args.table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
