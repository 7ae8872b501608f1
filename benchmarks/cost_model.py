"""Per-stage cost model of the CIFAR-10 `paper` preset: measured step times, counted FLOPs, the whole preset's time.

  python -m benchmarks.cost_model                         # whatever device this machine has; both fleets
  python -m benchmarks.cost_model --fleets hetero --json-out DIR/cost_model.json    # on a GPU machine

Each stage is timed through the code a run executes (client SGD through `train_local`, a generator step through
`GeneratorSynthesizer.synthesize`, a KD step through `distill`, Model Stratification through the function FedHydra
calls on this device, evaluation through `evaluate`), on the fast path this device gets (oneshot_fl/fastpath.py:
bf16, device-held data and channels-last on a GPU; float32 on a CPU). Stages of the preset, with its sizes
(oneshot_fl/presets.py, `paper`; NIID-Bench shards average 50,000 / m images, whatever their split):
  local[arch]   one client SGD step at batch 128 with crop-flip; 200 epochs x ceil(shard / 128) steps per client
  generator     one generator step at batch 256 (generator, every teacher with BN hooks, the student, the three
                losses, backward to the generator, Adam); 200 epochs x 30 steps per method
  kd            one student KD step at batch 256 from the pool; 200 epochs x 200 steps per method
  ms            FedHydra's Model Stratification: every (client, class) generator at batch 16 (the robust
                recipe's), 30 steps, without early stops (an upper bound); once
  evaluation    the student on the 10,000 test images; every epoch (eval-every 1), per method
  teachers      the clients on the 10,000 test images, once per method (the teacher accuracies)
  checkpoint    the distillation checkpoint (student, optimizer, generator, the pool of 200 batches); every
                eval-every epochs but the last, per method
Left out: each client's one test-set evaluation (under 0.2 % of its training FLOPs), FedHydra's peer check
(m x m x c x 16 images through one forward each), start-up and data loading (the GPU script measures those).

On a GPU every stage runs at the preset's sizes, and the whole preset's time is steps x measured seconds per step.
On a CPU the steps run at reduced batches (the record names them) and the time of the preset is extrapolated
with the FLOP rate each stage reached there (FLOPs counted by torch.utils.flop_counter; they grow linearly with
the batch). Either way an H100's time is estimated from the preset's FLOPs: its bf16 dense peak (989.4 TFLOP/s,
NVIDIA's H100 SXM datasheet) times an assumed utilisation (`--utilisation`, default 0.16: the 160 TFLOP/s the issue's
first-principles estimate assumes); the record also says what utilisation the 10-minute goal needs and, as a
measured reference, the float32 rate this code's training step reached on a lent H100
(results/memory_format.json). The bottleneck is the stage with the most FLOPs (on a GPU: the most measured time).

Records: benchmarks/results/cost_model.json (one entry per run, appended; `--json-out` writes the entry to a file
instead, e.g. on a lent machine) and the report cost_model.md (every entry).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from benchmarks.records import RESULTS_DIR, append_to_json_list, code_version, machine

BENCH_DIR = Path(__file__).resolve().parent
RECORDS = RESULTS_DIR / "cost_model.json"
REPORT = RESULTS_DIR / "cost_model.md"
H100_BF16_PEAK = 989.4e12  # FLOP/s, dense, H100 SXM (NVIDIA datasheet)
GOAL_S = 600.0  # the whole paper preset, clients and both methods, on one H100
TRAIN_SIZE, TEST_SIZE, CLASSES = 50_000, 10_000, 10
METHODS = ("dense", "fedhydra")


def fleets() -> dict[str, tuple[list[str], str]]:
    """name -> (client architectures by partition id, server architecture)."""
    conf = tomllib.loads((BENCH_DIR / "conf" / "cifar10-hetero-paper.toml").read_text())
    return {"hetero": (conf["client-models"].split(","), conf["server-model"]),  # FedHydra Table 3's fleet
            "resnet18x5": (["resnet18"] * 5, "resnet18")}  # the estimate; one vmapped teacher group


@dataclass(frozen=True)
class Sizes:
    """Batch sizes a stage runs at (the preset's, or the reduced ones of a CPU)."""

    local_batch: int
    synth_batch: int
    ms_batch: int
    eval_images: int
    eval_batch: int
    pool_batches: int  # the checkpoint's pool, in synthetic batches


def paper_sizes() -> Sizes:
    from oneshot_fl.config import EvalConfig
    from oneshot_fl.presets import PRESETS
    from strategies.fedhydra import RECIPES

    p = PRESETS["paper"]
    return Sizes(p["local.batch-size"], p["distill.synth-batch"], RECIPES["robust"].ms_batch, TEST_SIZE,
                 EvalConfig().batch_size, p["distill.pool-max-batches"])


CPU_SIZES = Sizes(local_batch=4, synth_batch=4, ms_batch=2, eval_images=32, eval_batch=16, pool_batches=200)


@dataclass(frozen=True)
class Preset:
    """The counts of the paper preset that multiply the step costs."""

    local_epochs: int
    distill_epochs: int
    generator_steps: int
    kd_steps: int
    eval_every: int
    ms_steps: int
    nz: int
    ngf: int


def paper_preset() -> Preset:
    from oneshot_fl.presets import PRESETS

    p = PRESETS["paper"]
    return Preset(p["local.epochs"], p["distill.epochs"], p["distill.generator-steps"], p["distill.kd-steps"],
                  p["distill.eval-every"], p["fedhydra.ms-steps"], p["distill.nz"], p["distill.ngf"])


# --- measuring one stage ------------------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(run: Callable[[int], None], steps: int, device: torch.device) -> tuple[float, float]:
    """(seconds per step, FLOPs per step) of `run(k)`, which does k steps: one warm-up step, one timed call of
    `steps` steps, one counted call of one step."""
    from torch.utils.flop_counter import FlopCounterMode

    run(1)
    _sync(device)
    start = time.perf_counter()
    run(steps)
    _sync(device)
    seconds = (time.perf_counter() - start) / steps
    counter = FlopCounterMode(display=False)
    with counter:
        run(1)
    return seconds, float(counter.get_total_flops())


def random_split(n: int, seed: int):
    from oneshot_fl.data.datasets import Split

    rng = np.random.default_rng(seed)
    return Split(rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8), rng.integers(0, CLASSES, n))


def local_stage(arch: str, batch: int, steps: int, device, fast) -> tuple[float, float]:
    """One client SGD step (crop-flip on), through train_local: `k` steps = one epoch of k x batch images."""
    from oneshot_fl.config import LocalConfig
    from oneshot_fl.local.train import train_local
    from oneshot_fl.models.registry import build

    model = build(arch, (3, 32, 32), CLASSES, seed=0)
    cfg = LocalConfig(epochs=1, batch_size=batch, augment="crop-flip")
    data = random_split(steps * batch, 0)

    def run(k: int) -> None:
        train_local(model, data.subset(np.arange(k * batch)), cfg, device, torch.Generator().manual_seed(0),
                    label=f"cost-model {arch}", fast=fast)

    return measure(run, steps, device)


def _teacher_bank(archs: list[str], device, fast, vectorize: str | bool = "auto"):
    from oneshot_fl.engine.teachers import ClientEnsemble
    from oneshot_fl.models.registry import build

    models = [fast.prepare(build(a, (3, 32, 32), CLASSES, seed=i).to(device)) for i, a in enumerate(archs)]
    return ClientEnsemble(models, archs, vectorize=vectorize)


def generator_stage(archs: list[str], server: str, batch: int, preset: Preset, steps: int, device,
                    fast, vectorize: str | bool = "auto") -> tuple[float, float]:
    """One generator step through GeneratorSynthesizer (DENSE's mean teacher; FedHydra's SA einsum costs the same
    order of nothing)."""
    from oneshot_fl.engine.synthesizer import GeneratorLoss, GeneratorSynthesizer
    from oneshot_fl.engine.teachers import MeanLogits, Teacher
    from oneshot_fl.models.generator import GeneratorSpec
    from oneshot_fl.models.registry import build

    bank = _teacher_bank(archs, device, fast, vectorize)
    student = fast.prepare(build(server, (3, 32, 32), CLASSES, seed=99).to(device))
    spec = GeneratorSpec(preset.nz, preset.ngf, 32, 3)
    synthesizer = GeneratorSynthesizer(Teacher(bank, MeanLogits()), student, spec, GeneratorLoss(), CLASSES, batch,
                                       1, 1e-3, 0, device, fast=fast)

    def run(k: int) -> None:
        synthesizer.steps = k
        synthesizer.synthesize()

    try:
        return measure(run, steps, device)
    finally:
        bank.close()


class _FixedBatch:
    """A synthesizer stand-in for the KD stage: the same batch every epoch."""

    def __init__(self, batch: int, device):
        g = torch.Generator().manual_seed(0)
        self.images = torch.rand(batch, 3, 32, 32, generator=g).to(device)
        self.logits = torch.randn(batch, CLASSES, generator=g).to(device)

    def synthesize(self):
        from oneshot_fl.engine.synthesizer import SynthBatch

        return SynthBatch(self.images, self.logits.argmax(1), self.logits, {"ce": 0.0, "bn": 0.0, "adv": 0.0})


def kd_stage(server: str, batch: int, steps: int, device, fast) -> tuple[float, float]:
    """One KD step (KL + FedHydra's hard-label CE) through `distill`: k steps = one epoch of a capped pool."""
    from oneshot_fl.engine.distill import DistillSettings, distill
    from oneshot_fl.engine.pool import SyntheticPool
    from oneshot_fl.models.registry import build

    student = fast.prepare(build(server, (3, 32, 32), CLASSES, seed=1).to(device))
    source = _FixedBatch(batch, device)

    def run(k: int) -> None:
        pool = SyntheticPool("capped", 4, k, batch, device=device if fast.device_data else "cpu")
        distill(student, source, pool, DistillSettings(epochs=1, lr=0.01, beta=1.0), lambda m: 0.0, seed=0,
                fast=fast)

    return measure(run, steps, device)


def ms_stage(archs: list[str], batch: int, preset: Preset, steps: int, device) -> tuple[float, float, str]:
    """(seconds, FLOPs, how) of the whole MS per step t: on a GPU one vmapped step of every (client, class) pair
    (FedHydra's `stratify`), on a CPU the per-pair loop's steps summed over the m x c pairs."""
    from oneshot_fl.engine.stratify import stratify, stratify_sequential
    from oneshot_fl.models.generator import GeneratorSpec
    from oneshot_fl.models.registry import build

    spec = GeneratorSpec(preset.nz, preset.ngf, 32, 3)
    models = [build(a, (3, 32, 32), CLASSES, seed=i).to(device).eval() for i, a in enumerate(archs)]
    for model in models:
        for p in model.parameters():
            p.requires_grad_(False)
    if device.type == "cuda":  # timed over the preset's T_G: its one-off set-up counts as in a run
        def run(k: int) -> None:
            stratify(models, CLASSES, spec, k, batch, 1e-3, 0, device)

        seconds, flops = measure(run, preset.ms_steps, device)
        return seconds, flops, "one vmapped step of every pair"
    seconds = flops = 0.0
    for model in models:  # one pair per client; every class's pair costs the same
        def run(k: int, model=model) -> None:
            stratify_sequential([model], 1, spec, k, batch, 1e-3, 0, device)

        s, f = measure(run, steps, device)
        seconds, flops = seconds + CLASSES * s, flops + CLASSES * f
    return seconds, flops, "the per-pair loop, one step of every pair"


def evaluation_stage(server: str, images: int, batch: int, device, fast) -> tuple[float, float]:
    """The student on `images` test images (per image: the stage scales it to the test set)."""
    from oneshot_fl.evaluation import evaluate
    from oneshot_fl.fastpath import HeldImages
    from oneshot_fl.models.registry import build

    model = fast.prepare(build(server, (3, 32, 32), CLASSES, seed=2).to(device))
    test = random_split(images, 7)
    held = HeldImages(test.images, device) if fast.device_data else None

    def run(k: int) -> None:
        for _ in range(k):
            evaluate(model, test, CLASSES, device, batch, held)

    seconds, flops = measure(run, 1, device)
    return seconds / images, flops / images


def teachers_stage(archs: list[str], images: int, batch: int, device, fast) -> tuple[float, float]:
    """The clients' logits on `images` test images (per image)."""
    from oneshot_fl.data.datasets import to_tensor

    bank = _teacher_bank(archs, device, fast)
    x = to_tensor(random_split(images, 8).images).to(device)

    def run(k: int) -> None:
        for _ in range(k):
            for first in range(0, images, batch):
                bank.logits(x[first:first + batch])

    try:
        seconds, flops = measure(run, 1, device)
    finally:
        bank.close()
    return seconds / images, flops / images


def checkpoint_stage(server: str, sizes: Sizes, preset: Preset) -> float:
    """Seconds of one distillation checkpoint of the preset's size, written to a temporary folder (FLOP-free:
    a copy to the host and a file write, whatever the device)."""
    from oneshot_fl.engine.distill import Checkpoint
    from oneshot_fl.models.generator import GeneratorSpec
    from oneshot_fl.models.registry import build

    student = build(server, (3, 32, 32), CLASSES)
    generator = GeneratorSpec(preset.nz, preset.ngf, 32, 3).build()
    batch = paper_sizes().synth_batch
    n = sizes.pool_batches  # distinct tensors: torch.save writes a tensor listed twice once
    pool = {"images": [torch.rand(batch, 3, 32, 32).half() for _ in range(n)],
            "labels": [torch.zeros(batch, dtype=torch.long) for _ in range(n)],
            "logits": [torch.randn(batch, CLASSES) for _ in range(n)]}
    state = {"epoch": 1, "student": student.state_dict(), "optimizer": {}, "synthesizer":
             {"generator": generator.state_dict()}, "pool": pool, "rng": torch.Generator().get_state(),
             "history": [], "early_stop": None}
    with tempfile.TemporaryDirectory() as folder:
        checkpoint = Checkpoint(Path(folder) / "distill.pt", "cost-model")
        start = time.perf_counter()
        checkpoint.save(state)
        return time.perf_counter() - start


# --- the model --------------------------------------------------------------------------------------------------

@dataclass
class Stage:
    name: str
    step: str  # what one step is, at the preset's sizes
    measured_batch: int | None  # the batch it was timed at (None: a per-image or FLOP-free stage)
    paper_batch: int | None
    seconds: float  # measured seconds per step (per image for the per-image stages)
    flops: float  # counted FLOPs per step at the measured size
    steps: dict[str, float]  # steps of the whole preset: {"clients"|"dense"|"fedhydra": count}

    @property
    def scale(self) -> float:
        """Preset FLOPs per step over measured FLOPs per step (FLOPs grow linearly with the batch)."""
        return 1.0 if not self.measured_batch else self.paper_batch / self.measured_batch

    @property
    def paper_flops(self) -> float:
        return self.flops * self.scale

    def here_seconds(self) -> float:
        """Seconds of one preset-size step on this device: measured, or extrapolated at the measured FLOP rate."""
        return self.seconds * self.scale

    def totals(self, per_step: float) -> dict[str, float]:
        return {part: count * per_step for part, count in self.steps.items()}


def summarise(stages: list[Stage], utilisation: float, measured_at_paper_size: bool, fast_on: bool) -> dict:
    """Per part (clients, dense, fedhydra) and in all: FLOPs, this device's seconds, an H100's seconds; the
    bottleneck; the goal's distance. The checkpoint stage has no FLOPs: the float32 path writes one every
    evaluation epoch but the last, the fast path (an H100's) at most once a minute of the method's time; its
    H100 seconds per checkpoint are taken as measured here (a copy to the host and a file write)."""
    from strategies.datafree import FAST_CHECKPOINT_INTERVAL_S

    rate = H100_BF16_PEAK * utilisation
    rows = []
    for stage in stages:
        if stage.name == "checkpoint":
            continue
        flops = stage.totals(stage.paper_flops)
        rows.append({**asdict(stage), "paper_flops_per_step": stage.paper_flops, "flops": flops,
                     "here_s": stage.totals(stage.here_seconds()), "h100_s": {p: f / rate for p, f in flops.items()}})
    for stage in stages:
        if stage.name != "checkpoint":
            continue
        per = stage.here_seconds()
        here_counts = dict(stage.steps)
        h100_counts = {m: math.ceil(sum(r["h100_s"].get(m, 0.0) for r in rows) / FAST_CHECKPOINT_INTERVAL_S)
                       for m in stage.steps}
        if fast_on:
            here_counts = {m: math.ceil(sum(r["here_s"].get(m, 0.0) for r in rows) / FAST_CHECKPOINT_INTERVAL_S)
                           for m in stage.steps}
        rows.append({**asdict(stage), "steps": here_counts, "h100_steps": h100_counts, "paper_flops_per_step": 0.0,
                     "flops": {m: 0.0 for m in stage.steps}, "here_s": {m: n * per for m, n in here_counts.items()},
                     "h100_s": {m: n * per for m, n in h100_counts.items()}})
    parts = {part: {key: sum(r[key].get(part, 0.0) for r in rows) for key in ("flops", "here_s", "h100_s")}
             for part in ("clients", *METHODS)}
    total = {key: sum(p[key] for p in parts.values()) for key in ("flops", "here_s", "h100_s")}
    by = "here_s" if measured_at_paper_size else "flops"
    bottleneck = max(rows, key=lambda r: sum(r[by].values()))
    share = sum(bottleneck[by].values()) / total[by] if total[by] else 0.0
    needed = total["flops"] / (GOAL_S * H100_BF16_PEAK)
    return {"stages": rows, "parts": parts, "total": total,
            "bottleneck": {"stage": bottleneck["name"], "share": share, "by": by},
            "goal": {"seconds": GOAL_S, "h100_estimate_s": total["h100_s"], "ratio": total["h100_s"] / GOAL_S,
                     "utilisation_needed": needed,
                     "here_s": total["here_s"] if measured_at_paper_size else None}}


def stage_counts(archs: list[str], preset: Preset, sizes: Sizes) -> dict[str, dict[str, float]]:
    shard = TRAIN_SIZE / len(archs)
    return {
        "local": {"clients": preset.local_epochs * math.ceil(shard / sizes.local_batch)},
        "generator": {m: preset.distill_epochs * preset.generator_steps for m in METHODS},
        "kd": {m: preset.distill_epochs * preset.kd_steps for m in METHODS},
        "ms": {"fedhydra": preset.ms_steps},
        "evaluation": {m: TEST_SIZE * math.ceil(preset.distill_epochs / preset.eval_every) for m in METHODS},
        "teachers": {m: TEST_SIZE for m in METHODS},
        "checkpoint": {m: max(0, math.ceil(preset.distill_epochs / preset.eval_every) - 1) for m in METHODS},
    }


def measure_fleet(archs: list[str], server: str, device: torch.device, sizes: Sizes, steps: int,
                  fast) -> list[Stage]:
    preset, paper = paper_preset(), paper_sizes()
    counts = stage_counts(archs, preset, paper)
    stages = []
    for arch in dict.fromkeys(archs):
        seconds, flops = local_stage(arch, sizes.local_batch, steps, device, fast)
        clients = archs.count(arch)
        stages.append(Stage(f"local[{arch}]", f"{clients} client(s): SGD step at batch {paper.local_batch}",
                            sizes.local_batch, paper.local_batch, seconds, flops,
                            {"clients": clients * counts["local"]["clients"]}))
    seconds, flops = generator_stage(archs, server, sizes.synth_batch, preset, steps, device, fast)
    stages.append(Stage("generator", f"generator step at batch {paper.synth_batch}", sizes.synth_batch,
                        paper.synth_batch, seconds, flops, counts["generator"]))
    seconds, flops = kd_stage(server, sizes.synth_batch, steps, device, fast)
    stages.append(Stage("kd", f"KD step at batch {paper.synth_batch}", sizes.synth_batch, paper.synth_batch,
                        seconds, flops, counts["kd"]))
    seconds, flops, how = ms_stage(archs, sizes.ms_batch, preset, steps, device)
    stages.append(Stage("ms", f"MS step t: {how}, batch {paper.ms_batch}", sizes.ms_batch, paper.ms_batch,
                        seconds, flops, counts["ms"]))
    seconds, flops = evaluation_stage(server, sizes.eval_images, sizes.eval_batch, device, fast)
    stages.append(Stage("evaluation", f"the student on one test image (batch {paper.eval_batch})", None, None,
                        seconds, flops, counts["evaluation"]))
    seconds, flops = teachers_stage(archs, sizes.eval_images, sizes.eval_batch, device, fast)
    stages.append(Stage("teachers", "the clients on one test image", None, None, seconds, flops, counts["teachers"]))
    stages.append(Stage("checkpoint", f"one checkpoint with a pool of {sizes.pool_batches} batches (float32 path: "
                        "every evaluation epoch; fast path: once a minute)", None, None,
                        checkpoint_stage(server, sizes, preset), 0.0, counts["checkpoint"]))
    return stages


def variants(archs: list[str], server: str, device: torch.device, steps: int) -> list[dict]:
    """On a GPU: the fast path against float32 (NCHW, host data) for the client step of each architecture, the
    generator step and the KD step, and bf16 alone (NCHW); for a fleet with same-architecture teachers, the
    generator step with the vmapped teachers against the loop."""
    from oneshot_fl.fastpath import FLOAT32, FastPath

    paper, preset = paper_sizes(), paper_preset()
    fast, bf16 = FastPath(True, True, True), FastPath(bf16=True, device_data=True)
    rows = []
    for arch in dict.fromkeys(archs):
        row = {"stage": f"local[{arch}]"}
        for name, path in (("fast", fast), ("bf16_nchw", bf16), ("float32", FLOAT32)):
            row[name] = local_stage(arch, paper.local_batch, steps, device, path)[0]
        rows.append(row)
    row = {"stage": "generator"}
    for name, path in (("fast", fast), ("bf16_nchw", bf16), ("float32", FLOAT32)):
        row[name] = generator_stage(archs, server, paper.synth_batch, preset, steps, device, path)[0]
    rows.append(row)
    row = {"stage": "kd"}
    for name, path in (("fast", fast), ("bf16_nchw", bf16), ("float32", FLOAT32)):
        row[name] = kd_stage(server, paper.synth_batch, steps, device, path)[0]
    rows.append(row)
    if len(set(archs)) < len(archs):
        row = {"stage": "generator: teachers vmapped / loop"}
        for name, path in (("fast", fast), ("float32", FLOAT32)):
            for how, vectorize in (("vmapped", True), ("loop", False)):
                row[f"{name}_{how}"] = generator_stage(archs, server, paper.synth_batch, preset, steps, device, path,
                                                       vectorize=vectorize)[0]
        rows.append(row)
    return rows


def h100_float32_reference() -> list[dict]:
    """The float32 training step of the CIFAR-10 architectures on a lent H100 (results/memory_format.json, batch
    256, the faster layout) as TFLOP/s, with this machine's FLOP count of that step."""
    from torch.utils.flop_counter import FlopCounterMode

    import torch.nn.functional as F

    from oneshot_fl.models.registry import build

    path = RESULTS_DIR / "memory_format.json"
    if not path.is_file():
        return []
    out = []
    for entry in json.loads(path.read_text()):
        if "H100" not in str((entry.get("machine") or {}).get("gpu")):
            continue
        for row in entry["rows"]:
            if row["input"] != [3, 32, 32] or row["arch"] not in ("resnet18", "googlenet"):
                continue
            with torch.device("meta"):
                model = build(row["arch"], (3, 32, 32), CLASSES)
                x, y = torch.empty(row["batch"], 3, 32, 32), torch.zeros(row["batch"], dtype=torch.long)
            counter = FlopCounterMode(display=False)
            with counter:
                F.cross_entropy(model(x), y).backward()
            ms = min(row["train"]["nchw_ms"], row["train"]["channels_last_ms"])
            out.append({"arch": row["arch"], "batch": row["batch"], "ms": ms, "code": entry["code_version"],
                        "tflops": counter.get_total_flops() / (ms / 1e3) / 1e12})
    return out


def run(fleet_specs: dict[str, tuple[list[str], str]], device: torch.device, steps: int, utilisation: float,
        with_variants: bool) -> dict:
    """One record: every fleet {name: (client architectures, server architecture)} measured on `device`."""
    from oneshot_fl.config import GPUConfig
    from oneshot_fl.fastpath import FastPath

    at_paper_size = device.type == "cuda"
    sizes = paper_sizes() if at_paper_size else CPU_SIZES
    fast = FastPath.for_device(device, GPUConfig())
    entry = {"code_version": code_version(), "date": datetime.now().isoformat(timespec="seconds"),
             "machine": machine(), "device": torch.cuda.get_device_name(device) if at_paper_size else "cpu",
             "torch": torch.__version__, "argv": sys.argv[1:], "fast_path": fast.as_dict(),
             "at_paper_size": at_paper_size, "sizes": asdict(sizes), "paper_sizes": asdict(paper_sizes()),
             "preset": asdict(paper_preset()), "utilisation": utilisation, "h100_bf16_peak": H100_BF16_PEAK,
             "h100_float32_reference": h100_float32_reference(), "fleets": {}}
    for fleet, (archs, server) in fleet_specs.items():
        start = time.perf_counter()
        stages = measure_fleet(archs, server, device, sizes, steps, fast)
        entry["fleets"][fleet] = {"archs": archs, "server": server,
                                  **summarise(stages, utilisation, at_paper_size, fast.on),
                                  "measure_s": time.perf_counter() - start}
        if with_variants:
            entry["fleets"][fleet]["variants"] = variants(archs, server, device, steps)
    return entry


# --- the report ---------------------------------------------------------------------------------------------------

def _s(seconds: float) -> str:
    return f"{seconds:,.0f} s" if seconds >= 10 else f"{seconds:.2g} s"


def render(entries: list[dict]) -> str:
    lines = ["# cost_model", "", "The CIFAR-10 `paper` preset stage by stage (`python -m benchmarks.cost_model`; "
             "what each stage is and how it is measured: the module's docstring). Parts: the clients (trained once), "
             "DENSE and FedHydra (each replayed on the clients' uploads). Goal: the whole preset, both methods, "
             f"under {GOAL_S / 60:.0f} minutes on one H100.", ""]
    for entry in entries:
        machine_line = json.dumps(entry["machine"], sort_keys=True)
        sizes = entry["sizes"]
        where = ("at the preset's sizes" if entry["at_paper_size"] else
                 f"at reduced sizes (client batch {sizes['local_batch']}, synthetic batch {sizes['synth_batch']}, "
                 f"MS batch {sizes['ms_batch']}, {sizes['eval_images']} test images), extrapolated to the preset's "
                 "at the FLOP rate each stage reached here")
        lines += [f"## {entry['code_version']}, {entry['date'][:10]}, {entry['device']}", "",
                  f"Machine: {machine_line}; torch {entry['torch']}; fast path {entry['fast_path']}; arguments: "
                  f"`{' '.join(entry['argv']) or '(none)'}`. Measured {where}. H100 column: the preset's FLOPs at "
                  f"{100 * entry['utilisation']:.0f} % of the {entry['h100_bf16_peak'] / 1e12:.1f} TFLOP/s bf16 "
                  "dense peak (assumed; the checkpoint row is a copy and a write, taken as measured here, once "
                  "a minute of the method's H100 time as the fast path writes them).", ""]
        for ref in entry.get("h100_float32_reference", []):
            lines.append(f"- Measured reference: the float32 training step of {ref['arch']} at batch {ref['batch']} "
                         f"took {ref['ms']} ms on a lent H100 (results/memory_format.json, code {ref['code']}): "
                         f"{ref['tflops']:.1f} TFLOP/s, {100 * ref['tflops'] * 1e12 / entry['h100_bf16_peak']:.1f} "
                         "% of the bf16 peak.")
        if entry.get("h100_float32_reference"):
            lines.append("")
        for fleet, data in entry["fleets"].items():
            lines += [f"### {fleet}: clients {', '.join(data['archs'])}; server {data['server']}", "",
                      "| stage | step at the preset's size | GFLOP / step | steps: clients / DENSE / FedHydra | "
                      "measured s / step (batch) | this device, whole preset: clients / DENSE / FedHydra | "
                      "H100 estimate: clients / DENSE / FedHydra |", "|---|---|---|---|---|---|---|"]
            for row in data["stages"]:
                counts = " / ".join(f"{row['steps'].get(p, 0):,.0f}" for p in ("clients", *METHODS))
                here = " / ".join(_s(row["here_s"].get(p, 0.0)) for p in ("clients", *METHODS))
                h100 = " / ".join(_s(row["h100_s"].get(p, 0.0)) for p in ("clients", *METHODS))
                batch = f" ({row['measured_batch']})" if row["measured_batch"] else ""
                lines.append(f"| {row['name']} | {row['step']} | {row['paper_flops_per_step'] / 1e9:,.3g} | {counts} "
                             f"| {row['seconds']:.3g}{batch} | {here} | {h100} |")
            parts, total, goal = data["parts"], data["total"], data["goal"]
            per_part = "; ".join(f"{p} {parts[p]['flops'] / 1e15:.1f} PFLOP, {_s(parts[p]['here_s'])} here, "
                                 f"{_s(parts[p]['h100_s'])} on the H100" for p in ("clients", *METHODS))
            verdict = ("meets the goal" if goal["ratio"] <= 1 else
                       f"misses the goal by {goal['h100_estimate_s'] - goal['seconds']:,.0f} s ({goal['ratio']:.1f}x)")
            bottleneck = data["bottleneck"]
            how = "measured per step" if entry["at_paper_size"] else "extrapolated"
            lines += ["", f"Per part: {per_part}. In all: {total['flops'] / 1e15:.1f} PFLOP; "
                          f"{_s(total['here_s'])} on this device ({how}); "
                          f"{_s(goal['h100_estimate_s'])} on one H100 at the assumed utilisation, which {verdict}. "
                          f"The {goal['seconds'] / 60:.0f}-minute goal needs {100 * goal['utilisation_needed']:.1f} % "
                          f"of the H100's bf16 peak over the whole preset. Bottleneck: **{bottleneck['stage']}** "
                          f"({100 * bottleneck['share']:.0f} % of the preset's "
                          f"{'measured time' if bottleneck['by'] == 'here_s' else 'FLOPs'}).", ""]
            if data.get("variants"):
                keys = sorted({k for row in data["variants"] for k in row if k != "stage"})
                lines += ["Variants, measured seconds per step at the preset's sizes:", "",
                          "| stage | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
                for row in data["variants"]:
                    lines.append(f"| {row['stage']} | " + " | ".join(
                        f"{row[k] * 1e3:.2f} ms" if k in row else "" for k in keys) + " |")
                lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fleets", nargs="+", choices=list(fleets()), default=list(fleets()))
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per stage (default: 2 on a CPU, 10 on a GPU)")
    parser.add_argument("--utilisation", type=float, default=0.16,
                        help="assumed share of the H100's bf16 peak for the H100 column (default 0.16)")
    parser.add_argument("--variants", action=argparse.BooleanOptionalAction, default=None,
                        help="also time float32 / bf16-NCHW / vmapped-vs-loop variants (default: on a GPU)")
    parser.add_argument("--json-out", type=Path, help="write this run's entry here instead of the records")
    parser.add_argument("--render", action="store_true", help="only rewrite cost_model.md from the records")
    args = parser.parse_args(argv)
    if args.render:
        REPORT.write_text(render(json.loads(RECORDS.read_text())))
        return 0
    from oneshot_fl.devices import pick_device

    device = pick_device() if args.device == "auto" else torch.device(args.device)
    steps = args.steps or (10 if device.type == "cuda" else 2)
    entry = run({name: fleets()[name] for name in args.fleets}, device, steps, args.utilisation,
                device.type == "cuda" if args.variants is None else args.variants)
    if args.json_out:
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(entry, indent=1) + "\n")
        print(render([entry]))
        return 0
    REPORT.write_text(render(append_to_json_list(RECORDS, entry)))
    print(render([entry]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
