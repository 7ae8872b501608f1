"""Scale and speed benchmark (issue 7): ratios measured in one process, on this machine.

  python -m benchmarks.scale [--quick] [--parts stratify teachers server ratio upload sim100 clients]

Parts (each appends records to benchmarks/results/scale.jsonl and re-renders scale.md):
  stratify  batched Model Stratification vs the sequential reference: speedup, max |U_b - U_s|
  teachers  ClientEnsemble loop vs stacked (vmap) forward per synthetic sample, m = 5/10/20;
            SA = one einsum (op count, time vs the teacher forward); pool logits computed once
  server    server step time and peak memory of FedHydra (MS + teacher/SA work on a fixed synthesis
            budget) and FedAvg for m = 5..100 random-init cnn2 uploads; t(100)/t(5)
  ratio     FedHydra / DENSE server time on the same uploads and budget (real strategies via replay)
  upload    received bytes / raw parameter bytes per client; float16 uploads and their accuracy cost
  sim100    one Ray simulation with 100 clients: completion, wall time, peak RSS of the process tree
  clients   (optional) K = 5..100 client-number table, FedAvg / DENSE / FedHydra, small settings
`--quick` runs every selected part at tiny sizes (a smoke test of the command, minutes).
Absolute times on a shared 2-core CPU are noisy; the ratios are taken within one process.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import torch

from benchmarks.records import RESULTS_DIR, append_record, code_version, load_records, machine

BENCH_DIR = Path(__file__).resolve().parent
TABLE = "scale"
log = logging.getLogger("oneshot_fl.bench")

# Issue 7's targets, the figures each part is compared against.
TARGETS = {
    "stratify_speedup": 5.0,  # batched MS >= 5x the sequential loop
    "stratify_max_du": 1e-4,  # |U_batched - U_seq| where the math is identical
    "teacher_speedup": 2.0,  # stacked teachers >= 2x the loop at m >= 10
    "server_growth": 1.2 * 20,  # t(100)/t(5) <= 1.2 x (100/5): linear, with 20 % slack
    "hydra_dense_ratio": 1.05,  # FedHydra / DENSE server time
    "upload_ratio": 1.02,  # received / raw parameter bytes
}


@dataclass(frozen=True)
class Sizes:
    """Every size a part uses; `full` is the committed run, `quick` the smoke test."""

    ms_clients: int
    ms_classes: int
    ms_steps: int
    ms_batch: int
    nz: int
    ngf: int
    teacher_ms: tuple[int, ...]
    teacher_batch: int
    teacher_repeats: int
    server_ms: tuple[int, ...]
    server_ms_steps: int
    server_synth_steps: int  # generator steps of the fixed synthesis budget in the server part
    ratio_epochs: int  # distill.epochs of the FedHydra / DENSE comparison
    ratio_preset: str
    upload_preset: str
    sim_clients: int
    sim_alphas: tuple[float, ...]
    sim_preset: str
    sim_timeout: float
    clients_ks: tuple[int, ...]
    clients_epochs: int


SIZES = {
    "full": Sizes(ms_clients=5, ms_classes=10, ms_steps=10, ms_batch=64, nz=256, ngf=32,
                  teacher_ms=(5, 10, 20), teacher_batch=256, teacher_repeats=5,
                  server_ms=(5, 10, 20, 50, 100), server_ms_steps=2, server_synth_steps=5,
                  ratio_epochs=4, ratio_preset="cpu", upload_preset="cpu",
                  sim_clients=100, sim_alphas=(0.5,), sim_preset="cpu", sim_timeout=1500.0,
                  clients_ks=(5, 10, 20, 50, 100), clients_epochs=4),
    "quick": Sizes(ms_clients=2, ms_classes=3, ms_steps=2, ms_batch=8, nz=32, ngf=8,
                   teacher_ms=(2, 4), teacher_batch=16, teacher_repeats=2,
                   server_ms=(2, 4), server_ms_steps=1, server_synth_steps=1,
                   ratio_epochs=1, ratio_preset="smoke", upload_preset="smoke",
                   sim_clients=4, sim_alphas=(0.5,), sim_preset="smoke", sim_timeout=600.0,
                   clients_ks=(2, 3), clients_epochs=1),
}


# --- records -----------------------------------------------------------------------------------

def make_record(part: str, mode: str, settings: dict, metrics: dict) -> dict:
    return {"table": TABLE, "part": part, "mode": mode, "settings": settings, **metrics,
            "code_version": code_version(), "machine": machine(),
            "recorded_at": datetime.now().isoformat(timespec="seconds")}


def save(record: dict) -> dict:
    append_record(record, TABLE)
    log.info("%s: %s", record["part"], json.dumps({k: v for k, v in record.items()
                                                    if k not in ("machine", "settings")}, default=str)[:600])
    return record


def best_of(fn, repeats: int) -> float:
    """Minimum wall time of `repeats` calls: the least disturbed by the other jobs on this machine."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


# --- memory --------------------------------------------------------------------------------------

def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def peak_rss_self() -> int:
    """This process's peak resident set (ru_maxrss, kB on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class TreeSampler:
    """Samples the summed RSS of a set of process trees (ours plus the detached SuperLink's, whose
    Ray workers are its descendants) once a second; `peak` is the largest sum seen."""

    def __init__(self, roots, interval: float = 1.0):
        self.roots, self.interval = roots, interval  # roots: callable -> list of root pids
        self.peak, self.peak_processes, self.samples = 0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from oneshot_fl.launch import process_tree

        while not self._stop.wait(self.interval):
            pids = {p for root in self.roots() for p in process_tree(root)}
            total = sum(rss_bytes(p) for p in pids)
            self.samples += 1
            if total > self.peak:
                self.peak, self.peak_processes = total, len(pids)

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# --- part 6: 100 simulated clients -----------------------------------------------------------------

def part_sim100(sizes: Sizes, mode: str) -> list[dict]:
    """One Ray simulation per alpha: fedavg, num-clients = sim_clients. Two concurrent actors of
    1 CPU each on this 2-core machine; launch pins torch threads = int(cpus_per_client) = 1."""
    from oneshot_fl.launch import find_superlinks, run_simulation

    cpus_per_client = max(1.0, (os.cpu_count() or 2) / 2)
    records = []
    for alpha in sizes.sim_alphas:
        name = f"sim{sizes.sim_clients}-a{alpha:g}-{mode}"
        out = BENCH_DIR / "runs" / TABLE
        shutil.rmtree(out / name, ignore_errors=True)
        overrides = {"method": "fedavg", "dataset": "mnist", "num-clients": sizes.sim_clients,
                     "partition": "niid-bench", "alpha": alpha, "seed": 0, "preset": sizes.sim_preset,
                     "save-uploads": False, "output-dir": str(out), "run-name": name}
        home = Path(tempfile.mkdtemp(prefix="oneshot-fl-scale-"))
        try:
            with TreeSampler(lambda: [os.getpid(), *find_superlinks(home)]) as sampler:
                run = run_simulation(overrides, cpus_per_client=cpus_per_client, flwr_home=home,
                                     timeout=sizes.sim_timeout, stream=False)
        finally:
            shutil.rmtree(home, ignore_errors=True)
        metrics = {"completed": run.ok, "status": run.status, "wall_s": run.seconds,
                   "peak_rss_tree_bytes": sampler.peak, "peak_processes": sampler.peak_processes,
                   "rss_samples": sampler.samples, "cpus_per_client": cpus_per_client,
                   "concurrent_clients": int((os.cpu_count() or 2) // cpus_per_client),
                   "threads_per_client": max(1, int(cpus_per_client))}
        if run.ok:
            result = run.result()
            metrics.update({"accuracy": result["global"]["accuracy_final"],
                            "uploads": len(result["clients"]),
                            "local_max_s": result["timings"]["local_max"],
                            "local_sum_s": result["timings"]["local_sum"],
                            "server_fuse_s": result["timings"]["server_fuse"]})
        else:
            metrics["log_tail"] = run.log_text[-2000:]
        records.append(save(make_record("sim100", mode, {k: v for k, v in overrides.items()
                                                          if k not in ("output-dir", "run-name")}, metrics)))
    return records


# --- command ---------------------------------------------------------------------------------------

PARTS = ("stratify", "teachers", "server", "ratio", "upload", "sim100", "clients")
DEFAULT_PARTS = PARTS[:-1]  # the client-number table is optional (hours at full size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test of every part")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(DEFAULT_PARTS))
    parser.add_argument("--no-render", action="store_true", help="do not rewrite benchmarks/results/scale.md")
    args = parser.parse_args(argv)
    from oneshot_fl.logs import setup_logging

    setup_logging()
    log.setLevel(logging.INFO)
    # one intra-op thread: the machine is shared, and every ratio compares like with like
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    mode = "quick" if args.quick else "full"
    sizes = SIZES[mode]
    for part in args.parts:
        start = time.perf_counter()
        globals()[f"part_{part}"](sizes, mode)
        log.info("part %s done in %.0fs", part, time.perf_counter() - start)
    if not args.no_render:
        print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
