"""Poisoned variants of a fleet's uploads archive: one client replaced, the rest byte-identical.

  honest   the archive as trained
  flip     the victim's classifier rows rolled by one: it answers y+1 wherever it would have answered y (a confident,
           wrong client; no retraining)
  random   the victim's model replaced by a fresh random initialisation
  scale10  every weight and bias of the victim multiplied by 10 (BN statistics kept)
  shuffled the victim retrained the way it was trained (same init, shard, batches) on its own shard with the labels
           shuffled among its samples: a trained model that knows no class, with the label counts it reports still
           true (costs one client training)
  minus    the victim left out (K-1 honest clients): the bar a method that ignores the poisoner would reach
The robustness table and the FedHydra ablation serve every method on these variants.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from benchmarks.fleets import uploads_id
from client_app.task import ClientJob, load_shard, start_model
from oneshot_fl.config import ConfigError, from_run_config
from oneshot_fl.data.datasets import DATASETS, Split
from oneshot_fl.devices import pick_device
from oneshot_fl.local.train import train_local
from oneshot_fl.models.registry import build
from oneshot_fl.seeding import torch_generator

VARIANTS = ("honest", "flip", "random", "scale10", "shuffled", "minus")


def classifier_keys(state: dict[str, torch.Tensor], num_classes: int) -> tuple[str, str | None]:
    """The last 2-D weight with one row per class (the classifier) and its bias."""
    weight = [k for k, v in state.items() if k.endswith("weight") and v.dim() == 2 and v.shape[0] == num_classes][-1]
    bias = weight[: -len("weight")] + "bias"
    return weight, bias if bias in state else None


def poisoned_state(state: dict[str, torch.Tensor], variant: str, arch: str, input_shape, num_classes: int,
                   seed: int) -> dict[str, torch.Tensor]:
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
