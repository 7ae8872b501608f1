"""CIFAR-10 at the `paper` preset on one GPU in one call, sized before it starts.

  bash scripts/gpu_paper.sh                                   # on the GPU machine (OUT, DEADLINE, DATA: see there)
  python -m benchmarks.gpu_paper run --out DIR --deadline 540 [--fleet hetero] [--data-dir DATA]
  python -m benchmarks.gpu_paper record DIR                   # here: DIR/summary.json -> results/gpu_paper.*

One call, in order:
  1. the cost model on this card (benchmarks.cost_model at the preset's sizes, the fleet's stages only):
     seconds per step of every stage, written to DIR/cost_model.json;
  2. the budget: the largest (local epochs, distillation epochs) = the preset's (200, 200) times one factor
     f <= 1 whose predicted time fits what is left of the deadline (`plan`; the whole preset where it fits);
  3. the clients of CIFAR-10 NIID-Bench 0.5 seed 0 (the fleet's architectures, local.augment = crop-flip as DENSE's
     code trains CIFAR-10 clients), each in its own process sharing the GPU, as Ray places ClientApps given a
     fraction of a GPU, through the ClientApp's own training function; their uploads form one archive;
  4. DENSE and FedHydra replayed on that archive, side by side, each in its own process;
  5. DIR/summary.json (the card, the budget and its prediction, the per-stage times, each phase's wall seconds,
     each method's accuracy, its teachers' and its server phases) and DIR/runs.tar.gz (logs and result files).
A method still running at the deadline is stopped and reported with the last test accuracy its log printed.
The GPU image has no Flower: the call carries flwr and its missing dependencies as wheels (docs/gpu.md).
`run --preset smoke` checks the whole script on a CPU in a minute.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
TABLE = "gpu_paper"
SEED, ALPHA = 0, 0.5
METHODS = ("dense", "fedhydra")
WORKER_START_S = 25.0  # a worker process's imports, CUDA context and data load (gpu_cells: 25 s on a lent GPU)
MARGIN = 1.15  # the prediction is stretched by this before it is held against the deadline
WRAP_UP_S = 15.0  # merging the archive, the summary and the tarball
TEST_ACC = re.compile(r"epoch (\d+)/(\d+) .*test acc (\d\.\d+)")


def fleet_config(fleet: str, preset: str, data_dir: str | None = None, overrides: dict | None = None) -> dict:
    """The flat run config of the call's fleet (without the budget's epochs)."""
    from benchmarks.cost_model import fleets

    archs, server = fleets()[fleet] if fleet in fleets() else (fleet.split(":")[0].split(","), fleet.split(":")[1])
    flat = {"dataset": "cifar10", "partition": "niid-bench", "alpha": ALPHA, "seed": SEED,
            "num-clients": len(archs), "client-models": ",".join(archs), "server-model": server, "preset": preset,
            "local.augment": "crop-flip", "download": False, "save-uploads": False, "threads": 1,
            "server-threads": 1, **(overrides or {})}
    if data_dir:
        flat["data-dir"] = str(Path(data_dir).resolve())
    return flat


def run_config(flat: dict, **epochs):
    from oneshot_fl.config import from_run_config, merge_overrides

    return from_run_config(merge_overrides({**flat, **epochs}))


# --- the plan -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    local_epochs: int
    distill_epochs: int
    factor: float  # of the preset's epochs
    whole_preset: bool
    predicted_s: dict  # {"clients", "dense", "fedhydra", "fixed", "total"} seconds, the margin included
    available_s: float


def stage_seconds(cost: dict) -> dict[str, float]:
    """{stage name: measured seconds per step} of a cost-model fleet entry."""
    return {row["name"]: row["seconds"] for row in cost["stages"]}


def predict(times: dict[str, float], shards: dict[int, tuple[str, int]], counts: dict, local_epochs: int,
            distill_epochs: int) -> dict[str, float]:
    """Seconds of each part at these epochs, each process alone on the GPU; parts that share the GPU at once
    (the clients; the two methods) add up, as a GPU time-slices processes.

    `shards`: partition id -> (architecture, shard size); `counts`: the preset's local batch, generator and KD steps
    per epoch, evaluation cadence, test images, MS steps."""
    from strategies.datafree import FAST_CHECKPOINT_INTERVAL_S

    clients = sum(local_epochs * math.ceil(n / counts["local_batch"]) * times[f"local[{arch}]"]
                  for arch, n in shards.values())
    epoch = (counts["generator_steps"] * times["generator"] + counts["kd_steps"] * times["kd"]
             + counts["test_images"] * times["evaluation"] / counts["eval_every"])
    server = distill_epochs * epoch
    fixed = {"dense": counts["test_images"] * times["teachers"],
             "fedhydra": counts["test_images"] * times["teachers"] + counts["ms_steps"] * times["ms"]}
    checkpoints = {m: math.ceil(server / FAST_CHECKPOINT_INTERVAL_S) * times["checkpoint"] for m in METHODS}
    out = {"clients": clients, **{m: server + fixed[m] + checkpoints[m] for m in METHODS}}
    out["total"] = out["clients"] + sum(out[m] for m in METHODS)
    return out


def plan(times: dict[str, float], shards: dict[int, tuple[str, int]], counts: dict, available_s: float,
         margin: float = MARGIN) -> Plan:
    """The largest f <= 1 with (E, T) = (floor(f E_paper), floor(f T_paper)) whose predicted time, times `margin`,
    fits `available_s` (the deadline less the time spent and the workers' start-up); at least one epoch each."""
    full_e, full_t = counts["local_epochs"], counts["distill_epochs"]

    def cost(f: float) -> dict[str, float]:
        e, t = max(1, math.floor(f * full_e)), max(1, math.floor(f * full_t))
        return {k: margin * v for k, v in predict(times, shards, counts, e, t).items()}

    if cost(1.0)["total"] <= available_s:
        f = 1.0
    else:  # the total grows with f: bisect for the largest f that fits
        lo, hi = 0.0, 1.0
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if cost(mid)["total"] <= available_s else (lo, mid)
        f = lo
    e, t = max(1, math.floor(f * full_e)), max(1, math.floor(f * full_t))
    return Plan(e, t, f, f == 1.0, cost(f), available_s)


def preset_counts(cfg) -> dict:
    from benchmarks.cost_model import TEST_SIZE
    from strategies.fedhydra import FedHydraParams, RECIPES

    d = cfg.distill
    ms_steps = int(cfg.flat.get("fedhydra.ms-steps") or FedHydraParams().ms_steps)
    return {"local_batch": cfg.local.batch_size, "local_epochs": cfg.local.epochs, "distill_epochs": d.epochs,
            "generator_steps": d.generator_steps, "kd_steps": d.kd_steps, "eval_every": d.eval_every,
            "test_images": TEST_SIZE if cfg.eval.test_samples < 0 else cfg.eval.test_samples,
            "ms_steps": ms_steps, "ms_batch": RECIPES["robust"].ms_batch}


def shard_sizes(cfg) -> dict[int, tuple[str, int]]:
    from client_app.task import load_shard

    return {p: (cfg.arch_for(p), len(load_shard(cfg, p))) for p in range(cfg.num_clients)}


# --- workers --------------------------------------------------------------------------------------------------

def client_worker(flat_json: str, pid: int, epochs: int, folder: Path) -> None:
    from benchmarks.inprocess_fleet import cached_uploads

    cfg = run_config(json.loads(flat_json), **{"local.epochs": epochs})
    cached_uploads(folder, cfg, [(pid, "classifier", cfg.arch_for(pid))])


def server_worker(method: str, epochs: int, archive: Path, run_dir: Path, sets_json: str = "{}") -> None:
    from launcher.launch import run_config_items
    from launcher.replay import replay

    sets = {"method": method, "distill.epochs": epochs, "threads": 1, "server-threads": 1, **json.loads(sets_json)}
    replay(archive, run_config_items(sets), run_dir=run_dir)


WORKERS = {"client": (client_worker, (("flat_json", str), ("pid", int), ("epochs", int), ("folder", Path))),
           "server": (server_worker, (("method", str), ("epochs", int), ("archive", Path), ("run_dir", Path),
                                      ("sets_json", str)))}


def spawn(args: list[str], log: Path, module: str = "benchmarks.gpu_paper") -> subprocess.Popen:
    """`python -m module *args` from the repository, one thread, its output in `log` (a worker process)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, "-m", module, *args], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, env=env, cwd=REPO)


class Inline:
    """A worker run in this process at once (`run(..., inline=True)`: the script's check on a CPU), with the
    interface of the Popen that `spawn` returns."""

    def __init__(self, args: list[str], log: Path):
        import logging
        import traceback

        worker, fields = WORKERS[args[0]]
        handler = logging.FileHandler(log)
        logging.getLogger().addHandler(handler)
        try:
            worker(*(kind(value) for (_, kind), value in zip(fields, args[1:])))
            self.returncode = 0
        except Exception:  # noqa: BLE001 - reported as the exit code a failed process would have
            log.open("a").write(traceback.format_exc())
            self.returncode = 1
        finally:
            logging.getLogger().removeHandler(handler)
            handler.close()

    def wait(self, timeout: float | None = None) -> int:
        return self.returncode


def wait_all(procs: dict, until: float) -> dict[str, int | None]:
    """Exit codes by name; a process still running at `until` (monotonic seconds) is killed (None; a negative
    code is a signal from elsewhere, e.g. the kernel's OOM killer)."""
    codes = {}
    for name, proc in procs.items():
        try:
            codes[name] = proc.wait(timeout=max(0.0, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            codes[name] = None
    return codes


def last_test_accuracy(log: Path) -> dict | None:
    found = list(TEST_ACC.finditer(log.read_text(errors="replace"))) if log.is_file() else []
    if not found:
        return None
    epoch, total, acc = found[-1].groups()
    return {"epoch": int(epoch), "epochs": int(total), "accuracy": float(acc)}


# --- the call -------------------------------------------------------------------------------------------------

def measure_cost(archs: list[str], server: str, out: Path) -> dict:
    """The cost model's stages of this fleet on this device (at the preset's sizes on a GPU), also written to
    `out`/cost_model.json; returns the fleet's entry."""
    from benchmarks import cost_model
    from oneshot_fl.devices import pick_device

    device = pick_device()
    entry = cost_model.run({"call": (archs, server)}, device, 10 if device.type == "cuda" else 1, 0.16,
                           with_variants=False)
    (out / "cost_model.json").write_text(json.dumps(entry, indent=1) + "\n")
    return entry["fleets"]["call"]


def run(out: Path, deadline: float, work: Path, fleet: str, preset: str, data_dir: str | None,
        overrides: dict | None = None, server_sets: dict | None = None, cost_file: Path | None = None,
        inline: bool = False) -> dict:
    """The call (the module's docstring). `cost_file`: a cost model's fleet entry to size by instead of measuring
    one; `inline`: the workers one after the other in this process instead of side by side in their own."""
    start_worker = Inline if inline else spawn
    import torch

    from benchmarks.records import code_version
    from oneshot_fl.archive import load_uploads, save_uploads
    from oneshot_fl.data.datasets import DATASETS, load_split
    from oneshot_fl.config import resolve_data_dir

    start = time.monotonic()
    end = start + deadline
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    flat = fleet_config(fleet, preset, data_dir, overrides)
    cfg = run_config(flat)
    summary: dict = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                     "torch": torch.__version__, "cpus": os.cpu_count(), "code_version": code_version(),
                     "deadline_s": deadline, "fleet": fleet, "preset": preset, "argv": sys.argv[1:],
                     "run_config": flat, "server_sets": server_sets or {}, "phases": {}}

    def save() -> None:
        summary["elapsed_s"] = round(time.monotonic() - start, 1)
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    for split in ("train", "test"):  # every worker reads the decoded cache: fill it once
        load_split(cfg.dataset, split, str(resolve_data_dir(cfg)), False)
    shards = shard_sizes(cfg)
    summary["shards"] = {str(p): list(v) for p, v in shards.items()}
    summary["phases"]["data_s"] = round(time.monotonic() - start, 1)

    # 1. the cost model on this card
    mark = time.monotonic()
    cost = json.loads(cost_file.read_text()) if cost_file else measure_cost(list(cfg.client_models),
                                                                            cfg.global_arch, out)
    summary["stage_seconds"] = stage_seconds(cost)
    summary["phases"]["cost_model_s"] = round(time.monotonic() - mark, 1)

    # 2. the budget
    counts = preset_counts(cfg)
    available = end - time.monotonic() - 2 * WORKER_START_S - WRAP_UP_S
    chosen = plan(summary["stage_seconds"], shards, counts, available)
    summary["plan"] = asdict(chosen)
    summary["preset_counts"] = counts
    save()

    # 3. the clients, side by side on the device
    mark = time.monotonic()
    # the clients may take what the servers' prediction leaves (their own prediction and the slack)
    clients_until = end - WRAP_UP_S - WORKER_START_S - chosen.predicted_s["dense"] - chosen.predicted_s["fedhydra"]
    procs = {p: start_worker(["client", json.dumps(flat), str(p), str(chosen.local_epochs),
                              str(work / "clients" / f"p{p}")], work / f"client-p{p}.log")
             for p in range(cfg.num_clients)}
    codes = wait_all(procs, clients_until)
    summary["phases"]["clients_s"] = round(time.monotonic() - mark, 1)
    summary["clients"] = {"exit": {str(p): c for p, c in codes.items()}}
    save()
    if any(code != 0 for code in codes.values()):
        summary["stopped"] = "a client did not finish (see its log in runs.tar.gz)"
        save()
        _pack(out, work)
        return summary

    info = DATASETS[cfg.dataset]
    uploads, seconds = [], []
    for p in range(cfg.num_clients):
        folder = work / "clients" / f"p{p}"
        uploads += load_uploads(folder, info.num_classes, info.input_shape, ("classifier",))
        seconds += json.loads((folder / "manifest.json").read_text())["context"]["client_seconds"]
    trained = run_config(flat, **{"local.epochs": chosen.local_epochs})
    archive = save_uploads(work / "archive", uploads, {"run_config": trained.flat, "client_seconds": seconds})
    summary["clients"]["seconds"] = seconds

    # 4. DENSE and FedHydra on the same uploads, side by side
    mark = time.monotonic()
    procs = {m: start_worker(["server", m, str(chosen.distill_epochs), str(archive), str(work / "runs" / m),
                              json.dumps(server_sets or {})], work / f"server-{m}.log") for m in METHODS}
    codes = wait_all(procs, end - WRAP_UP_S)
    summary["phases"]["servers_s"] = round(time.monotonic() - mark, 1)
    summary["methods"] = {}
    for method, code in codes.items():
        result_path = work / "runs" / method / "result.json"
        entry = {"exit": code}
        if code == 0 and result_path.is_file():
            result = json.loads(result_path.read_text())
            g = result["global"]
            entry.update(accuracy_final=g["accuracy_final"], accuracy_best=g.get("accuracy_best"),
                         ensemble_accuracy=g.get("ensemble_accuracy"), timings=result["timings"],
                         fast_path=g.get("fast_path"), result=result)
        else:
            entry["last_logged"] = last_test_accuracy(work / f"server-{method}.log")
        summary["methods"][method] = entry
    save()
    _pack(out, work)
    return summary


def _pack(out: Path, work: Path) -> None:
    with tarfile.open(out / "runs.tar.gz", "w:gz") as tar:
        for path in sorted(work.glob("*.log")):
            tar.add(path, arcname=f"logs/{path.name}")
        for path in sorted((work / "runs").glob("*/*")):
            if path.suffix in (".json", ".md", ".log", ".png"):
                tar.add(path, arcname=f"runs/{path.parent.name}/{path.name}")


# --- records ----------------------------------------------------------------------------------------------------

def record(folder: Path, results_dir: Path | None = None) -> Path:
    """Append the folder's method results to results/gpu_paper.jsonl and add its section to gpu_paper.md."""
    from benchmarks import records

    results_dir = results_dir or records.RESULTS_DIR
    summary = json.loads((folder / "summary.json").read_text())
    chosen, stage = summary["plan"], summary["stage_seconds"]
    call = (f"Run on {summary['device']} ({summary['cpus']} CPU threads, torch {summary['torch']}), code "
            f"{summary['code_version']}, by `python -m benchmarks.gpu_paper {' '.join(summary['argv'])}` (one call, "
            f"{summary['elapsed_s']:.0f} s of a {summary['deadline_s']:.0f} s deadline). CIFAR-10 NIID-Bench "
            f"{ALPHA:g}, seed {SEED}, fleet {summary['fleet']} ({summary['run_config']['client-models']}; server "
            f"{summary['run_config']['server-model']}), the `{summary['preset']}` preset except the epochs: local "
            f"{chosen['local_epochs']} and distillation {chosen['distill_epochs']} (factor {chosen['factor']:.3f} of "
            f"the preset's; whole preset: {chosen['whole_preset']}); clients trained with local.augment=crop-flip.")
    lines = [call, "",
             "Predicted (margin included) / measured wall seconds: clients "
             f"{chosen['predicted_s']['clients']:.0f} / {summary['phases'].get('clients_s', 0):.0f}; DENSE and "
             f"FedHydra side by side {chosen['predicted_s']['dense'] + chosen['predicted_s']['fedhydra']:.0f} / "
             f"{summary['phases'].get('servers_s', 0):.0f}; the cost model {summary['phases']['cost_model_s']:.0f}, "
             f"data {summary['phases']['data_s']:.0f}.", "",
             "Seconds per step measured on the card: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in stage.items())
             + ".", "",
             "| method | top-1 % | best % | teachers' ensemble % | stratification s | distillation s | server s |",
             "|---|---|---|---|---|---|---|"]
    for method, entry in summary.get("methods", {}).items():
        if "result" not in entry:
            last, code = entry.get("last_logged"), entry["exit"]
            why = "stopped at the deadline" if code is None else f"failed (exit {code})"
            lines.append(f"| {method} | {why}" + (f", last logged epoch {last['epoch']}/{last['epochs']}: "
                                                  f"{100 * last['accuracy']:.2f}" if last else "") + " | | | | | |")
            continue
        t = entry["timings"]
        rec = records.record_from_result(TABLE, entry["result"], {"method": method, **chosen_overrides(summary)},
                                         {"gpu_paper": summary["fleet"], "plan": chosen,
                                          "machine": {"gpu": summary["device"], "cpus": summary["cpus"],
                                                      "torch": summary["torch"]}})
        line = (json.dumps(rec, sort_keys=True) + "\n")
        with (results_dir / f"{TABLE}.jsonl").open("a") as fh:
            fh.write(line)
        ens = entry.get("ensemble_accuracy")
        lines.append(f"| {method} | {100 * entry['accuracy_final']:.2f} | {100 * (entry['accuracy_best'] or 0):.2f} | "
                     f"{'' if ens is None else f'{100 * ens:.2f}'} | {t.get('stratification', 0):.0f} | "
                     f"{t.get('distillation', 0):.0f} | {t.get('server_fuse', 0):.0f} |")
    report = results_dir / f"{TABLE}.md"
    head = f"# {TABLE}\n\nThe CIFAR-10 paper preset on one GPU in one call (`benchmarks/gpu_paper.py`).\n"
    body = report.read_text() if report.is_file() else head
    report.write_text(body.rstrip() + f"\n\n## {summary['device']}, code {summary['code_version']}\n\n"
                      + "\n".join(lines) + "\n")
    return report


def chosen_overrides(summary: dict) -> dict:
    chosen = summary["plan"]
    return {"preset": summary["preset"], "local.epochs": chosen["local_epochs"],
            "distill.epochs": chosen["distill_epochs"], "local.augment": "crop-flip", **summary.get("server_sets", {})}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run")
    p_run.add_argument("--out", type=Path, required=True)
    p_run.add_argument("--deadline", type=float, default=540.0, help="seconds for the whole call (default 540)")
    p_run.add_argument("--work", type=Path, default=Path("/tmp/gpu_paper"))
    p_run.add_argument("--fleet", default="hetero",
                       help="hetero (FedHydra Table 3), resnet18x5, or 'ARCH,ARCH,...:SERVER'")
    p_run.add_argument("--preset", default="paper", choices=["paper", "smoke"],
                       help="smoke: check this script on a CPU before a GPU call")
    p_run.add_argument("--data-dir", help="the folder holding cifar10/ (default: data-dir's usual lookup)")
    p_run.add_argument("--set", nargs="*", default=[], metavar="KEY=JSON",
                       help="run-config overrides for clients and servers (JSON values), e.g. distill.synth-batch=8")
    p_run.add_argument("--cost-model", type=Path, help="a cost model's fleet entry (JSON) instead of measuring one")
    p_rec = sub.add_parser("record")
    p_rec.add_argument("folder", type=Path)
    for name, (_, fields) in WORKERS.items():
        p_worker = sub.add_parser(name)
        for field, kind in fields:
            p_worker.add_argument(field, type=kind, **({"nargs": "?", "default": "{}"} if field == "sets_json" else {}))
    args = parser.parse_args(argv)
    from oneshot_fl.logs import setup_logging

    setup_logging()
    if args.command == "run":
        overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
        server = {k: v for k, v in overrides.items() if k.startswith(("distill.", "fedhydra.", "dense.", "gpu."))}
        summary = run(args.out, args.deadline, args.work, args.fleet, args.preset, args.data_dir, overrides, server,
                      args.cost_model)
        print(json.dumps({k: summary.get(k) for k in ("plan", "phases", "elapsed_s")}, indent=1))
    elif args.command == "record":
        print(record(args.folder))
    else:
        worker, fields = WORKERS[args.command]
        worker(*(getattr(args, field) for field, _ in fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
