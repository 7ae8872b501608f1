"""The authors' public code on our partitions, at the budget our implementation gets: DENSE and FedMHO side by side.

  python -m benchmarks.reference_runs run dense-ref --repo ../refs/DENSE --python ../refs/venv/bin/python \
      --dataset mnist --seed 0 --local-epochs 5 --epochs 10
  python -m benchmarks.reference_runs run dense --dataset mnist --seed 0 --local-epochs 5 --epochs 10
  python -m benchmarks.reference_runs render

An implementation is ours (`dense`, `fedmho-md`: the Flower simulation, `launcher.launch.run_simulation`) or a
reference (`dense-ref`: zj-jayzhang/DENSE, `fedmho-md-ref`: YXShi2000/FedMHO). A reference run
  1. writes our data in the layout its loaders read (torchvision's raw MNIST / CIFAR-10 files, from the arrays our
     loader reads, so an index means the same image in both) into a scratch folder, never into this checkout;
  2. writes our partition of the cell (`partition_indices`, NIID-Bench Dirichlet, the seed our run derives) as one
     JSON list of index lists, which a patched line of their data code reads in place of their own draw;
  3. copies their checkout's HEAD (`git archive`) into the scratch folder, applies the patches listed in PATCHES
     (each must match exactly one place, or the run stops) and starts their script through a launcher whose shims
     (SHIMS) select the CPU, switch logging services off and pin one torch thread;
  4. parses their printed accuracies and records them (benchmarks/records.py, table `reference_runs`) with their
     commit, every patched line and the budget.
Nothing here changes their algorithm: the patches touch device selection, logging, paths, the partition's source,
the MPI transport (FedMHO) and the budget; `render` writes benchmarks/results/reference_runs.md with the patch list.

Their code needs its own interpreter (--python), a venv outside this checkout with REFERENCE_PACKAGES, e.g.
  python3 -m venv ../refs/venv && ../refs/venv/bin/pip install torch==2.14.1 torchvision==0.29.1 kornia tqdm \
      scikit-learn scikit-image matplotlib lmdb opencv-python-headless msgpack msgpack-numpy six
and a checkout of each repository (git clone), given as --repo; ONESHOT_FL_DATA_DIR names our data.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import pickle
import re
import shlex
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.records import (RESULTS_DIR, append_record, code_version, load_records, machine, overrides_key,
                                record_from_result)

BENCH_DIR = Path(__file__).resolve().parent
# What their imports need beside torch / torchvision (DENSE: kornia, tqdm; FedMHO's FedDF code base: the rest).
REFERENCE_PACKAGES = ("kornia", "tqdm", "scikit-learn", "scikit-image", "matplotlib", "lmdb", "opencv-python-headless",
                      "msgpack", "msgpack-numpy", "six")
TABLE = "reference_runs"
FAILURES = "reference_runs_failed"  # reference runs that exited with an error: what ran and what it died of
REPO_FOLDERS = {"dense-ref": "DENSE", "fedmho-md-ref": "FedMHO"}  # a clone of zj-jayzhang/DENSE, YXShi2000/FedMHO
SCRATCH = Path(os.environ.get("ONESHOT_FL_REF_SCRATCH", "/tmp/oneshot-fl-refs"))
log = logging.getLogger("oneshot_fl.bench")


# --- the cell: our data and our partition, in the reference code's layout ------------------------------------------

def cell_config(dataset: str, seed: int, num_clients: int, model: str, extra: dict | None = None):
    """Our run config of the cell (what `oneshot-fl run` would use), for its partition and data."""
    from oneshot_fl.config import from_run_config, merge_overrides

    return from_run_config(merge_overrides({"dataset": dataset, "partition": "niid-bench", "alpha": 0.5,
                                            "num-clients": num_clients, "seed": seed, "model": model,
                                            **(extra or {})}))


def our_partition(cfg) -> list[list[int]]:
    """Every client's training indices, exactly as client_app.task.load_shard draws them."""
    from oneshot_fl.config import resolve_data_dir
    from oneshot_fl.data.datasets import load_split
    from oneshot_fl.data.partition import partition_indices
    from oneshot_fl.seeding import derive_seed

    train = load_split(cfg.dataset, "train", str(resolve_data_dir(cfg)), cfg.download)
    shards = partition_indices(train.labels, cfg.partition, cfg.num_clients, cfg.alpha, cfg.min_partition_size,
                               derive_seed(cfg.seed, "partition"))
    return [shard.tolist() for shard in shards]


def partition_digest(parts: list[list[int]]) -> str:
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:12]


def write_idx(path: Path, array: np.ndarray) -> None:
    """An IDX file (the MNIST format torchvision reads): magic 0x08 (ubyte) + ndim, big-endian dims, bytes."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    path.write_bytes(struct.pack(">BBBB", 0, 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
                     + array.tobytes())


def export_dataset(dataset: str, data_dir: Path, root: Path) -> Path:
    """Our train/test arrays in torchvision's own layout under `root` (written once): MNIST/raw/*-ubyte,
    cifar-10-batches-py/ (the python pickles, 10,000 images per training batch, in our order)."""
    from oneshot_fl.data.datasets import DATASETS, load_split

    done = root / f".{dataset}.done"
    if done.is_file():
        return root
    train, test = (load_split(dataset, split, str(data_dir), False) for split in ("train", "test"))
    if dataset == "mnist":
        raw = root / "MNIST" / "raw"
        raw.mkdir(parents=True, exist_ok=True)
        for prefix, split in (("train", train), ("t10k", test)):
            write_idx(raw / f"{prefix}-images-idx3-ubyte", split.images[..., 0])
            write_idx(raw / f"{prefix}-labels-idx1-ubyte", split.labels)
    elif dataset == "cifar10":
        folder = root / "cifar-10-batches-py"
        folder.mkdir(parents=True, exist_ok=True)

        def batch(split, name: str) -> None:
            rows = split.images.transpose(0, 3, 1, 2).reshape(len(split), -1)  # CHW rows, as the originals
            with open(folder / name, "wb") as fh:
                pickle.dump({"data": rows, "labels": split.labels.tolist(), "batch_label": name}, fh)

        for k in range(5):
            batch(train.subset(np.arange(10_000 * k, 10_000 * (k + 1))), f"data_batch_{k + 1}")
        batch(test, "test_batch")
        with open(folder / "batches.meta", "wb") as fh:
            pickle.dump({"label_names": list(DATASETS["cifar10"].class_names)}, fh)
    else:
        raise ValueError(f"{dataset}: the reference runs export mnist and cifar10")
    done.write_text("ok\n")
    return root


# --- a reference implementation: its checkout, patches and launcher -------------------------------------------------

@dataclass(frozen=True)
class Patch:
    """One textual change to a file of the reference code: `old` must occur exactly once."""
    file: str
    old: str
    new: str
    why: str


# FedMHO's VGG-9 (pcode/models/vgg.py), full width, and the same layers at 1/4 width (our vgg9-small).
VGG9_FULL = """\
            nn.Conv2d(input_channel, 64, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(64, 128, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(128, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(256 * 7 * 7, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(),
            nn.Linear(4096, self.output_size),
        )

        self.activations = None
"""
_QUARTER_WIDTH = [("(input_channel, 64,", "(input_channel, 16,"), ("(64, 128,", "(16, 32,"),
                  ("(128, 256,", "(32, 64,"), ("(256, 256,", "(64, 64,"), ("256 * 7 * 7, 4096", "64 * 7 * 7, 1024"),
                  ("(4096, 4096)", "(1024, 1024)"), ("(4096, self.output_size)", "(1024, self.output_size)")]
VGG9_QUARTER = VGG9_FULL
for _full, _quarter in _QUARTER_WIDTH:
    VGG9_QUARTER = VGG9_QUARTER.replace(_full, _quarter)

RECOVER_MODELS = ("    _, local_models = agg_utils.recover_models(\n"
                  "        conf, client_models, flatten_local_models\n    )\n")

# The smallest change that lets each reference run here. Every entry is listed in the report.
PATCHES: dict[str, list[Patch]] = {
    "dense-ref": [
        Patch("helpers/datasets.py", "    data_dir = '/dataset'\n",
              "    data_dir = os.environ['REF_DATA_DIR']\n",
              "dataset path: the scratch copy of our data in torchvision's layout (their path is their cluster's)"),
        Patch("helpers/datasets.py",
              "    train_data_cls_counts = record_net_data_stats(y_train, net_dataidx_map)\n",
              "    net_dataidx_map = dict(enumerate(__import__('json').load(open(os.environ['REF_PARTITION']))))\n"
              "    train_data_cls_counts = record_net_data_stats(y_train, net_dataidx_map)\n",
              "partition: our client index lists replace their draw (after it, so their random stream is consumed "
              "as in their run)"),
    ],
    "fedmho-md-ref": [
        Patch("main.py", '        dist.init_process_group("mpi")\n', '        dist.init_process_group("gloo")\n',
              "MPI transport: pip's torch has no MPI backend; gloo carries the same send/recv/broadcast/barrier "
              "between the same master and worker processes (started by torchrun, which sets rank and world size)"),
        Patch("pcode/datasets/partition_data.py",
              "            from_index = to_index\n",
              "            from_index = to_index\n"
              "        if self.partition_type == 'non_iid_dirichlet':\n"
              "            self.partitions = __import__('json').load(open(__import__('os').environ['REF_PARTITION'])"
              ")\n",
              "partition: our client index lists replace the clients' slices of their draw (the draw and its broadcast "
              "still run; the per-class counts the server reads for the CVAE quotas are recorded from ours)"),
        Patch("pcode/models/vgg.py", VGG9_FULL, VGG9_QUARTER,
              "CPU budget: VGG-9 at 1/4 width in every layer (16-32-64-64 channels, FC 1024), the model our CPU runs "
              "train (registry vgg9-small); full width is 2.6 s per batch of 64 on one core here"),
        Patch("pcode/aggregation/semi_supervised.py", '    if conf.data == "mnist":\n        epochs = 20\n',
              '    if conf.data == "mnist":\n        epochs = int(os.environ["REF_FUSION_EPOCHS"])\n',
              "budget: the MNIST fusion epochs (hard-coded 20; the paper's Table III says 10) from the budget, the "
              "value ours runs"),
        Patch("pcode/aggregation/semi_supervised.py", RECOVER_MODELS,
              RECOVER_MODELS
              + "    torch.save({k: m.state_dict() for k, m in local_models.items()}, os.environ['REF_UPLOADS'])\n",
              "measurement only: the uploads the server received are saved, so the harness can test each classifier "
              "client and their ensemble (their code prints neither)"),
    ],
}

LAUNCHER = '''"""oneshot-fl reference-run launcher: shims, then the reference script as __main__ (see SHIMS)."""
import collections.abc
import os
import runpy
import sys
import types

import torch

torch.set_num_threads(int(os.environ.get("REF_THREADS", "1")))
torch.Tensor.cuda = lambda self, *args, **kwargs: self
torch.nn.Module.cuda = lambda self, *args, **kwargs: self
wandb = types.ModuleType("wandb")
wandb.init = wandb.log = lambda *args, **kwargs: None
wandb.plot = types.SimpleNamespace(line_series=lambda *args, **kwargs: None)
sys.modules["wandb"] = wandb
sys.modules.setdefault("ipdb", types.ModuleType("ipdb"))
six = types.ModuleType("torch._six")
six.container_abcs = collections.abc
sys.modules["torch._six"] = six
import torchvision.datasets as tvd  # noqa: E402

tvd.CIFAR10.train_list = [[name, None] for name, _ in tvd.CIFAR10.train_list]
tvd.CIFAR10.test_list = [[name, None] for name, _ in tvd.CIFAR10.test_list]
tvd.CIFAR10.meta = {**tvd.CIFAR10.meta, "md5": None}
script = os.path.abspath(sys.argv[1])
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(script))
runpy.run_path(script, run_name="__main__")
'''

# What the launcher does before their script runs, and why (listed in the report beside the patches).
SHIMS = [
    ("torch.set_num_threads(1)", "one torch thread: the shared 2-core machine's budget for one long run"),
    ("torch.Tensor.cuda / torch.nn.Module.cuda return the object unchanged",
     "device selection: their code calls .cuda() on every model and batch; this machine has no GPU"),
    ("a `wandb` module whose init/log/plot do nothing", "logging service off (DENSE logs to wandb.ai)"),
    ("an empty `ipdb` module", "DENSE's synthesizer imports the debugger and never calls it"),
    ("a `torch._six` module holding `container_abcs` (= collections.abc)",
     "DENSE's unused ViT module imports it from torch 1.x, which torch 2 removed; the ViT is not run"),
    ("torchvision's CIFAR10 file list without md5 sums",
     "the CIFAR-10 batches are written from our copy of the images, so the original archive's md5 sums differ"),
]


def reference_commit(repo: Path) -> str:
    return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def reference_name(repo: Path) -> str:
    """owner/name of the checkout's origin where it says (a clone of a mirror names the mirror's folder)."""
    url = subprocess.run(["git", "-C", str(repo), "remote", "get-url", "origin"], capture_output=True,
                         text=True).stdout.strip()
    match = re.search(r"([A-Za-z0-9_.-]+)[+/]([A-Za-z0-9_.-]+?)(?:\.git)?(?:/repo)?/?$", url)
    return f"{match.group(1)}/{match.group(2)}" if match else repo.name


def copy_reference(repo: Path, dest: Path) -> str:
    """Their committed tree at HEAD into `dest` (nothing uncommitted or ignored); returns the commit."""
    commit = reference_commit(repo)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return commit


def apply_patches(root: Path, patches: list[Patch]) -> list[dict]:
    """Apply each patch to the copy; returns what the report lists (file, line, old, new, why)."""
    applied = []
    for patch in patches:
        path = root / patch.file
        text = path.read_text()
        count = text.count(patch.old)
        if count != 1:
            raise RuntimeError(f"patch for {patch.file} matches {count} places, not 1: {patch.old.strip()!r} "
                               "(another commit of the reference code?)")
        line = text[:text.index(patch.old)].count("\n") + 1
        path.write_text(text.replace(patch.old, patch.new))
        applied.append({"file": patch.file, "line": line, "old": patch.old.rstrip("\n"),
                        "new": patch.new.rstrip("\n"), "why": patch.why})
    return applied


class ReferenceFailed(RuntimeError):
    """The reference code exited non-zero: its command, its exit status and the first error its log names."""

    def __init__(self, cmd: list[str], returncode: int, seconds: float, stderr: str):
        self.cmd, self.returncode, self.seconds, self.cause = cmd, returncode, seconds, root_cause(stderr)
        super().__init__(f"{' '.join(cmd)} exited {returncode} after {seconds:.0f}s:\n{stderr[-3000:]}")


_RANK_ERROR = re.compile(r"^(?:\[rank(\d+)\]: )?((?:[\w.]+)(?:Error|Exception): .*)$")


def root_cause(stderr: str) -> str:
    """The first exception line of a failed run's stderr (`rank 8: RuntimeError: ...` under torch.distributed, whose
    other ranks then die of its SIGTERM), else its last non-empty line."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for line in lines:
        if m := _RANK_ERROR.match(line):
            return (f"rank {m.group(1)}: " if m.group(1) else "") + m.group(2)
    return lines[-1] if lines else "(no output on stderr)"


def run_logged(cmd: list[str], cwd: Path, env: dict, log_path: Path, timeout: float | None = None) -> tuple[str, float]:
    """Run one command of the reference code; stdout goes to `log_path` (and back), stderr beside it."""
    log.info("reference: %s (in %s; log %s)", " ".join(cmd), cwd, log_path)
    start = time.perf_counter()
    with open(log_path, "w") as out, open(log_path.with_suffix(".err"), "w") as err:
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=err, timeout=timeout)
    seconds = time.perf_counter() - start
    text = log_path.read_text()
    if proc.returncode != 0:
        raise ReferenceFailed(cmd, proc.returncode, seconds, log_path.with_suffix(".err").read_text())
    return text, seconds


# --- DENSE -------------------------------------------------------------------------------------------------------

DENSE_MODEL = {"mnist": ("mnist_cnn", "cnn2"), "cifar10": ("cnn", "cnn3")}  # their --model, our registry name
# The README's knowledge-distillation command (zj-jayzhang/DENSE README, "Global Distillation"): only --epochs and
# the pretraining's --local_ep are cut to the budget.
DENSE_KD_ARGS = ["--iid=0", "--lr=0.005", "--batch_size", "256", "--synthesis_batch_size=256", "--g_steps", "30",
                 "--lr_g", "1e-3", "--bn", "1.0", "--oh", "1.0", "--T", "20", "--adv=1", "--beta=0.5"]
DENSE_LOCAL_ARGS = ["--iid=0", "--lr=0.01", "--beta=0.5"]
_ACC = re.compile(r"Test_set: Average loss: [-\d.naif]+, Accuracy: ([\d.]+)")


def parse_dense_pretrain(text: str, num_clients: int) -> dict:
    """Per-client final local test accuracy, FedAvg and ensemble accuracy (%) from `--type=pretrain` output."""
    clients, current, fedavg, ensemble, section = [], None, None, None, None
    for line in text.splitlines():
        if m := re.match(r"client (\d+)$", line.strip()):
            current = int(m.group(1))
            clients.append(None)
            section = "client"
        elif line.strip() == "avg acc:":
            section = "avg"
        elif line.strip() == "ensemble acc:":
            section = "ensemble"
        elif m := _ACC.search(line):
            acc = float(m.group(1))
            if section == "client" and current is not None:
                clients[-1] = acc  # the last epoch's evaluation wins
            elif section == "avg":
                fedavg = acc
            elif section == "ensemble":
                ensemble = acc
    if len(clients) != num_clients or None in clients or fedavg is None or ensemble is None:
        raise RuntimeError(f"DENSE pretrain output: {len(clients)} clients, fedavg {fedavg}, ensemble {ensemble}")
    return {"clients": clients, "fedavg": fedavg, "ensemble": ensemble}


def parse_dense_kd(text: str) -> dict:
    """Per-epoch global test accuracy (%) of `--type=kd_train` output (the first two evaluations are the FedAvg
    model and the ensemble, before distillation)."""
    accs = [float(m.group(1)) for m in _ACC.finditer(text)]
    best = [float(x) for x in re.findall(r"best acc:([\d.]+)", text)]
    if len(accs) < 3 or not best:
        raise RuntimeError("DENSE kd_train output has no distillation epoch")
    return {"fedavg": accs[0], "ensemble": accs[1], "epochs": accs[2:], "best": best[-1]}


def run_dense_ref(args) -> dict:
    their_model, our_model = DENSE_MODEL[args.dataset]
    cfg = cell_config(args.dataset, args.seed, args.num_clients, our_model)
    scratch = SCRATCH / f"dense-ref-{args.dataset}-s{args.seed}-{budget_name(args)}{probe_suffix(args)}"
    code = scratch / "code"
    commit = copy_reference(Path(args.repo), code)
    patches = apply_patches(code, PATCHES["dense-ref"])
    (code / "oneshot_fl_ref_launch.py").write_text(LAUNCHER)
    (code / "df_ckpt").mkdir(exist_ok=True)  # their best-checkpoint folder, which their repository lacks
    from oneshot_fl.config import resolve_data_dir

    data_root = export_dataset(args.dataset, resolve_data_dir(cfg), SCRATCH / "data")
    parts = our_partition(cfg)
    (scratch / "partition.json").write_text(json.dumps(parts))
    env = {**os.environ, "REF_DATA_DIR": str(data_root), "REF_PARTITION": str(scratch / "partition.json"),
           "REF_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    common = [f"--model={their_model}", f"--dataset={args.dataset}", f"--seed={their_seed(args)}",
              f"--num_users={args.num_clients}"]
    launch = [args.python, "oneshot_fl_ref_launch.py", "loop_df_fl.py"]
    pre_cmd = launch + ["--type=pretrain", *DENSE_LOCAL_ARGS, *common, f"--local_ep={args.local_epochs}"]
    kd_cmd = launch + ["--type=kd_train", *DENSE_KD_ARGS, *common, f"--epochs={args.epochs}",
                       f"--save_dir=run/{args.dataset}", f"--other={args.dataset}"]
    pre_text, local_s = run_logged(pre_cmd, code, env, scratch / "pretrain.log")
    pre = parse_dense_pretrain(pre_text, args.num_clients)
    kd_text, server_s = run_logged(kd_cmd, code, env, scratch / "kd_train.log")
    kd = parse_dense_kd(kd_text)
    return {
        "method": "dense-ref", "accuracy_final": kd["epochs"][-1] / 100, "accuracy_best": kd["best"] / 100,
        "ensemble_accuracy": kd["ensemble"] / 100, "fedavg_accuracy": kd["fedavg"] / 100,
        "client_accuracy": [a / 100 for a in pre["clients"]], "client_archs": [their_model] * args.num_clients,
        "history": [a / 100 for a in kd["epochs"]],
        "wall_s": {"local": local_s, "server_total": server_s, "total": local_s + server_s},
        "reference": {"repo": reference_name(Path(args.repo)), "commit": commit, "patches": patches,
                      "commands": [" ".join(pre_cmd[1:]), " ".join(kd_cmd[1:])]},
        "partition_digest": partition_digest(parts), "client_sizes": [len(p) for p in parts],
        "overrides": {"model": our_model, "local.epochs": args.local_epochs, "distill.epochs": args.epochs,
                      "reference-args": DENSE_KD_ARGS},
    }


def dense_overrides(args) -> dict:
    """Our DENSE at the reference README's settings where we have the knob (the same model, local SGD, the
    budget's epochs; T_G 30, b 256, ngf 64, nz 256, KD lr 0.005 constant, T 20, lambda_adv 1, the generator reset
    each epoch, one pass over the growing pool per epoch, evaluation every epoch; CIFAR-10 clients train on
    RandomCrop(32, 4) + HFlip views, as their loader's)."""
    return {"method": "dense", "dataset": args.dataset, "partition": "niid-bench", "alpha": 0.5,
            "num-clients": args.num_clients, "seed": args.seed, "preset": "paper",
            "model": DENSE_MODEL[args.dataset][1], "local.epochs": args.local_epochs, "local.batch-size": 128,
            "local.lr": 0.01, "distill.epochs": args.epochs, "distill.generator-steps": 30, "distill.synth-batch": 256,
            "distill.ngf": 64, "distill.nz": 256, "distill.lr-student": 0.005, "distill.lr-schedule": "constant",
            "distill.temperature": 20.0, "distill.pool": "growing", "distill.reset-generator": True,
            "distill.eval-every": 1, "dense.lambda-adv": 1.0, "dense.lambda-bn": 1.0,
            **({"local.augment": "crop-flip"} if args.dataset == "cifar10" else {}), **parse_sets(args.set)}


# --- FedMHO -----------------------------------------------------------------------------------------------------

FEDMHO_CLIENTS, FEDMHO_CONSTRAINED = 10, 5


# FedMHO's scheduler (MultiStepLR, decay 0.01) puts its milestone at local_n_epochs + 1 for every client, the CVAE
# clients included: at the README's 200 local epochs the CVAE's 30 epochs never reach it, at a budget of e < 29 the
# CVAE's Adam lr would drop 100x after e + 1 epochs. A milestone no run reaches keeps the README's schedule.
NEVER = 10**6


def fedmho_args(args, data_dir: Path, scratch: Path) -> list[str]:
    """Their README's FedMHO-MD command (EMNIST there) for MNIST: latent size 2 and 6,000 synthetic samples (Table
    III); the budget's local epochs at SGD 0.01 (our CPU tables' classifier lr: at the paper's 5e-3 a 1/4-width VGG-9
    without BN leaves chance level later than the budget's epochs); DataLoader workers 0 and no CUDA (this machine);
    checkpoint, job log and data folders in the scratch folder."""
    return ["--arch", "vgg9", "--complex_arch", "master=vgg9,worker=vgg9:cvae,num_clients_per_model=5",
            "--experiment", "heterogeneous", "--data", "mnist", "--pin_memory", "False", "--batch_size", "64",
            "--num_workers", "0", "--partition_data", "non_iid_dirichlet", "--non_iid_alpha", "0.5",
            "--train_data_ratio", "1", "--val_data_ratio", "0", "--n_clients", str(FEDMHO_CLIENTS),
            "--participation_ratio", "1", "--n_participated", str(FEDMHO_CLIENTS), "--n_comm_rounds", "1",
            "--local_n_epochs", str(args.local_epochs), "--world_conf", "0,0,1,1,100", "--on_cuda", "False",
            "--fl_aggregate", "scheme=semi_supervised,clean_rate=0.8", "--optimizer", "sgd", "--lr", "1e-2",
            "--local_prox_term", "0", "--lr_warmup", "False", "--lr_warmup_epochs", "5",
            "--lr_warmup_epochs_upper_bound", "150", "--lr_scheduler", "MultiStepLR", "--lr_decay", "0.01",
            "--lr_milestones", str(NEVER),
            "--weight_decay", "0", "--use_nesterov", "False", "--momentum_factor", "0.9", "--track_time", "True",
            "--display_tracked_time", "True", "--manual_seed", str(their_seed(args)), "--pn_normalize", "False",
            "--same_seed_process", "True", "--use_hog_feature", "False", "--latent_size", "2",
            "--num_synthesis_sample", str(args.synthetic_samples), "--is_md", "True",
            "--data_dir", str(data_dir), "--checkpoint", str(scratch / "checkpoint"),
            "--job_id", str(scratch / "jobrun"), "--timestamp", str(int(time.time()))]


def evaluate_classifiers(states: list[dict], arch: str, dataset: str, data_dir: Path) -> tuple[list[float], float]:
    """Test accuracy of each classifier state (our registry's `arch`) and of their mean-logit ensemble."""
    import torch

    from oneshot_fl.data.datasets import DATASETS, load_split, to_tensor
    from oneshot_fl.models.registry import build

    info = DATASETS[dataset]
    test = load_split(dataset, "test", str(data_dir), False)
    models = []
    for state in states:
        model = build(arch, info.input_shape, info.num_classes)
        model.load_state_dict(state)
        models.append(model.eval())
    logits = [[] for _ in models]
    with torch.no_grad():
        for first in range(0, len(test), 1000):
            x = to_tensor(test.images[first:first + 1000])
            for k, model in enumerate(models):
                logits[k].append(model(x))
    labels = torch.as_tensor(test.labels)
    per_model = [torch.cat(chunks) for chunks in logits]
    accs = [float((out.argmax(1) == labels).float().mean()) for out in per_model]
    ensemble = float((torch.stack(per_model).mean(0).argmax(1) == labels).float().mean())
    return accs, ensemble


def parse_fedmho(text: str) -> dict:
    """The global model's test accuracy after fusion and FedAvg w0's (%), from the master's output."""
    final = re.findall(r"test accuracy: ([\d.]+) %", text)
    if not final:
        raise RuntimeError("FedMHO output has no 'test accuracy' line (the server's fusion did not finish)")
    start = re.search(r"'top1': ([\d.]+)\} \(\{'split': 'test', 'type': 'fedag_test_loader_vgg9", text)
    return {"final": float(final[-1]), "w0": float(start.group(1)) if start else None}


def run_fedmho_ref(args) -> dict:
    import torch

    if args.synthetic_samples < 1000:  # their filter plots 64 kept samples of every class
        raise SystemExit("oneshot-fl: error: FedMHO's data_clean draws 64 kept samples per class: "
                         "--synthetic-samples must be >= 1000")

    from oneshot_fl.config import resolve_data_dir

    cfg = cell_config("mnist", args.seed, FEDMHO_CLIENTS, "vgg9-small", {"fedmho.constrained-clients": 5})
    scratch = SCRATCH / f"fedmho-md-ref-mnist-s{args.seed}-{budget_name(args)}{probe_suffix(args)}"
    code = scratch / "code"
    commit = copy_reference(Path(args.repo), code)
    patches = apply_patches(code, PATCHES["fedmho-md-ref"])
    (code / "oneshot_fl_ref_launch.py").write_text(LAUNCHER)
    data_root = export_dataset("mnist", resolve_data_dir(cfg), SCRATCH / "data")
    named = scratch / "data"  # their loader reads <data_dir>/mnist/MNIST/raw
    named.mkdir(parents=True, exist_ok=True)
    if not (named / "mnist").exists():
        (named / "mnist").symlink_to(data_root)
    parts = our_partition(cfg)
    (scratch / "partition.json").write_text(json.dumps(parts))
    uploads = scratch / "uploads.pt"
    uploads.unlink(missing_ok=True)
    env = {**os.environ, "REF_PARTITION": str(scratch / "partition.json"), "REF_UPLOADS": str(uploads),
           "REF_FUSION_EPOCHS": str(args.epochs),
           "REF_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [args.python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(FEDMHO_CLIENTS + 1),
           "oneshot_fl_ref_launch.py", "main.py", *fedmho_args(args, named, scratch)]
    start = time.time()
    text, seconds = run_logged(cmd, code, env, scratch / "run.log")
    out = parse_fedmho(text)
    received = torch.load(uploads, map_location="cpu")
    server_s = time.time() - uploads.stat().st_mtime  # from the uploads' arrival to the end of their run
    classifiers = [received[k] for k in sorted(received) if "features.0.weight" in received[k]]
    client_accs, ensemble = evaluate_classifiers(classifiers, "vgg9-small", "mnist", resolve_data_dir(cfg))
    return {
        "method": "fedmho-md-ref", "accuracy_final": out["final"] / 100, "accuracy_best": None,
        "start_accuracy": out["w0"] / 100 if out["w0"] is not None else None,
        "ensemble_accuracy": ensemble, "client_accuracy": client_accs,
        "client_archs": ["vgg9"] * len(classifiers) + ["cvae"] * (len(received) - len(classifiers)),
        "wall_s": {"local": seconds - server_s, "server_total": server_s, "total": time.time() - start},
        "reference": {"repo": reference_name(Path(args.repo)), "commit": commit, "patches": patches,
                      "commands": [" ".join(cmd[1:])]},
        "partition_digest": partition_digest(parts), "client_sizes": [len(p) for p in parts],
        "overrides": {"model": "vgg9-small", "local.epochs": args.local_epochs, "fedmho.epochs": args.epochs,
                      "fedmho.synthetic-samples": args.synthetic_samples},
    }


def fedmho_overrides(args) -> dict:
    """Our FedMHO-MD at the reference run's settings: the same clients (5 vgg9-small at SGD 0.01, batch 64, the
    budget's epochs; 5 CVAE-small, latent 2, 30 epochs at Adam 5e-2), the code's floor rounding of the squared
    quotas, N_syn, R_th 0.8 and Adam 1e-5 fusion for the budget's epochs."""
    return {"method": "fedmho-md", "dataset": "mnist", "partition": "niid-bench", "alpha": 0.5,
            "num-clients": FEDMHO_CLIENTS, "seed": args.seed, "preset": "cpu", "model": "vgg9-small",
            "fedmho.constrained-clients": FEDMHO_CONSTRAINED, "local.epochs": args.local_epochs,
            "local.batch-size": 64, "local.lr": 0.01, "cvae.epochs": 30, "fedmho.epochs": args.epochs,
            "fedmho.lr": 1e-5, "fedmho.synthetic-samples": args.synthetic_samples, "fedmho.keep-ratio": 0.8,
            "fedmho.sampling": "squared", "fedmho.rounding": "floor", "fedmho.absent-classes": "uniform",
            **parse_sets(args.set)}


# --- ours -----------------------------------------------------------------------------------------------------------

def parse_sets(items: list[str]) -> dict:
    from launcher.launch import parse_overrides

    return parse_overrides(items) if items else {}


def run_ours(args, overrides: dict) -> tuple[dict, dict]:
    """One simulation of our implementation (run folder under benchmarks/runs/reference_runs/); returns its
    result.json and the overrides it ran."""
    from launcher.launch import run_simulation

    name = f"{overrides['method']}-{args.dataset}-s{args.seed}-{budget_name(args)}{probe_suffix(args)}"
    run_dir = BENCH_DIR / "runs" / TABLE / name
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run = run_simulation({**overrides, "threads": 1, "server-threads": 1, "output-dir": str(run_dir.parent),
                          "run-name": name}, stream=False)
    if not run.ok:
        raise RuntimeError(f"{name} failed ({run.status}): {run.status_details}\n{run.log_text[-4000:]}")
    return run.result(), overrides


def budget_name(args) -> str:
    return f"E{args.local_epochs}-T{args.epochs}"


def probe_suffix(args) -> str:
    """A labelled probe's run folder suffix (its own folder: the cell's run and its uploads stay)."""
    return "" if not args.label else "-" + "".join(ch if ch.isalnum() else "-" for ch in args.label)


def their_seed(args) -> int:
    """The reference code's own seed (its init and random streams): --ref-seed, else the cell's seed. The partition
    is always the cell's (ours, written for their code), so another value retrains the same clients' shards."""
    return args.seed if args.ref_seed is None else args.ref_seed


def probe_label(impl: str, label: str) -> str:
    """The row name of a probe of our implementation: `dense (independent init)`."""
    return f"{impl} ({label})"


# --- ours on the reference's uploads: the server side alone ------------------------------------------------------

def dense_state(theirs: dict) -> dict:
    """DENSE's CNNMnist / CNNCifar state dict in our cnn2 / cnn3 names (the same tensors)."""
    names = {"layer1.0.": "features.0.", "layer1.1.": "features.1.", "layer2.0.": "features.4.",
             "layer2.1.": "features.5.", "fc.": "classifier.",  # CNNMnist -> cnn2
             "conv1.": "features.0.", "conv2.": "features.3.", "conv3.": "features.6.", "fc1.": "classifier."}
    out = {}
    for key, value in theirs.items():
        prefix = next((p for p in names if key.startswith(p)), None)
        if prefix is None:
            raise KeyError(f"DENSE state key {key!r} has no name in our model")
        out[names[prefix] + key[len(prefix):]] = value
    return out


def fedmho_state(theirs: dict) -> dict:
    """One FedMHO upload in our names: a VGG-9 as it is (the same keys), a CVAE as its decoder (fc1, fc2)."""
    if "features.0.weight" in theirs:
        return dict(theirs)
    names = {"decoder.MLP.L0.": "fc1.", "decoder.MLP.L1.": "fc2."}
    return {names[p] + k[len(p):]: v for k, v in theirs.items() for p in names if k.startswith(p)}


def reference_uploads(impl: str, args) -> list[dict]:
    """The reference run's client states in partition order, in our names."""
    import torch

    if impl == "dense-ref":
        path = SCRATCH / f"dense-ref-{args.dataset}-s{args.seed}-{budget_name(args)}" / "code" / \
            f"{args.dataset}_{args.num_clients}clients_0.5.pkl"
        return [dense_state(state) for state in torch.load(path, map_location="cpu")]
    received = torch.load(SCRATCH / f"fedmho-md-ref-mnist-s{args.seed}-{budget_name(args)}" / "uploads.pt",
                          map_location="cpu")
    return [fedmho_state(received[k]) for k in sorted(received)]  # client id k = partition k - 1


def archive_of_reference(ours_archive: Path, states: list[dict], dest: Path, roles: tuple[str, ...]) -> Path:
    """Our run's uploads archive of the same cell (partition, label counts, roles) with the tensors of every upload
    of `roles` replaced by the reference client's of the same partition; the replay re-checks every upload."""
    import torch

    manifest = json.loads((ours_archive / "manifest.json").read_text())
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for entry in manifest["uploads"]:
        if entry["role"] not in roles:
            shutil.copyfile(ours_archive / entry["file"], dest / entry["file"])
            continue
        torch.save(states[entry["partition_id"]], dest / entry["file"])
        # our client's own measurements (its local test accuracy, losses) are not the reference client's
        entry["metrics"] = {k: v for k, v in entry["metrics"].items() if k == "num-examples"}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return dest


def run_ours_on_reference(args) -> dict:
    """Our server method on the reference run's client models (and, FedMHO, decoders): the two codes' server
    sides on the same uploads."""
    from launcher.launch import run_config_items
    from launcher.replay import CLIENT_SIDE_KEYS, CLIENT_SIDE_PREFIXES, replay

    version = code_version()  # the code this process imports now (result.json's provenance is read at its end)
    impl = args.impl.removesuffix("-on-ref")
    overrides = dense_overrides(args) if impl == "dense" else fedmho_overrides(args)
    ours_dir = BENCH_DIR / "runs" / TABLE / f"{impl}-{args.dataset}-s{args.seed}-{budget_name(args)}"
    roles = ("classifier", "decoder") if args.ref_roles == "all" else (args.ref_roles,)
    tag = "uploads" if args.ref_roles == "all" else f"{args.ref_roles}s"
    name = f"{args.impl}-{tag}{'-random-filter' if args.random_filter else ''}-{args.dataset}-s{args.seed}-" \
           f"{budget_name(args)}"
    archive = archive_of_reference(ours_dir / "uploads", reference_uploads(f"{impl}-ref", args),
                                   BENCH_DIR / "runs" / TABLE / f"{name}-uploads", roles)
    server = {k: v for k, v in overrides.items() if k not in CLIENT_SIDE_KEYS and not k.startswith(CLIENT_SIDE_PREFIXES)
              and k not in ("method", "preset", "seed")}
    out = BENCH_DIR / "runs" / TABLE / name
    if out.exists():
        shutil.rmtree(out)
    strategy_cls = None
    if args.random_filter:
        strategy_cls = random_filter_class(impl)
    result = replay(archive, [f"method='{impl}'", *run_config_items({**server, "threads": 1})], run_dir=out,
                    strategy_cls=strategy_cls)
    result["code_version"] = version
    cfg = cell_config(args.dataset, args.seed, overrides["num-clients"], overrides["model"],
                      {k: v for k, v in overrides.items() if k == "fedmho.constrained-clients"})
    label = f"{impl} on {impl}-ref {tag}"
    if args.ref_roles != "all":
        label += ", our " + ("decoders" if args.ref_roles == "classifier" else "classifiers")
    if args.random_filter:
        label += ", random 80 % filter (their code's)"
    return {**ours_record(args, result, overrides, our_partition(cfg)), "label": label}


def random_filter_class(method: str):
    """`method`'s strategy keeping a random R_th of each class instead of the nearest to the class mean (FedMHO's
    filter): the FedMHO code's data_clean computes distances in a shuffled DataLoader's order and then indexes the
    unshuffled set with their ranks, which keeps a random subset."""
    import torch

    from oneshot_fl.engine.decoders import DecoderSynthesizer
    from strategies import strategy_class

    class RandomKeep(DecoderSynthesizer):
        def keep(self, drawn):
            gen = torch.Generator().manual_seed(self.seed)
            kept = []
            for c in torch.unique(drawn.labels):
                idx = torch.nonzero(drawn.labels == c).squeeze(1)
                keep = int(self.keep_ratio * len(idx) + 1e-9)
                kept.append(idx[torch.randperm(len(idx), generator=gen)[:keep]])
            return torch.sort(torch.cat(kept)).values

    base = strategy_class(method)
    return type(f"RandomFilter{base.__name__}", (base,), {"synthesizer_class": RandomKeep})


# --- records --------------------------------------------------------------------------------------------------------

def reference_record(args, out: dict) -> dict:
    overrides = out.pop("overrides")
    return {"table": TABLE, "dataset": args.dataset, "partition": "niid-bench", "alpha": 0.5,
            "num_clients": args.num_clients, "seed": args.seed, "preset": "reference", "budget": budget_name(args),
            **out, "overrides": overrides, "overrides_key": overrides_key(overrides), "code_version": code_version(),
            "machine": machine(), "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S")}


def ours_record(args, result: dict, overrides: dict, parts: list[list[int]]) -> dict:
    history = [h.get("accuracy") for h in result.get("history", []) if h.get("accuracy") is not None]
    return record_from_result(TABLE, result, overrides, {
        "budget": budget_name(args), "partition_digest": partition_digest(parts),
        "client_sizes": [len(p) for p in parts], "history": history,
        "start_accuracy": result["global"].get("init_accuracy")})


COST_FILE = RESULTS_DIR / f"{TABLE}_cost.json"


def _fastest(step, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


def step_costs(arch: str, channels: int, size: int) -> tuple[float, float]:
    """(one generator step: b 256 through DENSE's generator, five teachers and the student, forward and backward;
    one local SGD step of b 128) in seconds, the fastest of 3."""
    import torch

    from oneshot_fl.models.generator import GeneratorSpec
    from oneshot_fl.models.registry import build

    nets = [build(arch, (channels, size, size), 10).eval() for _ in range(6)]
    generator = GeneratorSpec(256, 64, size, channels).build()
    z, adam = torch.randn(256, 256), torch.optim.Adam(generator.parameters(), 1e-3)
    client = build(arch, (channels, size, size), 10)
    sgd, batch = torch.optim.SGD(client.parameters(), 0.01, momentum=0.9), torch.rand(128, channels, size, size)

    def generator_step():
        x = generator(z)
        loss = sum(net(x).logsumexp(1).mean() for net in nets)
        adam.zero_grad()
        loss.backward()
        adam.step()

    def local_step():
        loss = client(batch).logsumexp(1).mean()
        sgd.zero_grad()
        loss.backward()
        sgd.step()

    return _fastest(generator_step), _fastest(local_step)


def command_cost(args) -> int:
    """What one DENSE cell costs here per epoch, from our models of the reference architectures (cnn2 = CNNMnist,
    cnn3 = CNNCifar) and DENSE's generator at the README's settings, one thread."""
    torch_threads()
    rows = []
    for dataset, (_, arch) in DENSE_MODEL.items():
        channels, size = (1, 28) if dataset == "mnist" else (3, 32)
        g, loc = step_costs(arch, channels, size)
        train = 60_000 if dataset == "mnist" else 50_000
        rows.append({"dataset": dataset, "arch": arch, "generator_step_s": g, "local_step_s": loc,
                     "kd_epoch_generation_s": 30 * g, "local_epoch_all_clients_s": train / 128 * loc})
    COST_FILE.write_text(json.dumps({"rows": rows, "code_version": code_version(), "machine": machine(),
                                     "load_average": os.getloadavg()}, indent=1) + "\n")
    render()
    return 0


def command_run(args) -> int:
    torch_threads()
    if args.impl.startswith("fedmho"):  # FedMHO's cell: MNIST, 5 classifier + 5 CVAE clients
        args.dataset, args.num_clients = "mnist", FEDMHO_CLIENTS
    if args.impl in ("dense-ref", "fedmho-md-ref"):
        try:
            record = reference_record(args, (run_dense_ref if args.impl == "dense-ref" else run_fedmho_ref)(args))
        except ReferenceFailed as exc:
            return record_failure(args, exc)
        if args.label:
            record.update(label=probe_label(args.impl, args.label), probe_ref_seed=their_seed(args))
    elif args.impl.endswith("-on-ref"):
        record = run_ours_on_reference(args)
    elif args.impl in ("dense", "fedmho-md"):
        overrides = dense_overrides(args) if args.impl == "dense" else fedmho_overrides(args)
        result, overrides = run_ours(args, overrides)
        cfg = cell_config(args.dataset, args.seed, overrides["num-clients"], overrides["model"],
                          {k: v for k, v in overrides.items() if k == "fedmho.constrained-clients"})
        record = ours_record(args, result, overrides, our_partition(cfg))
        if args.label:
            record.update(label=probe_label(args.impl, args.label), probe_sets=list(args.set))
    else:
        raise SystemExit(f"oneshot-fl: error: unknown implementation {args.impl!r}")
    path = append_record(record)
    log.info("%s %s seed %d %s: final %.4f, best %s, ensemble %s -> %s", args.impl, args.dataset, args.seed,
             budget_name(args), record["accuracy_final"], record.get("accuracy_best"),
             record.get("ensemble_accuracy"), path)
    render()
    return 0


def record_failure(args, exc: ReferenceFailed) -> int:
    """A reference run that died: its cell, budget and probe, their command, exit status and root cause, in the
    failures file the report lists (no accuracy: nothing else reads it)."""
    record = {"table": FAILURES, "method": args.impl, "dataset": args.dataset, "seed": args.seed,
              "budget": budget_name(args), "returncode": exc.returncode, "seconds": round(exc.seconds, 1),
              "cause": exc.cause, "command": " ".join(exc.cmd), "code_version": code_version(), "machine": machine(),
              "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    if args.label:
        record.update(label=probe_label(args.impl, args.label), probe_ref_seed=their_seed(args))
    append_record(record)
    log.error("%s %s seed %d %s failed after %.0f s: %s", args.impl, args.dataset, args.seed, budget_name(args),
              exc.seconds, exc.cause)
    render()
    return 1


def failures(records: list[dict]) -> list[str]:
    """The reference runs that exited with an error, latest per cell and budget, with the command that reruns each."""
    lines = [f"- {label} {dataset} seed {seed} {budget} (harness {r.get('code_version', '?')}): exit "
             f"{r['returncode']} after {r['seconds']:.0f} s, `{r['cause']}`; `{run_command(r, REPO_FOLDERS)}`"
             for (label, dataset, seed, budget), r in sorted(latest(records).items())]
    if not lines:
        return []
    return ["## Reference runs that failed", "",
            "Their code, patched as listed below, exited with an error; the first exception its log names:", "",
            *lines, ""]


def torch_threads() -> None:
    import torch

    torch.set_num_threads(1)


# --- the report -----------------------------------------------------------------------------------------------------

PAIRS = [("dense", "dense-ref"), ("fedmho-md", "fedmho-md-ref")]


def _pct(value) -> str:
    return "–" if value is None else f"{100 * value:.2f}"


def latest(records: list[dict]) -> dict[tuple, dict]:
    """The latest record per (implementation, dataset, seed, budget). A replay on a reference run's uploads counts
    only if it is newer than that cell's latest reference run (a rerun of the reference replaces its uploads)."""
    out: dict[tuple, dict] = {}
    for r in sorted(records, key=lambda r: r.get("recorded_at", "")):
        out[(r.get("label") or r["method"], r["dataset"], r["seed"], r.get("budget"))] = r
    for key, r in list(out.items()):
        label, *cell = key
        if " on " in label:
            ref = out.get((label.split(" on ", 1)[1].split(" ", 1)[0], *cell))
            if ref is None or r.get("recorded_at", "") < ref.get("recorded_at", ""):
                del out[key]
    return out


def side_by_side(records: list[dict]) -> list[str]:
    rows = latest(records)
    cells = sorted({(d, s, b) for (_, d, s, b) in rows})
    lines = ["| dataset | seed | budget | implementation | clients | ensemble | start | final | best | server s | "
             "local s | partition |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for ours, ref in PAIRS:
        for dataset, seed, budget in cells:
            here = [m for (m, d, sd, b) in rows if (d, sd, b) == (dataset, seed, budget)]
            ref_probes = sorted(m for m in here if m.startswith(f"{ref} ("))
            replays = sorted(m for m in here if m.startswith((f"{ours} on ", f"{ours} (")))
            for method in (ref, *ref_probes, ours, *replays):
                r = rows.get((method, dataset, seed, budget))
                if r is None:
                    continue
                clients = " / ".join(f"{100 * a:.1f}" for a in r.get("client_accuracy", []) if a is not None)
                wall = r.get("wall_s", {})
                lines.append(f"| {dataset} | {seed} | {budget} | {method} | {clients} | "
                             f"{_pct(r.get('ensemble_accuracy'))} | "
                             f"{_pct(r.get('start_accuracy', r.get('fedavg_accuracy')))} | "
                             f"{_pct(r.get('accuracy_final'))} | "
                             f"{_pct(r.get('accuracy_best'))} | {wall.get('server_total', 0):.0f} | "
                             f"{wall.get('local', 0):.0f} | {r.get('partition_digest', '?')} |")
    return lines


def patch_list(records: list[dict]) -> list[str]:
    lines = []
    by_impl = {}
    for r in sorted(records, key=lambda r: r.get("recorded_at", "")):
        if r.get("reference"):
            by_impl[r["method"]] = r["reference"]
    for method, ref in sorted(by_impl.items()):
        lines += ["", f"### {method}: {ref['repo']} at {ref['commit'][:7]}", "",
                  "| file:line | their line | patched to | why |", "|---|---|---|---|"]
        for p in ref["patches"]:
            old, new = (p[k].replace("|", "\\|").replace("\n", " ⏎ ") for k in ("old", "new"))
            lines.append(f"| {p['file']}:{p['line']} | `{old.strip()}` | `{new.strip()}` | {p['why']} |")
        lines += ["", "Commands (in the scratch copy, through the launcher):", ""]
        lines += [f"- `{c}`" for c in ref.get("commands", [])]
    lines += ["", "Launcher shims (before their script runs; no file of theirs changes):", ""]
    lines += [f"- {what}: {why}" for what, why in SHIMS]
    return lines


# What each reference does differently from ours at the settings run here, read from both codes (not measured one
# by one here); "paper" says which the `paper` preset follows. The report prints these under the table.
DIFFERENCES = {
    "dense": [
        "BN-statistics loss: theirs hooks the BN layers through `Ensemble_A`, whose models sit in a plain list, so no "
        "hook is registered and L_BN is 0 although `--bn 1`; ours hooks every client BN layer (lambda_BN 1). Paper: "
        "Eq. 3 with lambda_1 = 1, as ours.",
        "Generator input: theirs optimises z with the generator; ours keeps z fixed (paper: z ~ N(0, I)).",
        "Synthesis augmentation: theirs feeds teacher and student a kornia RandomCrop(pad 4) + HFlip view of the "
        "generated batch; ours the batch itself (paper: none).",
        "Pool: theirs stores the kept batch as 8-bit PNGs and distils with RandomHorizontalFlip (MNIST; CIFAR-10 "
        "adds RandomCrop(32, 4)), the teacher re-run on the flipped images; ours keeps float16 images with the "
        "teacher's logits from synthesis time, unaugmented (paper: no KD augmentation).",
        "Synthetic labels: theirs uniform random, sorted; ours balanced (b / C per class), shuffled.",
        "Client training on CIFAR-10: theirs with RandomCrop(32, 4) + HFlip (PIL transforms, torch's global "
        "generator); ours with the same transforms here (`local.augment=crop-flip`, drawn from the client's own "
        "generator; our default is none, the paper is silent). MNIST: neither augments.",
        "Reported number: theirs prints the best epoch's accuracy (and checkpoints it); both records carry final and "
        "best.",
    ],
    "fedmho-md": [
        "Filter: theirs ranks distances in a shuffled DataLoader's order and indexes the unshuffled set with them, "
        "so it keeps a random 80 %; ours keeps the 80 % nearest the class mean (paper Sec. 4.4 and Alg. 2, as ours).",
        "Fusion epochs: their code runs 20 on MNIST, the paper's Table III 10; both run the budget's T here.",
        "MD teacher: theirs runs the five classifiers on every batch, ours once per sample before fusion (eval mode, "
        "no augmentation: the same logits, fewer forward passes).",
        "Upload: theirs sends the whole CVAE and reads label counts from the partitioner's global; ours the decoder "
        "and the counts (the same values reach the sampler).",
        "Learning-rate schedule: theirs puts a MultiStepLR milestone (decay 0.01) at local_n_epochs + 1 for every "
        "client, CVAE clients included; at the README's 200 local epochs no client reaches it, at a cut budget the "
        "CVAE's Adam lr would drop 100x mid-training, so the harness moves the milestone out of reach "
        "(`--lr_milestones`; records from code before b7d700f ran with the drop: seed 0 gave 88.27 with it, 89.01 "
        "without). Ours has no schedule there (paper: none).",
        "Classifier clients' optimiser: theirs SGD, momentum 0.9, no Nesterov, weight decay 0 (`--weight_decay 0`, "
        "set in every parameter group), lr 0.01 constant (the milestone above out of reach), "
        "mean cross-entropy, stopped after exactly E x ceil(n / 64) steps; ours the same values (local.momentum 0.9, "
        "local.weight-decay 0, no schedule). Paper Table III: SGD, momentum 0.9, lr 5e-3, batch 64; both run the "
        "harness's 0.01 here. No effect expected.",
        "Classifier batches: theirs a DataLoader over the shard, shuffled every epoch, batch 64, the last partial "
        "batch kept; ours the same, except that a 1-sample last batch is skipped (never here: no classifier shard "
        "of either cell is 1 mod 64). No effect.",
        "Classifier inputs: theirs torchvision MNIST through ToTensor only (`--pn_normalize False`), no "
        "augmentation; ours pixels in [0, 1], no augmentation (paper: silent on both). No effect.",
        "VGG-9 at 1/4 width: the same layers on both sides (conv3 16-32-64-64 with ReLU, three max-pools, adaptive "
        "7x7 average pool, FC 1024-1024-10 with Dropout 0.5, no BN, biases, PyTorch's default init); ours is built "
        "channels-last on a CPU, which changes only the order of float sums. No effect expected.",
        "Classifier init: both send one init to the five classifier clients (FedAvg's w0 needs a common start); "
        "theirs is drawn from the master's global RNG after `torch.manual_seed(seed)`, ours from a seed derived "
        "from (seed, init, arch): the same distribution, other draws.",
        "Random streams of local training: theirs one global torch RNG per worker process, seeded alike in every "
        "process (`--same_seed_process True`), draws the batch order and the dropout masks; ours a generator per "
        "client for the order and a seed derived from it for the masks. The same distributions, other draws. At "
        "E = 5 (190 to 600 SGD steps per client here) a client's test accuracy on the same shard differs between "
        "the two codes by up to 28 points in either direction (seed 100, client 2: theirs 21.7, ours 49.3; client "
        "3: 81.5 and 72.8), so one run per side cannot resolve a recipe effect of a few points; the only "
        "difference here that is expected to move the clients, direction random. Over their three draws and our "
        "five on seed 0's partition ('Chance alone' above: their --ref-seed; ours three local.stream draws and two "
        "local.init-draw draws) the ranges of four of the five classifier clients overlap; client 4 stays apart "
        "(theirs 59.8-70.5, ours 38.3-56.8, every one of our five draws below every one of theirs). Another init "
        "moves our client 4 by up to 16 points, downward (38.3 and 45.3 against 54.6), so the init is not what "
        "keeps it under theirs. At 15 local epochs it reaches 90.9 theirs and 91.0 ours (the budget curve below): "
        "at 5 it sits on the steep part of its learning curve, where learning a little slower costs 5-30 points; "
        "what makes ours slower there is not found.",
        "CVAE-small: the same model on both sides (encoder 784+10 -> 256 ReLU -> mu, log-variance of L = 2; "
        "decoder 2+10 -> 256 ReLU -> 784 Sigmoid), inputs in [0, 1], no augmentation on MNIST; Adam 5e-2 "
        "(default betas), batch 64, 30 epochs; loss BCE summed over pixels + KL (weight 1), divided by the batch "
        "size (paper Eq. 3 and Table III; the paper does not give the architecture or the latent size).",
        "CVAE log-variance: ours clamps it to [-20, 20] before the reparameterisation (Adam at 5e-2 drove it past "
        "float32's exp range on an MNIST NIID-Bench 0.1 client); theirs does not (paper: no clamp). The identity "
        "inside the bound; outside, the clamped unit gets no gradient, so it can only cost ours, and only if it "
        "binds (not logged).",
        "CVAE init and noise: theirs one init for the five CVAE clients (the master's template) and the "
        "reparameterisation noise from the global RNG; ours an init per client (seed derived from (seed, "
        "cvae-init, client)) and the noise from the client's generator. Decoders are not averaged, so no direction "
        "is expected; other draws.",
    ],
}


def cost_lines() -> list[str]:
    if not COST_FILE.is_file():
        return []
    cost = json.loads(COST_FILE.read_text())
    lines = ["## What a cell costs here", "",
             f"`python -m benchmarks.reference_runs cost` (code {cost['code_version']}, one thread, load average "
             f"{cost['load_average'][0]:.1f} on the 2 cores while it ran): seconds per step of our models of the "
             "reference architectures, and per epoch of the README's settings (T_G 30 generator steps of b 256; "
             "the whole training set in local batches of 128, all clients).", "",
             "| dataset | model | generator step | local step | generation per KD epoch | local epoch (all clients) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['dataset']} | {r['arch']} | {r['generator_step_s']:.2f} | {r['local_step_s']:.3f} | "
              f"{r['kd_epoch_generation_s']:.0f} | {r['local_epoch_all_clients_s']:.0f} |" for r in cost["rows"]]
    return lines + [""]


def decomposition(records: list[dict]) -> list[str]:
    """Per cell where the replays ran: the reference's final accuracy minus ours, split along the replays of our
    server on the reference's uploads (points; positive = the reference's part is the better one)."""
    rows, lines = latest(records), []
    for ours, ref in PAIRS:
        on = f"{ours} on {ours}-ref"
        for (_method, dataset, seed, budget) in sorted((k for k in rows if k[0] == ref),
                                                       key=lambda k: (k[1], k[2], budget_order(k[3]))):
            def acc(label, cell=(dataset, seed, budget)):
                r = rows.get((label, *cell))
                return None if r is None else 100 * r["accuracy_final"]

            theirs, mine, all_theirs = acc(ref), acc(ours), acc(f"{on} uploads")
            if None in (theirs, mine, all_theirs):
                continue
            parts = [f"{dataset} seed {seed} {budget}: {ref} {theirs:.2f} - {ours} {mine:.2f} = {theirs - mine:+.2f}",
                     f"server (their server minus ours, on their uploads) {theirs - all_theirs:+.2f}"]
            random_filter = acc(f"{on} uploads, random 80 % filter (their code's)")
            if random_filter is not None:
                parts.append(f"of which the filter (their random 80 % minus our nearest 80 %) "
                             f"{random_filter - all_theirs:+.2f}")
            their_classifiers = acc(f"{on} classifiers, our decoders")
            their_decoders = acc(f"{on} decoders, our classifiers")
            parts.append(f"uploads (ours on theirs minus ours on ours) {all_theirs - mine:+.2f}")
            if their_classifiers is not None and their_decoders is not None:
                parts.append(f"of which the classifier clients {their_classifiers - mine:+.2f} (with our decoders) / "
                             f"{all_theirs - their_decoders:+.2f} (with theirs), the decoder clients "
                             f"{their_decoders - mine:+.2f} / {all_theirs - their_classifiers:+.2f}")
            lines.append("- " + "; ".join(parts) + ".")
    if lines:
        lines = ["## Where the difference sits", "",
                 "From the replays of our server method on the reference run's uploads (same cell, budget and "
                 "server settings), final test accuracy in points:", "", *lines, ""]
    return lines


# The published number each pair is measured against, and the budget behind it (the papers' and READMEs' settings).
PUBLISHED = {
    ("dense", "mnist"): (95.82, "DENSE Table 1, MNIST alpha 0.5, m 5"),
    ("dense", "cifar10"): (62.19, "DENSE Table 1, CIFAR-10 alpha 0.5, m 5"),
    ("fedmho-md", "mnist"): (95.71, "FedMHO Table IV, MNIST Dir(0.5), K 10, mean of its seeds (+-0.68)"),
}
PUBLISHED_BUDGET = {
    "dense": "their README: 400 local epochs (its CIFAR-10 command), 200 distillation epochs",
    "fedmho-md": "Table III: 200 local epochs, 10 fusion epochs (their code: 20 on MNIST)",
}


def budget_order(budget: str) -> tuple[int, int]:
    """`E5-T10` -> (5, 10): local epochs, then distillation / fusion epochs."""
    match = re.fullmatch(r"E(\d+)-T(\d+)", budget or "")
    if match is None:
        raise ValueError(f"budget {budget!r} is not E<local epochs>-T<epochs>")
    return int(match.group(1)), int(match.group(2))


def _final_best(r: dict | None) -> str:
    if r is None:
        return "–"
    best = r.get("accuracy_best")
    return _pct(r["accuracy_final"]) + ("" if best is None else f" ({_pct(best)})")


def budget_curves(records: list[dict]) -> list[str]:
    """Per pair and cell run at two budgets or more: both implementations' ensemble and final (best) accuracy at
    each budget, their difference and the published number."""
    rows, lines = latest(records), []
    for ours, ref in PAIRS:
        cells = sorted({(d, s) for (m, d, s, _) in rows if m in (ours, ref)})
        for dataset, seed in cells:
            budgets = sorted({b for (m, d, s, b) in rows if m in (ours, ref) and (d, s) == (dataset, seed)},
                             key=budget_order)
            if len(budgets) < 2:
                continue
            published, source = PUBLISHED.get((ours, dataset), (None, ""))
            for budget in budgets:
                theirs, mine = rows.get((ref, dataset, seed, budget)), rows.get((ours, dataset, seed, budget))
                gap = ("–" if theirs is None or mine is None
                       else f"{100 * (theirs['accuracy_final'] - mine['accuracy_final']):+.2f}")
                lines.append(f"| {ours} | {dataset} | {seed} | {budget} | "
                             f"{_pct(theirs and theirs.get('ensemble_accuracy'))} | {_final_best(theirs)} | "
                             f"{_pct(mine and mine.get('ensemble_accuracy'))} | {_final_best(mine)} | {gap} | "
                             f"{'–' if published is None else f'{published:.2f} ({source})'} |")
    if not lines:
        return []
    return ["## Budget curves", "",
            "The same cell at growing budgets, final test accuracy % (best epoch in brackets), theirs minus ours in "
            "points, and the published number; the published budgets: "
            + "; ".join(f"{m}: {b}" for m, b in PUBLISHED_BUDGET.items()) + ".", "",
            "| method | dataset | seed | budget | theirs ensemble | theirs final (best) | ours ensemble | "
            "ours final (best) | theirs - ours | published |",
            "|---|---|---|---|---|---|---|---|---|---|", *lines, ""]


def seed_noise(records: list[dict]) -> list[str]:
    """Per pair, dataset and budget run at two seeds or more with both implementations: theirs minus ours at each
    seed against the seed-to-seed noise. A difference counts as above the noise where its mean is larger than its
    own spread over the seeds (max - min of the per-seed differences; a difference of two signs never is)."""
    rows, lines = latest(records), []
    for ours, ref in PAIRS:
        for dataset, budget in sorted({(d, b) for (m, d, _, b) in rows if m == ref}):
            seeds = sorted(s for (m, d, s, b) in rows if m == ref and (d, b) == (dataset, budget)
                           and (ours, d, s, b) in rows)
            if len(seeds) < 2:
                continue
            final = {(m, s): 100 * rows[(m, dataset, s, budget)]["accuracy_final"] for m in (ours, ref) for s in seeds}
            diffs = [final[(ref, s)] - final[(ours, s)] for s in seeds]
            mean, spread = sum(diffs) / len(diffs), max(diffs) - min(diffs)
            verdict = "above the noise" if abs(mean) > spread else "within the noise"
            per_impl = ", ".join(f"{m} {max(final[(m, s)] for s in seeds) - min(final[(m, s)] for s in seeds):.2f}"
                                 for m in (ref, ours))
            lines.append(f"- {ours} {dataset} {budget}: theirs - ours "
                         + " / ".join(f"{d:+.2f} (seed {s})" for d, s in zip(diffs, seeds))
                         + f", mean {mean:+.2f}, spread {spread:.2f}: {verdict}; each implementation's own "
                         f"seed-to-seed range: {per_impl}.")
    if not lines:
        return []
    return ["## Differences against the seed-to-seed noise", "",
            "Final accuracy, points. A difference is above the noise where its mean exceeds its spread over the "
            "seeds (max - min; a difference of two signs never does).", "", *lines, ""]


DRAW_KNOBS = ("local.stream=", "local.init-draw=")  # our knobs that change only a fleet's random draws


def draw_runs(rows: dict[tuple, dict], impl: str, cell: tuple) -> list[dict]:
    """The runs of `impl` on `cell` (dataset, seed, budget) that differ only by their random draws: the cell's row and
    its probes at another local.stream or local.init-draw (ours) or another --ref-seed (theirs), same partition and
    settings."""
    runs = [rows[(impl, *cell)]] if (impl, *cell) in rows else []
    for (m, *other), r in sorted(rows.items()):
        if tuple(other) != cell or not m.startswith(f"{impl} ("):
            continue
        sets = r.get("probe_sets")
        if r.get("probe_ref_seed") is not None or (sets and all(x.startswith(DRAW_KNOBS) for x in sets)):
            runs.append(r)
    return runs


def chance_noise(records: list[dict]) -> list[str]:
    """Per pair and cell run more than once on its own partition with other draws (our local.stream and
    local.init-draw, their --ref-seed): each side's finals and their range, the difference of the means against
    those ranges, and each client's range over the draws (the partition, hence every shard, is the same in all)."""
    rows, lines = latest(records), []
    for ours, ref in PAIRS:
        for cell in sorted({tuple(k[1:]) for k in rows if k[0] in (ours, ref)}):
            runs = {impl: draw_runs(rows, impl, cell) for impl in (ref, ours)}
            if max(len(v) for v in runs.values()) < 2 or not all(runs.values()):
                continue
            finals = {impl: [100 * r["accuracy_final"] for r in v] for impl, v in runs.items()}
            means = {impl: sum(v) / len(v) for impl, v in finals.items()}
            ranges = {impl: max(v) - min(v) for impl, v in finals.items()}
            gap = means[ref] - means[ours]
            verdict = "larger than either side's range" if abs(gap) > max(ranges.values()) else \
                "within one side's range"
            sides = "; ".join(f"{impl} {' / '.join(f'{a:.2f}' for a in finals[impl])} (mean {means[impl]:.2f}, range "
                              f"{ranges[impl]:.2f}, {len(finals[impl])} runs)" for impl in (ref, ours))
            clients = "; ".join(
                f"{impl} " + " / ".join(f"{100 * min(c):.1f}-{100 * max(c):.1f}"  # classifier clients (not decoders)
                                        for c in zip(*[r["client_accuracy"] for r in runs[impl]]) if None not in c)
                for impl in (ref, ours) if all(r.get("client_accuracy") for r in runs[impl]))
            lines.append(f"- {ours} {cell[0]} seed {cell[1]} {cell[2]}: {sides}; theirs - ours {gap:+.2f}, {verdict}. "
                         f"Clients (lowest-highest over the runs): {clients}.")
    if not lines:
        return []
    return ["## Chance alone: the same partition, other draws", "",
            "Final accuracy, points. Ours at other `local.stream` values (the clients' batch order, dropout and CVAE "
            "noise) and `local.init-draw` values (the clients' init), theirs at other `--ref-seed` values (their "
            "init and every random stream); the partition is the cell's in every run.", "", *lines, ""]


def reruns(records: list[dict]) -> list[str]:
    """Reference cells run more than once on the same commit of their code with the same patches and command
    lines (FedMHO's run timestamp aside): each run's client, ensemble and final accuracies, and whether they are
    identical."""
    groups: dict[tuple, list[dict]] = {}
    for r in sorted(records, key=lambda r: r.get("recorded_at", "")):
        if r.get("reference"):
            patches = json.dumps(r["reference"]["patches"], sort_keys=True)
            commands = tuple(re.sub(r"--timestamp \d+", "", c) for c in r["reference"].get("commands", []))
            key = (r["method"], r["dataset"], r["seed"], r.get("budget"), r["reference"]["commit"], patches,
                   commands)
            groups.setdefault(key, []).append(r)
    lines = []
    for (method, dataset, seed, budget, commit, *_), runs in groups.items():
        if len(runs) < 2:
            continue
        measured = [(r.get("client_accuracy"), r.get("ensemble_accuracy"), r.get("history") or r["accuracy_final"])
                    for r in runs]
        same = all(m == measured[0] for m in measured[1:])
        lines.append(f"- {method} {dataset} seed {seed} {budget}, their commit {commit[:7]}, the same patches and "
                     "commands: "
                     f"{len(runs)} runs (harness code " + ", ".join(r.get("code_version", "?") for r in runs)
                     + "), final " + " / ".join(_pct(r["accuracy_final"]) for r in runs) + ", ensemble "
                     + " / ".join(_pct(r.get("ensemble_accuracy")) for r in runs) + ": "
                     + ("identical clients, ensemble and every epoch's accuracy." if same else "they differ."))
    if not lines:
        return []
    return ["## Reruns", "", "The same reference cell run again from a fresh copy of their commit (`git archive` of "
            "the checkout's HEAD into a new scratch folder, the patches applied again):", "", *lines, ""]


def run_command(r: dict, folders: dict[str, str]) -> str:
    """The `run` command line that writes record `r` (a reference run, ours, or one of our replays); `folders`:
    each reference implementation's clone."""
    label = r.get("label") or r["method"]
    impl = f"{r['method']}-on-ref" if " on " in label else r["method"]
    parts = ["python -m benchmarks.reference_runs run", impl]
    if impl.endswith("-ref") and not impl.endswith("-on-ref"):
        parts += [f"--repo {folders[impl]}", "--python venv/bin/python"]
    if not impl.startswith("fedmho"):
        parts.append(f"--dataset {r['dataset']}")
    local_epochs, epochs = budget_order(r["budget"])
    parts += [f"--seed {r['seed']}", f"--local-epochs {local_epochs}", f"--epochs {epochs}"]
    if ", our decoders" in label:
        parts.append("--ref-roles classifier")
    elif ", our classifiers" in label:
        parts.append("--ref-roles decoder")
    if "random 80 % filter" in label:
        parts.append("--random-filter")
    if r.get("probe_sets") is not None:
        parts += [f"--set {shell_word(item)}" for item in r["probe_sets"]]
    if r.get("probe_ref_seed") is not None:
        parts.append(f"--ref-seed {r['probe_ref_seed']}")
    if r.get("probe_sets") is not None or r.get("probe_ref_seed") is not None:
        parts.append(f"--label {shell_word(label[len(r['method']) + 2:-1])}")
    return " ".join(parts)


def shell_word(text: str) -> str:
    """`text` as one shell word a reader can copy: as it is, in double quotes (TOML strings keep their single
    quotes readable), or shlex's quoting where double quotes would expand something."""
    if shlex.quote(text) == text:
        return text
    return f'"{text}"' if not set(text) & set('"$`\\!') else shlex.quote(text)


def reproduce(records: list[dict]) -> list[str]:
    """How to rerun every row of the table from fresh clones of the reference repositories."""
    rows = latest(records)
    commits, folders = {}, {}
    for r in sorted(records, key=lambda r: r.get("recorded_at", "")):
        if r.get("reference"):
            commits[r["reference"]["repo"]] = r["reference"]["commit"]
            folders[r["method"]] = r["reference"]["repo"].split("/")[-1]
    if not rows:
        return []
    lines = ["## How to reproduce", "",
             "From this checkout, with the data where `ONESHOT_FL_DATA_DIR` says, one thread "
             "(`OMP_NUM_THREADS=1`); the reference runs copy their commit into a scratch folder "
             "(`ONESHOT_FL_REF_SCRATCH`, default /tmp/oneshot-fl-refs) and patch the copy, never the clone:", "",
             "```"]
    for repo, commit in sorted(commits.items()):
        folder = repo.split("/")[-1]
        lines += [f"git clone https://github.com/{repo} {folder} && git -C {folder} checkout {commit}"]
    lines += ["python3 -m venv venv && venv/bin/pip install torch==2.14.1 torchvision==0.29.1 "
              + " ".join(REFERENCE_PACKAGES)]
    order = {m: k for k, m in enumerate(("dense-ref", "dense", "fedmho-md-ref", "fedmho-md"))}
    keys = sorted(rows, key=lambda k: (k[1], k[2], budget_order(k[3]), " on " in k[0], order.get(k[0], 9), k[0]))
    lines += [run_command(rows[k], folders) for k in keys]
    return lines + ["```", "",
                    "A replay (`X-on-ref`) reads the uploads of the reference run and of our run of its cell, so it "
                    "comes after both.", ""]


def render(path: Path | None = None) -> str:
    records = load_records(TABLE)
    versions = sorted({r.get("code_version", "?") for r in records})
    text = "\n".join([
        "# reference_runs",
        "",
        "The authors' code and ours on the same partition (NIID-Bench Dirichlet 0.5, our partitioner and seed: the "
        "`partition` column is a digest of the client index lists both ran) at the same budget (`budget`: E local "
        "epochs, T distillation / fusion epochs). Test accuracy %: clients (each client's local model), the "
        "clients' mean-logit ensemble, the start (FedMHO: w0, the averaged classifiers; DENSE's code: the FedAvg "
        "model it prints, not its student's start), the global model after the last epoch (final) and its best "
        "epoch. Rows `X on X-ref ...` replay our server method X on the reference run's uploads (all, or one "
        "role's, the others ours): they train no client, and their `local s` are the kept clients' own. Seconds: "
        "wall time on one thread of a shared 2-core CPU (server: everything after the clients' training, their "
        "script's start-up and data loading included; local: the clients' phase, for a reference its wall time "
        "(FedMHO's 10 worker processes share the one core, DENSE's clients train in turn), for ours the sum of "
        "the clients' training seconds). Written by "
        "`python -m benchmarks.reference_runs render` from benchmarks/results/reference_runs.jsonl.",
        "",
        *side_by_side(records),
        "",
        "Budgets. DENSE `E{e}-T{t}`: their README's commands (pretrain: SGD 0.01, batch 128; distillation: "
        f"`{' '.join(DENSE_KD_ARGS)}`) with `--local_ep e` and `--epochs t`, the reference's own client model "
        "(CNNMnist = our cnn2, CNNCifar = our cnn3); ours at those values where it has the knob (run config in the "
        "records' overrides). FedMHO `E{e}-T{t}`: 5 classifier clients (VGG-9 at 1/4 width = our vgg9-small, SGD 0.01, "
        "batch 64, e epochs) + 5 CVAE-small clients (latent 2, Adam 5e-2, 30 epochs, Table III), N_syn 6,000, "
        "R_th 0.8, fusion Adam 1e-5, batch 64, t epochs (Table III: 10), one round.",
        "",
        *seed_noise(records),
        *chance_noise(records),
        *decomposition(records),
        *budget_curves(records),
        *failures(load_records(FAILURES)),
        *reruns(records),
        *reproduce(records),
        *cost_lines(),
        "## What differs between the two codes at these settings",
        "",
        *[f"- {method}: {line}" for method, lines in DIFFERENCES.items() for line in lines],
        "",
        "## What was patched in the reference code, and why",
        *patch_list(records),
        "",
        f"Code: {', '.join(versions) or 'none'}.",
        "",
    ])
    out = path or RESULTS_DIR / f"{TABLE}.md"
    out.write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    from oneshot_fl.logs import setup_logging

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="one implementation on one cell")
    run.add_argument("impl", choices=["dense-ref", "dense", "fedmho-md-ref", "fedmho-md", "dense-on-ref",
                                      "fedmho-md-on-ref"],
                     help="X-on-ref: our server method X replayed on the X-ref run's client uploads of the cell")
    run.add_argument("--repo", help="a checkout of the reference repository (reference implementations)")
    run.add_argument("--python", default=sys.executable, help="the interpreter that runs the reference code")
    run.add_argument("--dataset", default="mnist", choices=sorted(DENSE_MODEL))
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--num-clients", type=int, default=5)
    run.add_argument("--local-epochs", type=int, default=5)
    run.add_argument("--epochs", type=int, default=10, help="distillation (DENSE) or fusion (FedMHO) epochs")
    run.add_argument("--synthetic-samples", type=int, default=6000, help="FedMHO's N_syn")
    run.add_argument("--ref-roles", default="all", choices=["all", "classifier", "decoder"],
                     help="X-on-ref: which uploads are the reference's (the others stay ours)")
    run.add_argument("--random-filter", action="store_true",
                     help="fedmho-md-on-ref: keep a random 80 %% of each class, as FedMHO's code does")
    run.add_argument("--set", action="append", default=[], help="extra run-config overrides of ours (a probe: needs "
                     "--label)")
    run.add_argument("--label", help="a probe of ours (dense, fedmho-md) with --set, or of theirs with --ref-seed: a "
                     "row of its own, '<impl> (<label>)', and a run folder of its own, beside the cell's row")
    run.add_argument("--ref-seed", type=int, help="a reference run's own seed (their init and random streams; default "
                     "--seed) on the cell's partition: a probe of theirs (needs --label)")
    sub.add_parser("render", help="write benchmarks/results/reference_runs.md from the records")
    sub.add_parser("cost", help="time one generator and one local step of the DENSE cells' models")
    args = parser.parse_args(argv)
    if args.command == "render":
        print(render())
        return 0
    if args.command == "cost":
        return command_cost(args)
    if args.impl in ("dense-ref", "fedmho-md-ref") and not (args.repo and Path(args.repo, ".git").exists()):
        print(f"oneshot-fl: error: {args.impl} needs --repo, a git checkout of the reference repository",
              file=sys.stderr)
        return 1
    if args.set and args.impl in ("dense", "fedmho-md") and not args.label:
        print("oneshot-fl: error: --set changes our run: give it --label NAME, a row of its own (without one its "
              "record would replace the cell's row)", file=sys.stderr)
        return 1
    if args.ref_seed is not None and (args.impl not in ("dense-ref", "fedmho-md-ref") or not args.label):
        print("oneshot-fl: error: --ref-seed retrains a reference run (dense-ref, fedmho-md-ref) with other draws: "
              "give it --label NAME, a row of its own (without one its record would replace the cell's row)",
              file=sys.stderr)
        return 1
    probed = ("dense", "fedmho-md") + (("dense-ref", "fedmho-md-ref") if args.ref_seed is not None else ())
    if args.label and (" on " in args.label or args.impl not in probed):
        print(f"oneshot-fl: error: --label names a probe of our dense or fedmho-md runs, or of a reference run with "
              f"--ref-seed (without ' on ', which names a replay), not of {args.impl}: {args.label!r}", file=sys.stderr)
        return 1
    setup_logging()
    logging.getLogger("oneshot_fl.bench").setLevel(logging.INFO)
    return command_run(args)


if __name__ == "__main__":
    sys.exit(main())
