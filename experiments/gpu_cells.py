"""Table cells at the papers' settings on a lent GPU, one fleet per call of a few minutes.

  python -m experiments.gpu_cells plan                                  # here: every config checked, nothing run
  python -m experiments.gpu_cells run --out DIR --deadline 470 --cells hetero-cifar10   # on the GPU machine
  python -m experiments.gpu_cells record DIR                            # here: DIR/summary.json -> results/gpu_cells.*

Run one fleet per call (--cells, --only): 25 client processes time-slicing one H100 fell behind the epoch times the
probe measured while they were starting, so that 17 of the 25 were still training when the window those times had
sized closed (results/gpu_cells_attempt1.json); one fleet of 10 finished within its call (results/gpu_cells.md).

The cells (seed 0, NIID-Bench 0.5 unless named):
  tableiv-mnist   FedMHO Table IV: 5 VGG-9 classifiers + 5 CVAE-small decoders (FedMHO, -MD, -SD; FedAvg,
                  DENSE and FedHydra on the classifiers) and a FedCVAE fleet of 10 CVAE-large decoders
  hetero-cifar10  FedHydra Table 3: GoogLeNet / ResNet-18 / CNN / CNN / LeNet clients, ResNet-18 server
                  (DENSE, FedHydra, FedDF, Co-Boosting)
  hetero-cifar10-alpha0_1  the same fleet on NIID-Bench 0.1 (cell names hold no dot: keys are cell.fleet)
Everything is the `paper` preset except two numbers the time limit sets, both recorded:
  - local epochs (classifiers, and the CVAEs' epochs): every client first trains 2 epochs in parallel (the probe);
    each fleet's epochs are then the most that fit the client phase at the slowest client's measured epoch time,
    capped at the paper's (E = 200, CVAE per FedMHO Table III);
  - server distillation epochs, SERVER_EPOCHS below or --distill-epochs (the paper runs 200).
Clients train in parallel processes through the ClientApp's own training functions (benchmarks.inprocess_fleet);
each server method replays the fleet's archive in its own process (launcher.replay). A method still running at
the deadline is stopped and reported with the last test accuracy its log printed (epoch n of N), never as final.
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
from pathlib import Path

from benchmarks import gpu_paper
from benchmarks.gpu_paper import last_test_accuracy, wait_all

REPO = Path(__file__).resolve().parent.parent
BENCH_DIR = REPO / "benchmarks"
TABLE = "gpu_cells"
SEED, ALPHA = 0, 0.5
SERVER_EPOCHS = {"tableiv-mnist": 20, "hetero-cifar10": 10, "hetero-cifar10-alpha0_1": 10}
CLIENT_PHASE_END = 0.5  # share of the time left after loading the data that the clients may take (probe included)
PROBE_SHARE = 0.45  # share of the client phase the probe may take
STARTUP_S = 25.0  # a worker's start (imports, CUDA context, data load) before its first epoch
EPOCH_LINE = re.compile(r"epoch (\d+)/(\d+) .*?\((\d+(?:\.\d+)?)s, ")


def fleets(preset: str = "paper") -> dict[str, dict]:
    """cell -> {fleet name: (flat run config, [(partition id, role, arch)]), ...}, the methods on each fleet and
    the cell's NIID-Bench alpha. `preset` other than paper only checks the script itself at smoke size on a CPU."""
    from benchmarks.fleets import cell_overrides, parse_sets
    from benchmarks.fleets import fedmho_fleet as fleet_overrides

    mixed = fleet_overrides("fedmho-md", "mnist", ALPHA, SEED, preset, "vgg9", {})
    fedcvae = fleet_overrides("fedcvae", "mnist", ALPHA, SEED, preset, "vgg9", {})

    def hetero(alpha: float) -> dict:
        flat = {**parse_sets([str(BENCH_DIR / "conf" / "cifar10-hetero-paper.toml")]), "method": "dense",
                "seed": SEED, "preset": preset, **cell_overrides(f"{alpha:g}")}
        archs = flat["client-models"].split(",")
        return {"fleets": {"fleet": (flat, [(p, "classifier", archs[p]) for p in range(len(archs))])},
                "methods": [(m, "fleet", {}) for m in ("dense", "fedhydra", "feddf", "coboosting")], "alpha": alpha}

    return {
        "tableiv-mnist": {
            "fleets": {"mixed": (mixed, [(p, "classifier", "vgg9") for p in range(5)]
                                 + [(p, "decoder", "") for p in range(5, 10)]),
                       "fedcvae": (fedcvae, [(p, "decoder", "") for p in range(10)])},
            "methods": [("fedmho-md", "mixed", {}), ("fedmho", "mixed", {}), ("fedmho-sd", "mixed", {}),
                        ("fedavg", "mixed", {"min-clients": 5}), ("dense", "mixed", {"min-clients": 5}),
                        ("fedhydra", "mixed", {"min-clients": 5}), ("fedcvae", "fedcvae", {})],
            "alpha": ALPHA},
        "hetero-cifar10": hetero(ALPHA),
        "hetero-cifar10-alpha0_1": hetero(0.1),
    }


def client_config(flat: dict, epochs: int, cvae_epochs: int):
    from oneshot_fl.config import from_run_config, merge_overrides

    return from_run_config(merge_overrides({**flat, "threads": 1, "server-threads": 1, "save-uploads": False,
                                            "local.epochs": epochs, "cvae.epochs": cvae_epochs}))


def paper_epochs(flat: dict) -> tuple[int, int]:
    """The preset's local epochs and this fleet's CVAE epochs (FedMHO Table III): the caps of the probe's choice."""
    from oneshot_fl.paper_settings import PAPER_CVAE
    from oneshot_fl.presets import PRESETS

    if flat["preset"] != "paper":  # a smoke check of the script
        return PRESETS[flat["preset"]]["local.epochs"], 1
    return PRESETS["paper"]["local.epochs"], PAPER_CVAE[flat["dataset"]]["epochs"]


def server_epochs(cell: str, preset: str) -> int:
    return SERVER_EPOCHS[cell] if preset == "paper" else 2


# --- workers ------------------------------------------------------------------------------------------------

def client_worker(preset: str, cell: str, fleet: str, pid: int, epochs: int, cvae_epochs: int,
                  folder: Path) -> None:
    from benchmarks.inprocess_fleet import cached_uploads

    flat, jobs = fleets(preset)[cell]["fleets"][fleet]
    job = next(j for j in jobs if j[0] == pid)
    cached_uploads(folder, client_config(flat, epochs, cvae_epochs), [job])


def server_worker(preset: str, cell: str, method: str, epochs: int, archive: Path, run_dir: Path) -> None:
    from launcher.launch import run_config_items
    from launcher.replay import replay

    _, fleet, sets = next(m for m in fleets(preset)[cell]["methods"] if m[0] == method)
    sets = {"method": method, "distill.epochs": epochs, "threads": 1, "server-threads": 1, **sets}
    replay(archive, run_config_items(sets), run_dir=run_dir)


# --- the orchestration --------------------------------------------------------------------------------------

def spawn(args: list[str], log: Path) -> subprocess.Popen:
    return gpu_paper.spawn(args, log, module="experiments.gpu_cells")


def epoch_seconds(log: Path) -> float | None:
    """Seconds of the probe's second epoch (the first pays for warm-up) from a worker's training log."""
    marks = [float(m.group(3)) for m in EPOCH_LINE.finditer(log.read_text(errors="replace"))]
    return marks[-1] - marks[-2] if len(marks) >= 2 else None


def run(out: Path, deadline: float, work: Path, cells: list[str], preset: str, only: list[str] | None = None,
        methods: list[str] | None = None, client_epochs: list[int] | None = None,
        distill_epochs: int | None = None) -> None:
    """`only`: the fleets to train ("cell.fleet"; default all); `methods`: the server methods to run (default
    all); `client_epochs` [local, CVAE]: train at these epochs (capped at the paper's) instead of probing;
    `distill_epochs`: every server method's distillation epochs (default SERVER_EPOCHS)."""
    from oneshot_fl.archive import load_uploads, save_uploads
    from oneshot_fl.data.datasets import DATASETS, load_split
    from oneshot_fl.config import resolve_data_dir

    import torch

    start = time.monotonic()
    end = start + deadline
    work.mkdir(parents=True, exist_ok=True)
    summary: dict = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                     "torch": torch.__version__, "cpus": os.cpu_count(), "deadline_s": deadline,
                     "commit": os.environ.get("ONESHOT_FL_GIT_COMMIT"), "preset": preset, "argv": sys.argv[1:],
                     "cells": {}}
    plan, every_cell = {}, fleets(preset)
    for cname in cells:
        cell = every_cell[cname]
        kept = {f: v for f, v in cell["fleets"].items() if not only or f"{cname}.{f}" in only}
        plan[cname] = {"fleets": kept, "methods": [m for m in cell["methods"]
                                                   if m[1] in kept and (not methods or m[0] in methods)]}
    summary["plan"] = {c: {"fleets": list(v["fleets"]), "methods": [m[0] for m in v["methods"]]}
                       for c, v in plan.items()}
    summary["server_epochs"] = {c: distill_epochs or server_epochs(c, preset) for c in plan}

    def save():
        summary["elapsed_s"] = round(time.monotonic() - start, 1)
        (out / "summary.json").write_text(json.dumps(summary, indent=1))

    # every process decodes from the same cache: fill it once
    for cell in plan.values():
        for flat, _ in cell["fleets"].values():
            cfg = client_config(flat, 1, 1)
            for split in ("train", "test"):
                load_split(cfg.dataset, split, str(resolve_data_dir(cfg)), False)
    summary["data_s"] = round(time.monotonic() - start, 1)
    phase_start = time.monotonic()
    clients_until = phase_start + CLIENT_PHASE_END * (end - phase_start)

    # 1. the probe: 2 epochs of every client at once
    probes = {}
    for cname, cell in plan.items() if client_epochs is None else ():
        for fname, (_, jobs) in cell["fleets"].items():
            for pid, _, _ in jobs:
                key = f"{cname}.{fname}.p{pid}"
                probes[key] = spawn(["client", preset, cname, fname, str(pid), "2", "2", str(work / "probe" / key)],
                                    work / f"probe-{key}.log")
    codes = wait_all(probes, phase_start + PROBE_SHARE * (clients_until - phase_start))
    probe_s = {key: epoch_seconds(work / f"probe-{key}.log") for key in probes}
    if probes:
        summary["probe"] = {"exit": codes, "epoch_s": probe_s, "done_at_s": round(time.monotonic() - start, 1)}
    save()

    # 2. the clients, each fleet at the epochs its slowest client fits into the client phase
    budget = clients_until - time.monotonic() - STARTUP_S
    trains, fleet_epochs = {}, {}
    for cname, cell in plan.items():
        for fname, (flat, jobs) in cell["fleets"].items():
            paper_e, paper_cvae = paper_epochs(flat)
            if client_epochs is not None:
                chosen = {"classifier": min(paper_e, client_epochs[0]), "decoder": min(paper_cvae, client_epochs[1])}
            else:
                times = {role: [probe_s[f"{cname}.{fname}.p{p}"] for p, r, _ in jobs if r == role]
                         for role in ("classifier", "decoder")}
                if any(None in t for t in times.values()):  # a client that cannot train sinks its fleet only
                    summary.setdefault("skipped", {})[f"{cname}.{fname}"] = "a probe did not finish (see its log)"
                    continue
                chosen = {role: max(1, min(paper, math.floor(budget / max(times[role]))))
                          for role, paper in (("classifier", paper_e), ("decoder", paper_cvae)) if times[role]}
            e, ce = chosen.get("classifier", 1), chosen.get("decoder", 1)
            fleet_epochs[f"{cname}.{fname}"] = {"local.epochs": e, "cvae.epochs": ce, "paper": [paper_e, paper_cvae]}
            for pid, _, _ in jobs:
                key = f"{cname}.{fname}.p{pid}"
                trains[key] = spawn(["client", preset, cname, fname, str(pid), str(e), str(ce),
                                     str(work / "clients" / key)], work / f"client-{key}.log")
    summary["client_epochs"] = fleet_epochs
    save()
    codes = wait_all(trains, clients_until + 30)  # the epochs were sized to end by clients_until
    summary["clients"] = {"exit": codes, "done_at_s": round(time.monotonic() - start, 1)}
    save()

    # 3. every fleet's archive, then every method on it in parallel
    servers = {}
    for cname, cell in plan.items():
        archives = {}
        for fname, (flat, jobs) in cell["fleets"].items():
            keys = [f"{cname}.{fname}.p{p}" for p, _, _ in jobs]
            if any(codes.get(k) != 0 for k in keys):
                continue
            info = DATASETS[flat["dataset"]]
            roles = tuple(sorted({r for _, r, _ in jobs}))
            uploads, seconds = [], []
            for key in keys:
                uploads += load_uploads(work / "clients" / key, info.num_classes, info.input_shape, roles)
                seconds += json.loads((work / "clients" / key / "manifest.json").read_text())["context"][
                    "client_seconds"]
            cfg = client_config(flat, fleet_epochs[f"{cname}.{fname}"]["local.epochs"],
                                fleet_epochs[f"{cname}.{fname}"]["cvae.epochs"])
            archives[fname] = save_uploads(work / "archives" / f"{cname}.{fname}", uploads,
                                           {"run_config": cfg.flat, "client_seconds": seconds})
            summary["cells"].setdefault(cname, {})[f"client_seconds.{fname}"] = seconds
        for method, fname, _ in cell["methods"]:
            if fname in archives:
                key = f"{cname}.{method}"
                servers[key] = spawn(["server", preset, cname, method, str(summary["server_epochs"][cname]),
                                      str(archives[fname]), str(work / "runs" / key)], work / f"server-{key}.log")
    save()
    codes = wait_all(servers, end - 15)
    for key, code in codes.items():
        cname, method = key.split(".", 1)
        result_path = work / "runs" / key / "result.json"
        entry = {"exit": code, "server_epochs": summary["server_epochs"][cname]}
        if code == 0 and result_path.is_file():
            result = json.loads(result_path.read_text())
            entry.update(accuracy_final=result["global"]["accuracy_final"], result=result)
        else:
            entry["last_logged"] = last_test_accuracy(work / f"server-{key}.log")
        summary["cells"].setdefault(cname, {})[method] = entry
    save()
    with tarfile.open(out / "runs.tar.gz", "w:gz") as tar:
        for path in sorted(work.glob("*.log")):
            tar.add(path, arcname=f"logs/{path.name}")
        for path in sorted((work / "runs").glob("*/*")):
            if path.suffix in (".json", ".png", ".md", ".log"):
                tar.add(path, arcname=f"runs/{path.parent.name}/{path.name}")


# --- records ------------------------------------------------------------------------------------------------

def run_arguments(summary: dict) -> list[str]:
    """The `run` arguments of a summary written before summaries kept their command line."""
    plan = summary["plan"]
    args = ["run", "--deadline", f"{summary['deadline_s']:g}", "--cells", *plan]
    args += ["--only", *(f"{c}.{f}" for c, v in plan.items() for f in v["fleets"])]
    args += ["--methods", *(m for v in plan.values() for m in v["methods"])]
    if "probe" not in summary:
        epochs = next(iter(summary["client_epochs"].values()))
        args += ["--client-epochs", str(epochs["local.epochs"]), str(epochs["cvae.epochs"])]
    return args


def record(folder: Path) -> None:
    """Append the folder's paper runs to the records (those already there are skipped) and rewrite its cells'
    sections of the report; the sections of cells the folder did not run (other calls) are kept."""
    from benchmarks.records import RESULTS_DIR, append_record, has_record, record_from_result

    summary = json.loads((folder / "summary.json").read_text())
    if summary["preset"] != "paper":
        raise SystemExit(f"{folder}: a {summary['preset']} check of the script; only paper runs are recorded")
    plan = fleets()
    command = summary.get("argv") or run_arguments(summary)
    call = (f"Run on a lent {summary['device']} ({summary['cpus']} CPU threads, torch {summary['torch']}), code "
            f"{summary['commit']}, by `python -m experiments.gpu_cells {' '.join(command)}` (one call, "
            f"{summary['elapsed_s']:.0f} s). Seed 0, NIID-Bench {{alpha:g}}, the `paper` preset except the epochs "
            f"below.")
    report = RESULTS_DIR / f"{TABLE}.md"
    sections = report_sections(report.read_text()) if report.is_file() else {}
    for cname, cell in summary["cells"].items():
        epochs = {k: v for k, v in summary["client_epochs"].items() if k.startswith(cname + ".")}
        # summaries written before --distill-epochs ran SERVER_EPOCHS
        distill = summary.get("server_epochs", {}).get(cname, server_epochs(cname, "paper"))
        alpha = plan[cname]["alpha"]
        lines = [call.format(alpha=alpha), "", "Client epochs (paper in brackets): " + "; ".join(
            fleet_epochs(plan[cname], k, v) for k, v in epochs.items()) + f"; server distillation epochs "
            f"{distill} [200].", "",
            "| method | top-1 % | teachers' ensemble % | clients' local % | decoder samples scored % | server s |",
            "|---|---|---|---|---|---|"]
        for method, _, sets in plan[cname]["methods"]:
            entry = cell.get(method)
            if entry is None:
                continue
            if "result" in entry:
                result = entry["result"]
                overrides = {"method": method, "preset": "paper", "distill.epochs": distill,
                             **{f"{k}.{key}": v for k, e in epochs.items() for key, v in e.items() if key != "paper"},
                             **sets}
                new = record_from_result(TABLE, result, overrides,
                                         {"cell": f"{alpha:g}", "gpu_cell": cname, "client_epochs": epochs,
                                          "machine": {"gpu": summary["device"], "cpus": summary["cpus"],
                                                      "torch": summary["torch"]}})
                # the same cell, method, commit and accuracy: this folder was recorded before
                if not has_record(TABLE, {k: new[k] for k in ("gpu_cell", "method", "code_version", "accuracy_final")}):
                    append_record(new)
                local = ", ".join(f"{100 * c['local_accuracy']:.1f}" for c in result["clients"]
                                  if c.get("local_accuracy") is not None)
                g = result["global"]
                teachers = f"{100 * g['ensemble_accuracy']:.2f}" if g.get("ensemble_accuracy") is not None else ""
                scored = g.get("decoder_samples", {}).get("kept_accuracy")
                lines.append(f"| {method} | {100 * entry['accuracy_final']:.2f} | {teachers} | {local} | "
                             f"{'' if scored is None else f'{100 * scored:.1f}'} | "
                             f"{result['timings']['server_fuse']:.0f} |")
            else:
                last, code = entry.get("last_logged"), entry["exit"]
                why = "stopped at the deadline" if code is None else f"failed (exit {code})"
                lines.append(f"| {method} | {why}" + (
                    f", last logged epoch {last['epoch']}/{last['epochs']}: {100 * last['accuracy']:.2f}" if last
                    else "") + " | | | | |")
        sections[cname] = "\n".join(lines)
    body = [f"# {TABLE}", ""] + [f"## {name}\n\n{text.strip()}\n" for name, text in sorted(sections.items())]
    report.write_text("\n".join(body))


def fleet_epochs(cell: dict, key: str, epochs: dict) -> str:
    """'fleet: local E [paper]', with the CVAE epochs only for a fleet that has decoder clients."""
    fleet = key.split(".", 1)[1]
    decoders = any(role == "decoder" for _, role, _ in cell["fleets"][fleet][1])
    return (f"{fleet}: local {epochs['local.epochs']} [{epochs['paper'][0]}]"
            + (f", CVAE {epochs['cvae.epochs']} [{epochs['paper'][1]}]" if decoders else ""))


def report_sections(text: str) -> dict[str, str]:
    """The report's cell sections (heading '## cell') by cell, without their headings."""
    parts = re.split(r"^## (\S+)\n", text, flags=re.MULTILINE)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


# the processes `run` starts: each worker's function and its positional arguments, in the order of its parameters
WORKERS = {"client": (client_worker, (("preset", str), ("cell", str), ("fleet", str), ("pid", int), ("epochs", int),
                                      ("cvae_epochs", int), ("folder", Path))),
           "server": (server_worker, (("preset", str), ("cell", str), ("method", str), ("epochs", int),
                                      ("archive", Path), ("run_dir", Path)))}


def main(argv: list[str] | None = None) -> int:
    from launcher.cli import bounded

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("plan")
    p_run = sub.add_parser("run")
    p_run.add_argument("--out", type=Path, required=True)
    p_run.add_argument("--deadline", type=float, default=470.0, help="seconds for the whole call")
    p_run.add_argument("--work", type=Path, default=Path("/tmp/gpu_cells"))
    p_run.add_argument("--cells", nargs="+", default=list(SERVER_EPOCHS))
    p_run.add_argument("--only", nargs="+", help="train only these fleets (cell.fleet, e.g. tableiv-mnist.mixed)")
    p_run.add_argument("--methods", nargs="+", help="run only these server methods")
    p_run.add_argument("--client-epochs", nargs=2, type=bounded(1, int), metavar=("LOCAL", "CVAE"),
                       help="train at these epochs (capped at the paper's) instead of sizing them by the probe")
    p_run.add_argument("--distill-epochs", type=bounded(1, int), help=f"every server method's distillation epochs "
                       f"(default {', '.join(f'{c} {e}' for c, e in SERVER_EPOCHS.items())})")
    p_run.add_argument("--preset", default="paper", choices=["paper", "smoke"],
                       help="smoke: check this script on a CPU at smoke size before a GPU call")
    p_rec = sub.add_parser("record")
    p_rec.add_argument("folder", type=Path)
    for name, (_, fields) in WORKERS.items():
        p_worker = sub.add_parser(name)
        for field, kind in fields:
            p_worker.add_argument(field, type=kind)
    args = parser.parse_args(argv)
    from oneshot_fl.logs import setup_logging

    setup_logging()
    if args.command == "plan":
        for cname, cell in fleets().items():
            for fname, (flat, jobs) in cell["fleets"].items():
                cfg = client_config(flat, *paper_epochs(flat))
                print(cname, fname, cfg.dataset, cfg.preset, [(p, r, a or cfg.cvae.arch) for p, r, a in jobs])
            print("  methods:", [m for m, _, _ in cell["methods"]], "server epochs", SERVER_EPOCHS[cname])
    elif args.command == "run":
        args.out.mkdir(parents=True, exist_ok=True)
        run(args.out, args.deadline, args.work, args.cells, args.preset, args.only, args.methods, args.client_epochs,
            args.distill_epochs)
    elif args.command == "record":
        record(args.folder)
    else:
        worker, fields = WORKERS[args.command]
        worker(*(getattr(args, field) for field, _ in fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
