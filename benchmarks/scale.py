"""Scale and speed: how the server's time and memory grow with the fleet, and what each speed-up buys, on this machine.

  python -m benchmarks.scale [--quick] [--parts stratify teachers server ratio upload sim100]
                             [--alphas 0.5 0.1]   (Dirichlet alphas of the sim100 part)

Parts (each appends records to benchmarks/results/scale.jsonl and re-renders scale.md):
  stratify  batched Model Stratification vs the sequential reference: speedup, max |U_b - U_s|
  teachers  ClientEnsemble loop vs stacked (vmap) forward per synthetic sample, m = 5/10/20;
            SA = one einsum (op count, time vs the teacher forward); pool logits computed once
  server    server step time and peak memory of FedHydra (MS + teacher/SA work on a fixed synthesis
            budget) and FedAvg for m = 5..100 random-init cnn2 uploads; t(100)/t(5)
  ratio     FedHydra / DENSE server time on the same uploads and budget (real strategies via replay)
  upload    received bytes / raw parameter bytes per client; float16 uploads and their accuracy cost
  sim100    one Ray simulation with 100 clients: completion, wall time, peak RSS of the process tree
`--quick` runs every selected part at tiny sizes (a smoke test of the command, minutes).
Absolute times on a shared 2-core CPU are noisy; the ratios are taken within one process.
Cost on the 2-core development machine: `sim100` 278-288 s per alpha (results/scale.jsonl); the records keep no
total wall time of the other parts (`stratify` alone: 75 s sequential and 122 s batched at the cpu preset's sizes).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
import tracemalloc
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path

import torch

from benchmarks.records import (RESULTS_DIR, append_record, code_version, load_records, machine, overrides_key,
                                repo_relative)

BENCH_DIR = Path(__file__).resolve().parent
TABLE = "scale"
log = logging.getLogger("oneshot_fl.bench")

# The targets each part is compared against.
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
    ratio_ms_steps: int  # fedhydra.ms-steps (T_G of MS) of that comparison
    ratio_preset: str
    upload_preset: str
    upload_clients: int
    sim_clients: int
    sim_alphas: tuple[float, ...]
    sim_preset: str
    sim_timeout: float
    ratio_uploads: str = ""  # an uploads archive for the ratio part instead of the upload part's clients


SIZES = {
    "full": Sizes(ms_clients=5, ms_classes=10, ms_steps=5, ms_batch=64, nz=256, ngf=32,
                  teacher_ms=(5, 10, 20), teacher_batch=256, teacher_repeats=5,
                  server_ms=(5, 10, 20, 50, 100), server_ms_steps=2, server_synth_steps=5,
                  ratio_epochs=4, ratio_ms_steps=10, ratio_preset="cpu", upload_preset="cpu", upload_clients=5,
                  sim_clients=100, sim_alphas=(0.5,), sim_preset="cpu", sim_timeout=1500.0),
    "quick": Sizes(ms_clients=2, ms_classes=3, ms_steps=2, ms_batch=8, nz=32, ngf=8,
                   teacher_ms=(2, 4), teacher_batch=16, teacher_repeats=2,
                   server_ms=(2, 4), server_ms_steps=1, server_synth_steps=1,
                   ratio_epochs=1, ratio_ms_steps=3, ratio_preset="smoke", upload_preset="smoke", upload_clients=2,
                   sim_clients=3, sim_alphas=(0.5,), sim_preset="smoke", sim_timeout=600.0),
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
    """This process's peak resident set: VmHWM, not ru_maxrss, which a spawned child inherits from
    the parent it was forked from (Linux keeps it across fork and exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
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
        from launcher.launch import process_tree

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


# --- shared model fleets -------------------------------------------------------------------------

MNIST_SHAPE = (1, 28, 28)
NUM_CLASSES = 10


def random_fleet(m: int, arch: str = "cnn2", seed: int = 0) -> list:
    """m frozen random-init client models (the timing of MS and teachers does not depend on training)."""
    from oneshot_fl.engine.teachers import freeze
    from oneshot_fl.models.registry import build

    return [freeze(build(arch, MNIST_SHAPE, NUM_CLASSES, seed=seed + k)) for k in range(m)]


# --- part 1: batched Model Stratification ---------------------------------------------------------

def stratify_settings(sizes: Sizes, m: int | None = None, c: int | None = None) -> dict:
    from oneshot_fl.models.generator import GeneratorSpec

    return {"m": m or sizes.ms_clients, "c": c or sizes.ms_classes, "steps": sizes.ms_steps,
            "batch": sizes.ms_batch, "spec": GeneratorSpec(sizes.nz, sizes.ngf, 28, 1), "lr": 1e-3, "seed": 0}


def compare_stratification(settings: dict, models: list | None = None) -> dict:
    """Sequential vs batched MS on the same models, seeds, T_G and batch; timings and |dU|."""
    from oneshot_fl.engine.stratify import stratify, stratify_sequential

    models = models or random_fleet(settings["m"])
    args = (models, settings["c"], settings["spec"], settings["steps"], settings["batch"], settings["lr"],
            settings["seed"], torch.device("cpu"))
    seq = stratify_sequential(*args)
    bat = stratify(*args)
    generator_steps = settings["m"] * settings["c"] * settings["steps"]
    return {"seconds_sequential": seq.seconds, "seconds_batched": bat.seconds,
            "speedup": seq.seconds / bat.seconds,
            "ms_per_generator_step_sequential": 1e3 * seq.seconds / generator_steps,
            "ms_per_generator_step_batched": 1e3 * bat.seconds / generator_steps,
            "max_abs_du": float((seq.u - bat.u).abs().max()),
            "max_abs_du_r": float((seq.u_r - bat.u_r).abs().max()),
            "max_abs_du_c": float((seq.u_c - bat.u_c).abs().max()),
            "max_abs_dloss": float((seq.losses - bat.losses).abs().max())}


def generator_step_cost(settings: dict, batch: int, repeats: int = 3) -> float:
    """Seconds of one generator + client training step at `batch` images: the per-step cost
    the batched call amortises (small batch: overhead; large batch: FLOPs)."""
    import torch.nn.functional as F

    from oneshot_fl.models.generator import reset_generator

    model = random_fleet(1)[0]
    generator = reset_generator(settings["spec"].build(), 0)
    optimizer = torch.optim.Adam(generator.parameters(), lr=settings["lr"])
    noise = torch.randn(batch, settings["spec"].nz)
    target = torch.zeros(batch, dtype=torch.long)

    def step():
        loss = F.cross_entropy(model(generator(noise)), target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    step()  # warm-up
    return best_of(step, repeats)


def overhead_profile(settings: dict) -> dict:
    """Per-sample cost of one generator step at the MS batch and at all m x c pairs' batch: if the
    big batch is not much cheaper per sample, the work is FLOP-bound and batching cannot pay off."""
    small, big = settings["batch"], settings["batch"] * settings["m"] * settings["c"]
    t_small, t_big = generator_step_cost(settings, small), generator_step_cost(settings, big, repeats=2)
    return {"step_s_at_ms_batch": t_small, "step_s_at_all_pairs_batch": t_big,
            "per_sample_us_ms_batch": 1e6 * t_small / small, "per_sample_us_all_pairs": 1e6 * t_big / big,
            "ideal_speedup_from_overhead": (t_small / small) / (t_big / big)}


def part_stratify(sizes: Sizes, mode: str) -> list[dict]:
    settings = stratify_settings(sizes)
    metrics = {**compare_stratification(settings), **overhead_profile(settings),
               "target_speedup": TARGETS["stratify_speedup"], "target_max_du": TARGETS["stratify_max_du"]}
    shown = {k: (v if k != "spec" else vars(v)) for k, v in settings.items()}
    return [save(make_record("stratify", mode, shown, metrics))]


# --- part 2: vectorised teachers -------------------------------------------------------------------

def teacher_times(m: int, batch: int, repeats: int) -> dict:
    """Loop vs stacked ClientEnsemble on m homogeneous cnn2 clients: no-grad logits (what the pool
    caches) and forward + backward to the images (what each generator step pays)."""
    from oneshot_fl.engine.teachers import ClientEnsemble

    models = random_fleet(m)
    x = torch.rand(batch, *MNIST_SHAPE)
    ensembles = {name: ClientEnsemble(models, ["cnn2"] * m, vectorize=vec)
                 for name, vec in (("loop", False), ("stacked", True))}

    def backward(ensemble):
        images = x.clone().requires_grad_(True)
        ensemble(images)[0].sum().backward()

    out = {"m": m, "batch": batch}
    for name, ensemble in ensembles.items():
        ensemble.logits(x), backward(ensemble)  # warm-up
        out[f"forward_s_{name}"] = best_of(lambda ensemble=ensemble: ensemble.logits(x), repeats)
        out[f"fwd_bwd_s_{name}"] = best_of(lambda ensemble=ensemble: backward(ensemble), repeats)
        out[f"us_per_sample_{name}"] = 1e6 * out[f"forward_s_{name}"] / batch
    out["max_abs_dlogits"] = float((ensembles["loop"].logits(x) - ensembles["stacked"].logits(x)).abs().max())
    out["speedup_forward"] = out["forward_s_loop"] / out["forward_s_stacked"]
    out["speedup_fwd_bwd"] = out["fwd_bwd_s_loop"] / out["fwd_bwd_s_stacked"]
    for ensemble in ensembles.values():
        ensemble.close()
    return out


def sa_cost(m: int, batch: int, repeats: int) -> dict:
    """SA's cost beside one teacher forward, and how many einsum (and other aten) ops it issues."""
    from torch.profiler import ProfilerActivity, profile

    from oneshot_fl.engine.teachers import ClientEnsemble, StratifiedAggregation

    ensemble = ClientEnsemble(random_fleet(m), ["cnn2"] * m, vectorize=False)
    x = torch.rand(batch, *MNIST_SHAPE)
    logits = ensemble.logits(x)
    u = torch.rand(NUM_CLASSES, m)
    sa = StratifiedAggregation(u / u.sum(1, keepdim=True), u / u.sum(0, keepdim=True))
    labels = torch.randint(NUM_CLASSES, (batch,))
    t_teacher = best_of(lambda: ensemble.logits(x), repeats)
    t_sa = best_of(lambda: sa(logits, labels), repeats * 20)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sa(logits, labels)
    names = [e.name for e in prof.events() if e.name.startswith("aten::")]
    ensemble.close()
    return {"m": m, "batch": batch, "teacher_forward_s": t_teacher, "sa_s": t_sa, "sa_share": t_sa / t_teacher,
            "sa_einsum_calls": names.count("aten::einsum"), "sa_bmm_calls": names.count("aten::bmm")}


class CountingEnsemble:
    """A ClientEnsemble that counts its forwards (gradient and no-gradient ones)."""

    def __init__(self, ensemble):
        self.ensemble, self.calls = ensemble, 0

    def __call__(self, x):
        self.calls += 1
        return self.ensemble(x)

    def logits(self, x):
        self.calls += 1
        return self.ensemble.logits(x)


def pool_teacher_calls(m: int, epochs: int = 3, steps: int = 2, kd_steps: int = 4) -> dict:
    """Run the real distillation loop with a counting teacher: every teacher forward should come
    from a generator step (the pool keeps those logits), none from the student's KD steps."""
    from oneshot_fl.engine.distill import DistillSettings, distill
    from oneshot_fl.engine.pool import SyntheticPool
    from oneshot_fl.engine.synthesizer import GeneratorLoss, GeneratorSynthesizer
    from oneshot_fl.engine.teachers import ClientEnsemble, MeanLogits, Teacher
    from oneshot_fl.models.generator import GeneratorSpec
    from oneshot_fl.models.registry import build

    ensemble = ClientEnsemble(random_fleet(m), ["cnn2"] * m, vectorize=False)
    counting = CountingEnsemble(ensemble)
    student = build("cnn2", MNIST_SHAPE, NUM_CLASSES, seed=99)
    synth = GeneratorSynthesizer(Teacher(counting, MeanLogits()), student, GeneratorSpec(16, 8, 28, 1),
                                 GeneratorLoss(), NUM_CLASSES, 16, steps, 1e-3, 0, torch.device("cpu"))
    pool = SyntheticPool("capped", 8, kd_steps, 16)
    history, _ = distill(student, synth, pool, DistillSettings(epochs=epochs, lr=0.01, eval_every=epochs),
                         lambda _: 0.0, seed=0)
    ensemble.close()
    kd = sum(h["kd_steps"] for h in history)
    return {"teacher_calls": counting.calls, "generator_steps": epochs * steps, "kd_steps": kd,
            "teacher_calls_per_kd_step": (counting.calls - epochs * steps) / max(1, kd)}


def part_teachers(sizes: Sizes, mode: str) -> list[dict]:
    records = []
    for m in sizes.teacher_ms:
        metrics = {**teacher_times(m, sizes.teacher_batch, sizes.teacher_repeats),
                   "target_speedup": TARGETS["teacher_speedup"]}
        records.append(save(make_record("teachers", mode, {"arch": "cnn2", "batch": sizes.teacher_batch,
                                                           "repeats": sizes.teacher_repeats}, metrics)))
    m = sizes.teacher_ms[-1]
    records.append(save(make_record("sa", mode, {"arch": "cnn2", "batch": sizes.teacher_batch},
                                    sa_cost(m, sizes.teacher_batch, sizes.teacher_repeats))))
    records.append(save(make_record("pool", mode, {"clients": 2, "epochs": 3, "generator_steps": 2},
                                    pool_teacher_calls(2))))
    return records


# --- part 3: server step scaling -------------------------------------------------------------------

def server_budget(sizes: Sizes) -> dict:
    """The fixed server budget of part 3: what FedHydra's server does per upload set, shrunk."""
    return {"ms_steps": sizes.server_ms_steps, "nz": 64, "ngf": 16,
            "synth_steps": sizes.server_synth_steps, "synth_batch": 64, "kd_steps": sizes.server_synth_steps}


def fedhydra_server_step(models: list, budget: dict) -> dict:
    """The default FedHydra's server stages at a fixed budget: MS (the CPU path the strategy takes: sequential,
    the robust recipe's score, early stop and kept images), the peer check and expel (`weigh`), then one
    synthesis epoch of `synth_steps` generator steps through the calibrated, class-routed SA teacher with the
    recipe's BN cap, and `kd_steps` student steps on the cached logits."""
    from oneshot_fl.engine.distill import DistillSettings, distill
    from oneshot_fl.engine.pool import SyntheticPool
    from oneshot_fl.engine.stratify import stratify_sequential
    from oneshot_fl.engine.synthesizer import GeneratorLoss, GeneratorSynthesizer
    from oneshot_fl.engine.teachers import ClientEnsemble, Teacher
    from oneshot_fl.engine.trust import peer_distributions, peer_graph
    from oneshot_fl.models.generator import GeneratorSpec
    from oneshot_fl.models.registry import build
    from strategies.fedhydra import PEER_SAMPLES, RECIPES, stratified_teacher, weigh

    recipe = RECIPES["robust"]
    spec = GeneratorSpec(budget["nz"], budget["ngf"], 28, 1)
    start = time.perf_counter()
    ms = stratify_sequential(models, NUM_CLASSES, spec, budget["ms_steps"], recipe.ms_batch, 1e-3, 0,
                             torch.device("cpu"), score=recipe.score, stop_loss=recipe.stop_loss,
                             keep_samples=PEER_SAMPLES)
    peers = peer_graph(len(models), 0)  # as the strategy: linear in m beyond MAX_PEERS + 1 clients
    weighting = weigh(ms.u, peer_distributions(models, ms.samples, torch.device("cpu"), peers=peers), recipe, peers)
    t_ms = time.perf_counter() - start
    ensemble = ClientEnsemble(models, ["cnn2"] * len(models), bn_cap=recipe.bn_cap)
    student = build("cnn2", MNIST_SHAPE, NUM_CLASSES, seed=99)
    teacher = Teacher(ensemble, stratified_teacher(ensemble, weighting, recipe))
    synth = GeneratorSynthesizer(teacher, student, spec, GeneratorLoss(), NUM_CLASSES, budget["synth_batch"],
                                 budget["synth_steps"], 1e-3, 0, torch.device("cpu"))
    pool = SyntheticPool("capped", 4, budget["kd_steps"], budget["synth_batch"])
    distill(student, synth, pool, DistillSettings(epochs=1, lr=0.01, eval_every=1), lambda _: 0.0, seed=0)
    ensemble.close()
    return {"stratification_s": t_ms, "distillation_s": time.perf_counter() - start - t_ms}


def fedavg_server_step(models: list, budget: dict) -> dict:
    from oneshot_fl.fusion.averaging import average_states

    average_states([m.state_dict() for m in models], [1.0] * len(models))
    return {}


def server_step(method: str, m: int, budget: dict) -> dict:
    """One server step in a fresh process (spawned), so its peak RSS is its own."""
    torch.set_num_threads(1)
    models = random_fleet(m)
    step = {"fedhydra": fedhydra_server_step, "fedavg": fedavg_server_step}[method]
    if method == "fedavg":  # milliseconds: a warm-up call keeps first-call costs out of t(m)
        step(models, budget)
    base_rss = rss_bytes(os.getpid())
    tracemalloc.start()
    start = time.perf_counter()
    phases = step(models, budget)
    seconds = time.perf_counter() - start
    _, traced_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"method": method, "m": m, "server_s": seconds, **phases, "peak_rss_bytes": peak_rss_self(),
            "rss_before_bytes": base_rss, "python_heap_peak_bytes": traced_peak}


def in_fresh_process(fn, *args):
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def part_server(sizes: Sizes, mode: str) -> list[dict]:
    budget = server_budget(sizes)
    records = []
    for method in ("fedavg", "fedhydra"):
        # full: each m in a fresh process so its peak RSS is its own; quick: in this one (seconds, not minutes)
        run = in_fresh_process if mode == "full" else (lambda fn, *args: fn(*args))
        rows = [run(server_step, method, m, budget) for m in sizes.server_ms]
        first, last = rows[0], rows[-1]
        growth = last["server_s"] / first["server_s"]
        allowed = TARGETS["server_growth"] * (last["m"] / first["m"]) / 20
        metrics = {"method": method, "rows": rows, "growth": growth, "m_ratio": last["m"] / first["m"],
                   "fresh_process_per_m": mode == "full",
                   "target_growth": allowed,
                   "memory_growth": last["peak_rss_bytes"] / first["peak_rss_bytes"]}
        records.append(save(make_record("server", mode, budget, metrics)))
    return records


# --- parts 4 and 5: real runs on MNIST, 5 clients (quick: 2) -----------------------------------------------

def run_key(overrides: dict) -> str:
    """Key of a cached simulation: the resolved run config, so a preset retuned since is a new run."""
    from launcher.launch import check_run_config

    flat = check_run_config(overrides).flat
    return overrides_key({k: v for k, v in flat.items() if k not in ("data-dir", "output-dir", "run-name")})


def simulate(name: str, overrides: dict, timeout: float) -> dict:
    """One fedavg simulation (kept in benchmarks/runs/scale/<name>); returns its result.json."""
    from launcher.launch import run_simulation

    out = BENCH_DIR / "runs" / TABLE
    name = f"{name}-{run_key(overrides)}"  # a cached run is reused only for the same settings
    if (out / name / "result.json").is_file() and (out / name / "uploads" / "manifest.json").is_file():
        return json.loads((out / name / "result.json").read_text())
    shutil.rmtree(out / name, ignore_errors=True)
    run = run_simulation({**overrides, "output-dir": str(out), "run-name": name},
                         cpus_per_client=max(1.0, (os.cpu_count() or 2) / 2), timeout=timeout, stream=False)
    if not run.ok:
        raise RuntimeError(f"{name}: {run.status} {run.status_details}\n{run.log_text[-3000:]}")
    return run.result()


def upload_overrides(sizes: Sizes, half: bool) -> dict:
    return {"method": "fedavg", "dataset": "mnist", "num-clients": sizes.upload_clients, "partition": "niid-bench",
            "alpha": 0.5, "seed": 0, "preset": sizes.upload_preset, "upload-half": half}


def fp32_uploads(sizes: Sizes, mode: str) -> tuple[Path, dict]:
    overrides = upload_overrides(sizes, False)
    result = simulate(f"upload-fp32-{mode}", overrides, sizes.sim_timeout)
    return BENCH_DIR / "runs" / TABLE / f"upload-fp32-{mode}-{run_key(overrides)}" / "uploads", result


def part_upload(sizes: Sizes, mode: str) -> list[dict]:
    """Bytes the server received per client over the raw parameter bytes, fp32 and float16
    uploads of the same clients (same seed), and FedAvg's accuracy with each."""
    _, full = fp32_uploads(sizes, mode)
    half = simulate(f"upload-fp16-{mode}", upload_overrides(sizes, True), sizes.sim_timeout)
    fp32_raw = [c["raw_bytes"] for c in full["clients"]]
    metrics = {
        "received_bytes_fp32": [c["received_bytes"] for c in full["clients"]], "raw_bytes_fp32": fp32_raw,
        "ratio_fp32": [c["received_bytes"] / c["raw_bytes"] for c in full["clients"]],
        "received_bytes_fp16": [c["received_bytes"] for c in half["clients"]],
        "ratio_fp16_to_own_raw": [c["received_bytes"] / c["raw_bytes"] for c in half["clients"]],
        "ratio_fp16_to_fp32_raw": [c["received_bytes"] / r for c, r in zip(half["clients"], fp32_raw)],
        "accuracy_fp32": full["global"]["accuracy_final"], "accuracy_fp16": half["global"]["accuracy_final"],
        "client_accuracy_fp32": [c["local_accuracy"] for c in full["clients"]],
        "client_accuracy_fp16": [c["local_accuracy"] for c in half["clients"]],
        "target_ratio": TARGETS["upload_ratio"]}
    metrics["max_ratio_fp32"] = max(metrics["ratio_fp32"])
    metrics["accuracy_cost"] = metrics["accuracy_fp32"] - metrics["accuracy_fp16"]
    return [save(make_record("upload", mode, upload_overrides(sizes, True), metrics))]


def ratio_sets(sizes: Sizes) -> dict:
    """Server-side settings of the FedHydra / DENSE comparison: the preset with fewer distillation
    epochs and MS steps (so both runs fit in minutes); the rest (batches, generator) as the preset."""
    return {"preset": sizes.ratio_preset, "distill.epochs": sizes.ratio_epochs,
            "distill.eval-every": sizes.ratio_epochs, "fedhydra.ms-steps": sizes.ratio_ms_steps}


def part_ratio(sizes: Sizes, mode: str) -> list[dict]:
    """FedHydra and DENSE replayed on the same uploads, in this process, at the same budget."""
    from launcher.launch import run_config_items
    from launcher.replay import replay

    uploads = Path(sizes.ratio_uploads) if sizes.ratio_uploads else fp32_uploads(sizes, mode)[0]
    sets = ratio_sets(sizes)
    args = run_config_items(sets)
    results = {}
    for method in ("dense", "fedhydra"):
        out = BENCH_DIR / "runs" / TABLE / f"ratio-{method}-{mode}"
        shutil.rmtree(out, ignore_errors=True)
        results[method] = replay(uploads, [f"method='{method}'", *args], run_dir=out)
    dense, hydra = results["dense"]["timings"], results["fedhydra"]["timings"]
    ms = hydra.get("stratification", 0.0)
    per_epoch = hydra["distillation"] / sizes.ratio_epochs
    full_epochs, full_ms_steps = _preset_value(sizes.ratio_preset, "distill.epochs"), \
        _preset_value(sizes.ratio_preset, "fedhydra.ms-steps")
    ms_full = ms * full_ms_steps / sizes.ratio_ms_steps  # MS work is linear in its T_G
    metrics = {
        "dense_timings": dense, "fedhydra_timings": hydra,
        "ratio_server_fuse": hydra["server_fuse"] / dense["server_fuse"],
        "ratio_ms_plus_distill": (ms + hydra["distillation"]) / dense["distillation"],
        "ms_s": ms, "ms_share": ms / hydra["server_fuse"],
        "accuracy_dense": results["dense"]["global"]["accuracy_final"],
        "accuracy_fedhydra": results["fedhydra"]["global"]["accuracy_final"],
        # MS is a fixed cost: what the ratio becomes at the preset's full epochs and MS steps
        "preset_epochs": full_epochs, "preset_ms_steps": full_ms_steps,
        "extrapolated_ratio_at_preset_epochs": (ms_full + per_epoch * full_epochs)
        / (dense["distillation"] / sizes.ratio_epochs * full_epochs),
        "target_ratio": TARGETS["hydra_dense_ratio"], "uploads": repo_relative(uploads) or uploads.name}
    return [save(make_record("ratio", mode, sets, metrics))]



def _preset_value(preset: str, key: str) -> int:
    from oneshot_fl.presets import PRESETS

    return int(PRESETS[preset][key])


# --- part 6: 100 simulated clients -----------------------------------------------------------------

def part_sim100(sizes: Sizes, mode: str) -> list[dict]:
    """One Ray simulation per alpha: fedavg, num-clients = sim_clients. Two concurrent actors of
    1 CPU each on this 2-core machine; launch pins torch threads = int(cpus_per_client) = 1."""
    from launcher.launch import find_superlinks, run_simulation

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
            with TreeSampler(lambda home=home: [os.getpid(), *find_superlinks(home)]) as sampler:
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


# --- markdown report -------------------------------------------------------------------------------

def _latest(records: list[dict], mode: str) -> dict[str, list[dict]]:
    """The newest record of `mode` per (part, settings, m, method), grouped by part."""
    newest: dict[tuple, dict] = {}
    for r in records:
        if r.get("mode") == mode:
            newest[(r["part"], json.dumps(r["settings"], sort_keys=True), r.get("m"), r.get("method"))] = r
    out: dict[str, list[dict]] = {}
    for r in newest.values():
        out.setdefault(r["part"], []).append(r)
    return out


def _verdict(ok: bool, miss: str = "") -> str:
    return "met" if ok else f"**missed** ({miss})" if miss else "**missed**"


def _mb(value: float) -> str:
    return f"{value / 2**20:,.0f} MiB"


def render_stratify(rs: list[dict]) -> list[str]:
    r = rs[-1]
    s = r["settings"]
    lines = [f"### 1. Batched Model Stratification (m={s['m']}, c={s['c']}, T_G={s['steps']}, batch {s['batch']}, "
             f"generator nz={s['spec']['nz']} ngf={s['spec']['ngf']}, random-init cnn2 clients, seed {s['seed']})", "",
             "| sequential | batched | speedup | target | max abs dU | max abs dU_r | max abs dloss |", "|---|---|---|---|---|---|---|",
             f"| {r['seconds_sequential']:.1f} s | {r['seconds_batched']:.1f} s | {r['speedup']:.2f}x | "
             f">= {r['target_speedup']:g}x: {_verdict(r['speedup'] >= r['target_speedup'], '{:.0%} of it'.format(r['speedup'] / r['target_speedup']))} | "
             f"{r['max_abs_du']:.1e} ({_verdict(r['max_abs_du'] <= r['target_max_du'])}) | {r['max_abs_du_r']:.1e} | "
             f"{r['max_abs_dloss']:.1e} |", "",
             f"Why: one generator + client training step costs {r['per_sample_us_ms_batch']:.0f} us per image at the MS "
             f"batch ({s['batch']}) and {r['per_sample_us_all_pairs']:.0f} us per image when all m x c pairs' "
             f"{s['m'] * s['c'] * s['batch']} images go through one call, i.e. bigger calls are {r['ideal_speedup_from_overhead']:.2f}x as efficient "
             "per image on this CPU (one thread): the sequential loop is already FLOP-bound, not overhead-bound, so "
             "batching the m x c generators (vmap = grouped convolutions, the same FLOPs in larger, less cache-friendly "
             "calls) cannot reach 5x here; it pays where a call is latency-bound (GPUs), which is why "
             "FedHydra uses it on GPUs only (both stop each pair at the same step). dU_r and the loss curves differ by more than dU "
             "because grouped and plain convolutions round differently; the two paths are checked against each "
             "other in tests/unit/test_stratification.py.", ""]
    return lines


def render_teachers(rs: list[dict], sa: list[dict], pool: list[dict]) -> list[str]:
    lines = ["### 2. Vectorised teachers (homogeneous random-init cnn2 clients)", "",
             "| m | batch | loop us/sample | stacked us/sample | forward speedup | fwd+bwd speedup | max abs dlogits | target (m >= 10) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rs, key=lambda r: r["m"]):
        target = (_verdict(r["speedup_forward"] >= r["target_speedup"], "{:.2f}x of {:g}x".format(r["speedup_forward"], r["target_speedup"]))
                  if r["m"] >= 10 else "-")
        lines.append(f"| {r['m']} | {r['batch']} | {r['us_per_sample_loop']:.0f} | {r['us_per_sample_stacked']:.0f} | "
                     f"{r['speedup_forward']:.2f}x | {r['speedup_fwd_bwd']:.2f}x | {r['max_abs_dlogits']:.1e} | {target} |")
    for r in sa:
        lines += ["", f"SA (m={r['m']}, batch {r['batch']}): {r['sa_einsum_calls']} `aten::einsum` call per "
                  f"aggregation; {1e6 * r['sa_s']:.0f} us vs {1e3 * r['teacher_forward_s']:.1f} ms for the teacher "
                  f"forward ({r['sa_share']:.2%})."]
    for r in pool:
        lines += ["", f"Cached pool: {r['teacher_calls']} teacher forwards for {r['generator_steps']} generator "
                  f"steps and {r['kd_steps']} student KD steps ({r['teacher_calls_per_kd_step']:g} per KD step): "
                  "the pool's logits are the ones computed during synthesis."]
    lines += ["", "Stacked teachers are slower than the loop on this CPU: each cnn2 forward at batch "
              f"{rs[0]['batch']} is already FLOP-bound on one thread, and vmap turns the convolutions into grouped ones "
              "over a larger tensor; `ClientEnsemble(vectorize='auto')` therefore stacks on GPUs only. The 2x target "
              "is a GPU target that this machine cannot show."]
    return lines + [""]


def render_server(rs: list[dict]) -> list[str]:
    s = rs[-1]["settings"]
    ms = [row["m"] for row in rs[-1]["rows"]]
    lines = [f"### 3. Server step vs number of clients (random-init cnn2 uploads; fixed budget: MS T_G={s['ms_steps']} "
             f"batch {s['ms_batch']}, generator nz={s['nz']} ngf={s['ngf']}; {s['synth_steps']} generator steps at "
             f"batch {s['synth_batch']} through the SA teacher, {s['kd_steps']} KD steps; "
             f"{'each m in a fresh process' if rs[-1].get('fresh_process_per_m') else 'all m in one process'}; "
             "target: linear growth, t(max)/t(min) <= 1.2 x m(max)/m(min))", "",
             "| method | " + " | ".join(f"t({m})" for m in ms) + " | t(max)/t(min) | target | peak RSS min..max m |",
             "|---|" + "---|" * (len(ms) + 3)]
    for r in sorted(rs, key=lambda r: r["method"]):
        times = " | ".join(f"{row['server_s']:.3g} s" for row in r["rows"])
        lines.append(f"| {r['method']} | {times} | {r['growth']:.1f} | <= {r['target_growth']:g}: "
                     f"{_verdict(r['growth'] <= r['target_growth'])} | {_mb(r['rows'][0]['peak_rss_bytes'])} .. "
                     f"{_mb(r['rows'][-1]['peak_rss_bytes'])} |")
    hydra = [r for r in rs if r["method"] == "fedhydra"]
    if hydra and "stratification_s" in hydra[-1]["rows"][0]:
        rows = hydra[-1]["rows"]
        lines += ["", "FedHydra's phases per m (MS grows with m x c runs, the teacher with m forwards per step): "
                  + "; ".join(f"m={row['m']}: MS {row['stratification_s']:.1f} s, synthesis + KD "
                              f"{row['distillation_s']:.1f} s, peak RSS {_mb(row['peak_rss_bytes'])}" for row in rows)
                  + ". Peak RSS includes the interpreter and torch (about "
                  f"{_mb(rows[0]['rss_before_bytes'])} before the step)."]
    return lines + [""]


def render_ratio(rs: list[dict]) -> list[str]:
    r = rs[-1]
    d, h = r["dense_timings"], r["fedhydra_timings"]
    uploads = r.get("uploads", "the upload part's fp32 clients")
    return [f"### 4. FedHydra / DENSE server time (same uploads, same process; settings {json.dumps(r['settings'])}; "
            f"uploads {uploads})", "",
            "| | DENSE | FedHydra |", "|---|---|---|",
            f"| stratification | - | {h.get('stratification', 0):.1f} s |",
            f"| distillation | {d['distillation']:.1f} s | {h['distillation']:.1f} s |",
            f"| server fuse | {d['server_fuse']:.1f} s | {h['server_fuse']:.1f} s |",
            f"| accuracy | {r['accuracy_dense']:.4f} | {r['accuracy_fedhydra']:.4f} |", "",
            f"Ratio (server fuse) {r['ratio_server_fuse']:.3f}, (MS + distillation vs distillation) "
            f"{r['ratio_ms_plus_distill']:.3f}; target <= {r['target_ratio']:g}: "
            f"{_verdict(r['ratio_server_fuse'] <= r['target_ratio'], '{:.0%} over'.format(r['ratio_server_fuse'] / r['target_ratio'] - 1))}. "
            f"MS share of FedHydra's server time: {r['ms_share']:.1%}. MS is a fixed cost, linear in its T_G; at the "
            f"preset's {r['preset_epochs']} distillation epochs and T_G = {r.get('preset_ms_steps', 'as run')} the same measurement "
            f"extrapolates to (MS + distillation) / distillation = {r['extrapolated_ratio_at_preset_epochs']:.3f}. "
            "On this CPU MS runs the sequential loop (batched on GPUs only, part 1), "
            "so its m x c x T_G generator steps at the full synthesis batch cost as much as tens of distillation "
            "epochs; the paper's 1.027x is a GPU figure. FedHydra's server fuse also evaluates two teachers "
            "(SA and the plain mean) on the test set, DENSE one.", ""]


def render_upload(rs: list[dict]) -> list[str]:
    r = rs[-1]
    return [f"### 5. Upload bytes (FedAvg, MNIST, {r['settings']['num-clients']} clients, NIID-Bench 0.5, seed 0, "
            f"preset {r['settings']['preset']})", "",
            "| upload | received / raw parameter bytes, per client | FedAvg accuracy |", "|---|---|---|",
            f"| float32 | {', '.join(f'{x:.4f}' for x in r['ratio_fp32'])} (max {r['max_ratio_fp32']:.4f}; target <= "
            f"{r['target_ratio']:g}: {_verdict(r['max_ratio_fp32'] <= r['target_ratio'])}) | {r['accuracy_fp32']:.4f} |",
            f"| float16 (`upload-half=true`) | {', '.join(f'{x:.4f}' for x in r['ratio_fp16_to_fp32_raw'])} of the float32 "
            f"bytes | {r['accuracy_fp16']:.4f} |", "",
            f"Accuracy cost of half-precision uploads: {100 * r['accuracy_cost']:+.2f} points (float32 minus float16, "
            "same clients and seed; the clients train in float32 and only the upload is rounded). Switch: "
            "run config `upload-half = true`.", ""]


def render_sim(rs: list[dict]) -> list[str]:
    lines = ["### 6. Ray simulation of many clients (FedAvg, MNIST, NIID-Bench Dirichlet, one run per alpha)", "",
             "| clients | alpha | preset | completed | wall | peak RSS (process tree) | processes | CPUs/client | concurrent | threads/client | accuracy |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rs:
        s = r["settings"]
        lines.append(f"| {s['num-clients']} | {s['alpha']:g} | {s['preset']} | {r['completed']} | {r['wall_s']:.0f} s | "
                     f"{_mb(r['peak_rss_tree_bytes'])} | {r['peak_processes']} | {r['cpus_per_client']:g} | "
                     f"{r['concurrent_clients']} | {r['threads_per_client']} | {r.get('accuracy', float('nan')):.4f} |")
    lines += ["", "CPU share per client: `--cpus-per-client` of `oneshot-fl run` (Ray `client-resources-num-cpus`; "
              "concurrent clients = cores / share); torch threads per actor: `threads` (0 = int(share), pinned by "
              "the launcher).", ""]
    return lines


def render(mode: str | None = None, out: Path | None = None) -> Path:
    records = load_records(TABLE)
    mode = mode or ("full" if any(r.get("mode") == "full" for r in records) else "quick")
    parts = _latest(records, mode)
    shown = [r for rs in parts.values() for r in rs]
    some = shown[-1] if shown else {"machine": machine(), "code_version": code_version()}
    versions = ", ".join(sorted({r["code_version"] for r in shown})) or some["code_version"]
    lines = ["# Scale and speed (issue 7)", "",
             f"Generated by `python -m benchmarks.scale{' --quick' if mode == 'quick' else ''}` from "
             f"`benchmarks/results/{TABLE}.jsonl` ({mode} sizes). Machine: {some['machine']['cpus']} CPUs "
             f"({some['machine']['processor']}), GPU: {some['machine']['gpu'] or 'none'}, torch threads "
             f"{some['machine']['torch_threads']}, shared with other jobs (absolute times are noisy; ratios are "
             f"taken in one process). Code: {versions}.", ""]
    renderers = [("stratify", lambda p: render_stratify(p["stratify"])),
                 ("teachers", lambda p: render_teachers(p["teachers"], p.get("sa", []), p.get("pool", []))),
                 ("server", lambda p: render_server(p["server"])), ("ratio", lambda p: render_ratio(p["ratio"])),
                 ("upload", lambda p: render_upload(p["upload"])), ("sim100", lambda p: render_sim(p["sim100"]))]
    for part, fn in renderers:
        lines += fn(parts) if part in parts else [f"### {part}: not run", ""]
    out = out or RESULTS_DIR / f"{TABLE}.md"
    out.write_text("\n".join(lines))
    return out


# --- command ---------------------------------------------------------------------------------------

PARTS = ("stratify", "teachers", "server", "ratio", "upload", "sim100")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test of every part")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--alphas", nargs="+", type=float, default=None,
                        help="Dirichlet alphas of the sim100 part (default: the mode's, 0.5)")
    parser.add_argument("--no-render", action="store_true", help="do not rewrite benchmarks/results/scale.md")
    parser.add_argument("--ratio-uploads", default="", help="ratio part: replay this uploads archive "
                        "(e.g. benchmarks/runs/paper_table/fmnist-2cc-s0/uploads) instead of training clients")
    parser.add_argument("--ratio-full", action="store_true",
                        help="ratio part: the preset's own distillation epochs and MS steps (nothing extrapolated)")
    args = parser.parse_args(argv)
    from oneshot_fl.logs import setup_logging

    setup_logging()
    log.setLevel(logging.INFO)
    # one intra-op thread: the machine is shared, and every ratio compares like with like
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    mode = "quick" if args.quick else "full"
    sizes = SIZES[mode]
    if args.alphas:
        sizes = replace(sizes, sim_alphas=tuple(args.alphas))
    if args.ratio_uploads:
        sizes = replace(sizes, ratio_uploads=args.ratio_uploads)
    if args.ratio_full:
        sizes = replace(sizes, ratio_epochs=_preset_value(sizes.ratio_preset, "distill.epochs"),
                        ratio_ms_steps=_preset_value(sizes.ratio_preset, "fedhydra.ms-steps"))
    for part in args.parts:
        start = time.perf_counter()
        globals()[f"part_{part}"](sizes, mode)
        log.info("part %s done in %.0fs", part, time.perf_counter() - start)
    if not args.no_render:
        print(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
