"""Run configuration: Flower's flat run_config -> validated, typed dataclasses.

Config arrives once at the edge (ServerApp / ClientApp / replay CLI) and travels as these
frozen dataclasses; nothing below reads a Flower Context. Every check happens here, before
any work, and every error names the key, the bad value and what is allowed. This module does not
import torch (the dataset and model registries do, in the functions that need them), so a config
error comes in about a second.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import shlex
import tomllib
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from oneshot_fl.errors import ConfigError, FleetNotSupported  # noqa: F401 (re-exported)
from oneshot_fl.paper_settings import LARGE_CVAE_LR, PAPER_BATCH, PAPER_CVAE
from oneshot_fl.paths import DATA_DIR_ENV, OUTPUT_DIR_ENV
from oneshot_fl.presets import NO_CAP, PER_DATASET_KEYS, PRESET_KEYS, PRESETS, apply_preset, per_dataset_table

PROJECT_ROOT = Path(__file__).resolve().parents[1]




def knob(default: Any, *, choices: tuple | None = None, lo: float | None = None,
         hi: float | None = None, lo_open: bool = False):
    """A dataclass field with validation metadata (choices, inclusive range or open lower bound)."""
    return field(default=default, metadata={"choices": choices, "lo": lo, "hi": hi, "lo_open": lo_open})


def _coerce(key: str, value: Any, typ: type) -> Any:
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ConfigError(f"{key}={value!r}: expected true or false")
    if typ is int:
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or int(value) != value):
            raise ConfigError(f"{key}={value!r}: expected an integer")
        if not -2**63 <= int(value) < 2**63:  # TOML's and Flower's ConfigRecord's integers are 64-bit
            raise ConfigError(f"{key}={value!r}: expected an integer within 64 bits")
        return int(value)
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: expected a number")
        if not math.isfinite(value):  # nan passes every range check (all its comparisons are false)
            raise ConfigError(f"{key}={value!r}: expected a finite number")
        return float(value)
    if typ is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: expected a string (quote it: {key}='...')")
        return value
    raise TypeError(f"unsupported config field type {typ}")


def _check(key: str, value: Any, meta: Mapping[str, Any]) -> None:
    choices = meta.get("choices")
    if choices is not None and value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {allowed}")
    lo, hi = meta.get("lo"), meta.get("hi")
    if lo is not None and (value <= lo if meta.get("lo_open") else value < lo):
        bound = f"> {lo}" if meta.get("lo_open") else f">= {lo}"
        raise ConfigError(f"{key}={value!r} is out of range: must be {bound}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key}={value!r} is out of range: must be <= {hi}")


def parse_section(flat: Mapping[str, Any], prefix: str, cls: type):
    """Build dataclass `cls` from the keys `<prefix><field-name>` of a flat run config."""
    types = typing.get_type_hints(cls)
    values = {}
    for fld in dataclasses.fields(cls):
        name, typ = fld.name, types[fld.name]
        key = prefix + name.replace("_", "-")
        value = _coerce(key, flat.get(key, fld.default), typ)
        _check(key, value, fld.metadata)
        values[name] = value
    return cls(**values)


def section_keys(prefix: str, cls: type) -> set[str]:
    return {prefix + f.name.replace("_", "-") for f in dataclasses.fields(cls)}


LOCAL_LOSSES = ("ce", "fedlmd", "fedlmd-tf")
AUGMENTATIONS = ("none", "crop-flip")


@dataclass(frozen=True)
class LocalConfig:
    """Client-side training (SGD)."""

    epochs: int = knob(1, lo=1)
    batch_size: int = knob(128, lo=1)
    lr: float = knob(0.01, lo=0.0, lo_open=True)
    momentum: float = knob(0.9, lo=0.0, hi=1.0)
    weight_decay: float = knob(0.0, lo=0.0)
    max_samples: int = knob(-1, lo=-1)  # -1 = the whole shard
    loss: str = knob("ce", choices=LOCAL_LOSSES)  # FedLMD label masking: oneshot_fl/local/losses.py
    lmd_beta: float = knob(1.0, lo=0.0)  # weight of the label-masked KL (FedLMD code default 1)
    lmd_tau: float = knob(1.0, lo=0.0, lo_open=True)  # its temperature (FedLMD code default 1)
    lmd_round1: str = knob("tf", choices=("tf", "init"))  # fedlmd teacher before any global model exists
    init: str = knob("shared", choices=("shared", "independent"))  # one seeded init per architecture, or per client
    augment: str = knob("none", choices=AUGMENTATIONS)  # crop-flip: random 4-pixel-padded crop + horizontal flip
    # the clients' training draws (batch order, crops and flips, dropout, a CVAE's noise); another value retrains the
    # same fleet (partition, init, test subset) with other draws: how far clients move by chance alone
    stream: int = knob(0, lo=0)
    # the clients' initial weights (the shared classifier init, each CVAE's init); another value starts the same fleet
    # (partition, training draws) from another init: with local.stream, every random draw of a client is another
    init_draw: int = knob(0, lo=0)

    def __post_init__(self):
        if self.max_samples == 0:
            raise ConfigError("local.max-samples=0 after the preset: use -1 for no cap or a positive cap")


@dataclass(frozen=True)
class DPConfig:
    """Differentially private clients (local.dp.*; oneshot_fl/local/dp.py): each classifier client trains with
    DP-SGD and releases its label histogram through the Gaussian mechanism, both inside one (epsilon, delta)."""

    epsilon: float = knob(0.0)  # the client's privacy budget for its one upload; 0 = DP off
    epochs: int = knob(1, lo=1)  # DP-SGD passes over the shard (a DP client's local.epochs)
    delta: float = knob(1e-5)
    max_grad_norm: float = knob(1.0)  # DP-SGD's per-example clipping norm C

    def __post_init__(self):
        if self.epsilon < 0:
            raise ConfigError(f"local.dp.epsilon={self.epsilon!r}: the privacy budget must be >= 0 "
                              "(0 = DP off; e.g. 1, 3 or 8)")
        if not 0 < self.delta < 1:
            raise ConfigError(f"local.dp.delta={self.delta!r}: must lie in (0, 1), and well below 1 / (a client's "
                              "number of examples), e.g. 1e-5")
        if self.max_grad_norm <= 0:
            raise ConfigError(f"local.dp.max-grad-norm={self.max_grad_norm!r}: the per-example gradient clipping "
                              "norm must be > 0 (e.g. 1.0)")

    @property
    def enabled(self) -> bool:
        return self.epsilon > 0


@dataclass(frozen=True)
class CVAEConfig:
    """Local training of a resource-constrained client's CVAE (FedMHO, FedCVAE); Adam.

    epochs -1 and lr 0 mean the FedMHO paper's value for the dataset, lr 0 and batch-size 0 the recipe's (FedMHO's,
    or a DP decoder client's: PRIVATE_CVAE); `resolve_cvae_settings` resolves them.
    """

    arch: str = knob("")  # "" = cvae-mlp for 28px grey, cvae-conv for 32px colour
    latent_dim: int = knob(0, lo=0)  # 0 = the architecture's default (2 for cvae-mlp, 20 otherwise)
    kl_weight: float = knob(1.0, lo=0.0)
    epochs: int = knob(-1, lo=-1)
    lr: float = knob(0.0, lo=0.0)
    batch_size: int = knob(0, lo=0)

    def __post_init__(self):
        if self.epochs == 0:
            raise ConfigError("cvae.epochs=0 after the preset: use -1 for the paper's value or a positive count")
        if self.arch:
            from oneshot_fl.models.cvae import check_cvae_arch  # torch: only when an architecture is named

            check_cvae_arch(self.arch)


# A DP decoder client (DP-SGD on the whole CVAE): FedMHO's Adam 5e-2 at batch 64 diverges under the noise, and the
# decoders draw their classes better the larger the batch (the noise std on the mean gradient is sigma * C / batch,
# and sigma grows far slower than the batch at a fixed epsilon; Abadi et al., "Deep Learning with Differential
# Privacy", Sec. 5). Chosen on tuning decoders (MNIST NIID-Bench 0.5, seed 100, cvae-mlp, epsilon 8: a real-data
# classifier's accuracy on their samples, count-weighted, 19.7 % at FedMHO's recipe, 81.4 at batch 512, 91.9 at
# 2048, 95.3 here; 99.4 without DP): a batch near a client's whole shard.
PRIVATE_CVAE = {"lr": 4e-2, "batch_size": 4096}


@dataclass(frozen=True)
class CVAESettings:
    """CVAEConfig with every "paper default" resolved for one dataset."""

    arch: str
    latent_dim: int
    kl_weight: float
    epochs: int
    lr: float
    batch_size: int


def resolve_cvae_settings(cfg: CVAEConfig, dataset: str, input_shape: tuple[int, int, int],
                          private: bool = False) -> CVAESettings:
    """The CVAE settings of a decoder client: cfg's, its 0 / -1 placeholders as the paper's (`private`: a DP
    client's lr and batch from PRIVATE_CVAE, the paper's epochs)."""
    from oneshot_fl.models.cvae import default_cvae_arch, resolve_latent_dim  # torch: not for config errors

    arch = cfg.arch or default_cvae_arch(input_shape)
    paper = PAPER_CVAE[dataset]
    if private:
        lr, batch = cfg.lr or PRIVATE_CVAE["lr"], cfg.batch_size or PRIVATE_CVAE["batch_size"]
    else:
        lr, batch = cfg.lr or (LARGE_CVAE_LR if arch == "cvae-large" else paper["lr"]), cfg.batch_size or PAPER_BATCH
    epochs = cfg.epochs if cfg.epochs > 0 else paper["epochs"]
    return CVAESettings(arch, resolve_latent_dim(arch, cfg.latent_dim), cfg.kl_weight, epochs, lr, batch)


@dataclass(frozen=True)
class EvalConfig:
    """Central evaluation on the test set."""

    test_samples: int = knob(-1, lo=-1)  # -1 = the whole test set
    batch_size: int = knob(512, lo=1)


@dataclass(frozen=True)
class DistillConfig:
    """The shared data-free distillation engine (generator + student)."""

    epochs: int = knob(40, lo=1)
    generator_steps: int = knob(30, lo=1)
    synth_batch: int = knob(64, lo=2)
    nz: int = knob(256, lo=1)
    ngf: int = knob(32, lo=1)
    lr_generator: float = knob(1e-3, lo=0.0, lo_open=True)
    lr_student: float = knob(0.01, lo=0.0, lo_open=True)
    lr_schedule: str = knob("", choices=("", "constant", "cosine"))  # "" = the method's: distill_schedule
    temperature: float = knob(1.0, lo=0.0, lo_open=True)
    pool: str = knob("", choices=("", "paper", "growing", "capped"))  # "" = the method's: distill_schedule
    pool_max_batches: int = knob(40, lo=1)
    kd_steps: int = knob(20, lo=1)
    eval_every: int = knob(5, lo=1)
    reset_generator: bool = knob(False)


@dataclass(frozen=True)
class GPUConfig:
    """The fast path of a CUDA device (oneshot_fl/fastpath.py). A CPU run reads none of these: it runs float32."""

    bf16: bool = knob(True)  # forward passes (and their backward) under bfloat16 autocast
    device_data: bool = knob(True)  # shards, test set and synthetic pool held on the GPU
    channels_last: bool = knob(True)  # models in channels-last (NHWC) layout


PARTITIONS = ("dirichlet", "niid-bench", "2c/c", "iid")


@dataclass(frozen=True)
class RunConfig:
    """Everything a run needs, validated. `flat` keeps the resolved flat dict for results and
    for method sections (`<method>.*`), which each strategy parses with its own Params."""

    method: str
    preset: str
    seed: int
    rounds: int
    dataset: str
    partition: str
    alpha: float
    num_clients: int
    min_partition_size: int
    data_dir: str
    download: bool
    output_dir: str
    run_name: str
    model: str
    client_models: tuple[str, ...]
    server_model: str
    min_clients: int
    round_timeout: float
    node_wait_timeout: float
    threads: int
    server_threads: int
    save_uploads: bool
    local: LocalConfig
    cvae: CVAEConfig
    eval: EvalConfig
    distill: DistillConfig
    flat: dict = field(repr=False, compare=False)
    node_archs: tuple[str, ...] = ()  # architectures node configs may choose (the server accepts them too)
    upload_half: bool = False  # clients upload float16 parameters (half the bytes; accuracy cost: benchmarks.scale)
    dp: DPConfig = field(default_factory=DPConfig)  # local.dp.*: differentially private clients (epsilon 0 = off)
    gpu: GPUConfig = field(default_factory=GPUConfig)  # gpu.*: the fast path on CUDA devices
    requested: dict = field(default_factory=dict, repr=False, compare=False)  # the run config before the preset

    @property
    def required_clients(self) -> int:
        return self.min_clients or self.num_clients

    def arch_for(self, partition_id: int, node_config: Mapping[str, Any] | None = None) -> str:
        """The client architecture of one node: node config `arch` > client-models list > model."""
        from oneshot_fl.models.registry import check_arch  # torch: not for config errors

        if node_config and node_config.get("arch"):
            return check_arch(str(node_config["arch"]), "node config arch")
        if self.client_models:
            return self.client_models[partition_id % len(self.client_models)]
        return self.model

    @property
    def client_archs(self) -> set[str]:
        """The architectures the config assigns to clients (node config `arch` may still differ)."""
        return set(self.client_models) if self.client_models else {self.model}

    @property
    def global_arch(self) -> str:
        if self.server_model:
            return self.server_model
        archs = self.client_archs
        if len(archs) > 1:
            raise ConfigError(
                f"client-models={','.join(self.client_models)!r} is a heterogeneous fleet: "
                "set server-model (e.g. server-model='resnet18')"
            )
        return archs.pop()

    def method_section(self, method: str | None = None) -> dict[str, Any]:
        prefix = f"{method or self.method}."
        return {k: v for k, v in self.flat.items() if k.startswith(prefix)}


TOP_LEVEL_KEYS = {
    "method", "preset", "seed", "rounds", "dataset", "partition", "alpha", "num-clients",
    "min-partition-size", "data-dir", "download", "output-dir", "run-name", "model",
    "client-models", "server-model", "min-clients", "round-timeout", "node-wait-timeout",
    "threads", "server-threads", "save-uploads", "upload-half", "node-archs",
}


def _flatten(table: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in table.items():
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


@lru_cache(maxsize=1)
def default_run_config() -> dict[str, Any]:
    """The flat [tool.flwr.app.config] table of pyproject.toml (what Flower starts from)."""
    with open(PROJECT_ROOT / "pyproject.toml", "rb") as fh:
        table = tomllib.load(fh)["tool"]["flwr"]["app"]["config"]
    return _flatten(table)


def _suggest(key: str, known: Mapping[str, Any]) -> str:
    """`key` with the nearest known keys, or its section's keys, so a typo is a one-look fix."""
    close = difflib.get_close_matches(key, list(known), n=3, cutoff=0.6)
    if close:
        return f"{key} (did you mean {' or '.join(close)}?)"
    section = key.split(".")[0] + "." if "." in key else ""
    keys = sorted(k for k in known if (k.startswith(section) if section else "." not in k))
    return f"{key} (known{' ' + section + '* ' if section else ' top-level '}keys: {', '.join(keys) or 'none'})"


# Keys that were options once and lost to the defaults: refused by name, with what replaced them and where to
# read why (docs/decisions.md).
_FEDHYDRA_FIXED = "FedHydra's stages are fixed by fedhydra.mode ('robust' or 'paper')"
RETIRED = {
    **{f"fedhydra.{name}": _FEDHYDRA_FIXED for name in (
        "ms-batch", "ms-batched", "ms-score", "ms-stop-loss", "sa-space", "sa-route", "logit-cap", "peer-check",
        "peer-min-evidence", "peer-judges", "peer-power", "peer-reject-below", "peer-rejections", "peer-recognition",
        "peer-recognition-of", "peer-expel", "peer-expel-recognition", "bn-cap", "adv-mask")},
    "fedmho.kd-reduction": "FedMHO-MD / -SD distil with the FedMHO code's KL / C",
}
RETIRED_KEYS = tuple(RETIRED)


def _retired_message(keys: list[str]) -> str:
    by_reason: dict[str, list[str]] = {}
    for key in keys:
        by_reason.setdefault(RETIRED[key], []).append(key)
    return "; ".join(f"{', '.join(names)}: retired; {reason}" for reason, names in by_reason.items()) + \
        ", and docs/decisions.md says what each retired option did and why it went"


def merge_overrides(overrides: Mapping[str, Any], base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Defaults + overrides, rejecting keys the app does not have (as `flwr run` does)."""
    if retired := sorted(set(overrides) & set(RETIRED_KEYS)):
        raise ConfigError(_retired_message(retired))
    base = dict(default_run_config() if base is None else base)
    unknown = sorted(set(overrides) - set(base))
    if unknown:
        raise ConfigError("unknown run-config key(s): " + "; ".join(_suggest(key, base) for key in unknown))
    base.update(overrides)
    return base


def arch_list(text: str, key: str) -> tuple[str, ...]:
    """'cnn2,lenet' -> ('cnn2', 'lenet'). An empty entry is refused, not skipped: partition p takes entry
    p mod len, so 'cnn2,,lenet' read as two entries would give every client another architecture."""
    if not text.strip():
        return ()
    names = [name.strip() for name in text.split(",")]
    if "" in names:
        raise ConfigError(f"{key}={text!r} has an empty entry; list architectures separated by single commas")
    from oneshot_fl.models.registry import check_arch  # the registry imports torch: only when a list is given

    return tuple(check_arch(name, key) for name in names)


def run_name(name: str) -> str:
    """The run folder's name: one path component, or "" for the default. `output-dir` says where runs go;
    a name with a separator, "..", or an absolute path would write the run outside it."""
    if name and (name in (".", "..") or "/" in name or "\\" in name or name != name.strip()
                 or not name.isprintable() or len(name.encode()) > 255):
        raise ConfigError(f"run-name={name!r}: expected a folder name (no /, \\, ., .., surrounding spaces "
                          "or control characters; at most 255 bytes); output-dir says where the run goes")
    return name


def from_run_config(run_config: Mapping[str, Any]) -> RunConfig:
    """Validate Flower's run_config (pyproject defaults + overrides) and apply the preset."""
    # the dataset and model registries import torch (seconds): an unknown key (merge_overrides) fails before them
    from oneshot_fl.data.datasets import DATASETS
    from oneshot_fl.models.registry import check_arch

    flat = dict(run_config)
    requested = dict(flat)
    preset = _coerce("preset", flat.get("preset", "cpu"), str)
    _check("preset", preset, {"choices": tuple(PRESETS)})
    flat = apply_preset(flat, preset)

    def get(key, typ, default, **meta):
        value = _coerce(key, flat.get(key, default), typ)
        _check(key, value, meta)
        return value

    dataset = get("dataset", str, "mnist", choices=tuple(DATASETS))
    partition = get("partition", str, "dirichlet", choices=PARTITIONS)
    num_clients = get("num-clients", int, 5, lo=1)
    if partition != "iid" and num_clients < 2:
        raise ConfigError(f"num-clients={num_clients}: a non-IID partition needs at least 2 clients")
    model = get("model", str, "")
    model = check_arch(model, "model") if model else DATASETS[dataset].default_model
    client_models = arch_list(get("client-models", str, ""), "client-models")
    if len(client_models) > num_clients:  # partition p gets entry p mod len: the extra ones would never train
        raise ConfigError(f"client-models lists {len(client_models)} architectures for num-clients={num_clients}: "
                          "give one per client, or fewer (they repeat in turn)")
    node_archs = arch_list(get("node-archs", str, ""), "node-archs")
    server_model = get("server-model", str, "")
    if server_model:
        check_arch(server_model, "server-model")
    min_clients = get("min-clients", int, 0, lo=0)
    if min_clients > num_clients:
        raise ConfigError(f"min-clients={min_clients} is more than num-clients={num_clients}")
    method = get("method", str, "fedhydra")
    if not method:
        raise ConfigError("method is empty")

    cfg = RunConfig(
        method=method,
        preset=preset,
        seed=get("seed", int, 0, lo=0),
        rounds=get("rounds", int, 1, lo=1),
        dataset=dataset,
        partition=partition,
        alpha=get("alpha", float, 0.5, lo=0.0, lo_open=True),
        num_clients=num_clients,
        min_partition_size=get("min-partition-size", int, 10, lo=1),
        data_dir=get("data-dir", str, ""),
        download=get("download", bool, True),
        output_dir=get("output-dir", str, ""),
        run_name=run_name(get("run-name", str, "")),
        model=model,
        client_models=client_models,
        node_archs=node_archs,
        server_model=server_model,
        min_clients=min_clients,
        round_timeout=get("round-timeout", float, 3600.0, lo=0.0, lo_open=True),
        node_wait_timeout=get("node-wait-timeout", float, 600.0, lo=0.0),
        threads=get("threads", int, 0, lo=0),
        server_threads=get("server-threads", int, 0, lo=0),
        save_uploads=get("save-uploads", bool, True),
        upload_half=get("upload-half", bool, False),
        local=parse_section(flat, "local.", LocalConfig),
        dp=parse_section(flat, "local.dp.", DPConfig),
        cvae=parse_section(flat, "cvae.", CVAEConfig),
        eval=parse_section(flat, "eval.", EvalConfig),
        distill=parse_section(flat, "distill.", DistillConfig),
        gpu=parse_section(flat, "gpu.", GPUConfig),
        flat=flat,
        requested=requested,
    )
    if cfg.num_clients * cfg.min_partition_size > DATASETS[dataset].train_size:
        raise ConfigError(f"{dataset}'s {DATASETS[dataset].train_size} training images cannot give num-clients="
                          f"{cfg.num_clients} clients min-partition-size={cfg.min_partition_size} each: "
                          "lower one of them")
    cfg.global_arch  # noqa: B018 - raises early for heterogeneous fleets without server-model
    if cfg.rounds > 1 and cfg.client_archs != {cfg.global_arch}:
        # the global model goes back to every client as its starting point (FedHydra D18)
        raise ConfigError(
            f"rounds={cfg.rounds}: multi-round mode sends the global model back to the clients, so every "
            f"client must train the server's architecture; got clients {','.join(sorted(cfg.client_archs))} "
            f"and server-model {cfg.global_arch}. Use rounds=1 for heterogeneous fleets")
    if cfg.dp.enabled:
        check_dp_run(cfg)
    return cfg


def check_dp_run(cfg: RunConfig) -> None:
    """What a differentially private run (local.dp.epsilon > 0) cannot do, refused before any work: more than
    one upload per client, a local loss that reads the client's whole label histogram, BatchNorm clients."""
    eps = f"local.dp.epsilon={cfg.dp.epsilon:g}"
    if cfg.rounds > 1:
        raise ConfigError(f"{eps} with rounds={cfg.rounds}: a client's guarantee covers its one upload, and "
                          "T rounds would compose T uploads; DP runs are one-shot (rounds=1)")
    if cfg.local.loss != "ce":
        raise ConfigError(f"{eps} with local.loss={cfg.local.loss!r}: FedLMD's label mask depends on the client's "
                          "whole label histogram, so one example can change every other example's gradient, which "
                          "DP-SGD's per-example clipping does not bound; use local.loss='ce'")
    from oneshot_fl.models.registry import check_dp_arch  # torch and Opacus: only DP runs pay for them

    if cfg.client_models:
        for arch in cfg.client_models:
            check_dp_arch(arch, "client-models entry", cfg.dataset)
    else:
        check_dp_arch(cfg.model, "model", cfg.dataset, default=not cfg.requested.get("model"))
    for arch in cfg.node_archs:
        check_dp_arch(arch, "node-archs entry", cfg.dataset)


def resolve_data_dir(cfg: RunConfig) -> Path:
    """data-dir > $ONESHOT_FL_DATA_DIR > ~/.cache/oneshot-fl/data, always absolute."""
    raw = cfg.data_dir or os.environ.get(DATA_DIR_ENV) or str(Path.home() / ".cache" / "oneshot-fl" / "data")
    return Path(raw).expanduser().resolve()


def resolve_output_dir(cfg: RunConfig) -> Path:
    raw = cfg.output_dir or os.environ.get(OUTPUT_DIR_ENV) or "runs"
    return Path(raw).expanduser().resolve()


# Knobs whose pyproject value is a placeholder the run resolves ("0 = preset", "-1 = the paper's value / no cap",
# '"" = the default'): resolved_config replaces each with the value the run used. The preset's keys come on top.
PLACEHOLDER_KEYS = frozenset(PRESET_KEYS | {
    "data-dir", "output-dir", "run-name", "model", "server-model", "min-clients", "threads", "server-threads",
    "cvae.arch", "cvae.latent-dim", "cvae.lr", "cvae.batch-size", "fedmho.constrained-clients", "fedmho.lr",
    "fedcvae.lr", "distill.pool", "distill.lr-schedule",
})


def resolved_config(cfg: RunConfig, *, run_dir: Path | None = None, test_samples: int | None = None,
                    server_threads: int | None = None, threads: int | None = None
                    ) -> tuple[dict[str, Any], dict[str, str]]:
    """The flat run config with every placeholder replaced by the value the run uses (result.json `config`).

    The preset is already applied (cfg.flat); on top: PER_DATASET values from the paper tables for the run's
    dataset, "no cap" sizes as the size they stand for (local.max-samples: the training set, so no shard is
    capped; eval.test-samples: `test_samples`, the test set evaluated), "" / 0 defaults as what they pick (model,
    server-model, CVAE architecture and latent size, min-clients, the data folder, the server's torch threads; output
    folder and run name as the run folder `run_dir` the run writes; `threads` where this process knows what 0 stood
    for). Returns (config, unresolved): `unresolved` names the placeholders this process cannot resolve and why
    (threads=0 in a run with clients: every ClientApp takes its own node's cores)."""
    from oneshot_fl.data.datasets import DATASETS  # torch: not for config errors

    info = DATASETS[cfg.dataset]
    out = dict(cfg.flat)
    unresolved: dict[str, str] = {}
    out.update({"model": cfg.model, "server-model": cfg.global_arch, "min-clients": cfg.required_clients,
                "data-dir": str(resolve_data_dir(cfg))})
    if not cfg.output_dir:
        out["output-dir"] = str(Path(run_dir).resolve().parent if run_dir else resolve_output_dir(cfg))
    if not cfg.run_name:
        if run_dir:
            out["run-name"] = Path(run_dir).name
        else:
            unresolved["run-name"] = "the run folder is named when the run starts"
    if not cfg.threads and threads:
        out["threads"] = int(threads)
    elif not cfg.threads:
        unresolved["threads"] = "0: every ClientApp sets torch threads to its own node's cores"
    if not cfg.server_threads:
        if server_threads:
            out["server-threads"] = int(server_threads)
        else:
            unresolved["server-threads"] = "0: the ServerApp takes all cores of its machine"
    if cfg.local.max_samples == NO_CAP:
        out["local.max-samples"] = info.train_size  # a cap no shard can reach: the whole shard
    if cfg.eval.test_samples == NO_CAP:
        if test_samples:
            out["eval.test-samples"] = int(test_samples)
        else:
            unresolved["eval.test-samples"] = "-1: the whole test set (its size is known once it is loaded)"
    cvae = resolve_cvae_settings(cfg.cvae, cfg.dataset, info.input_shape, private=cfg.dp.enabled)
    out.update({"cvae.arch": cvae.arch, "cvae.latent-dim": cvae.latent_dim, "cvae.epochs": cvae.epochs,
                "cvae.lr": cvae.lr, "cvae.batch-size": cvae.batch_size})
    for key in PER_DATASET_KEYS:  # the methods' (fedmho.*, fedcvae.*): -1 epochs, 0 lr = the paper's value
        if key.startswith("cvae.") or key not in out:
            continue
        if out[key] <= 0:  # as DecoderFusion.supervised_settings and resolve_cvae_settings read it (0 epochs too)
            out[key] = per_dataset_table(key)[cfg.dataset]
    if "fedmho.constrained-clients" in out:
        out["fedmho.constrained-clients"] = constrained_clients(out["fedmho.constrained-clients"], cfg.num_clients)
    out["distill.pool"], out["distill.lr-schedule"] = distill_schedule(cfg)
    return out, unresolved


def distill_schedule(cfg: RunConfig) -> tuple[str, str]:
    """(pool policy, student LR schedule) of the run's distillation: distill.pool and distill.lr-schedule as set,
    "" the method's. FedHydra's paper mode trains the student as published (FedHydra Alg. 1: one student step
    per epoch, on that epoch's synthetic batch, at a constant rate); every other run the capped pool (kd-steps
    random batches of the last pool-max-batches per epoch) under the cosine decay."""
    paper = cfg.method == "fedhydra" and cfg.flat.get("fedhydra.mode") == "paper"
    return (cfg.distill.pool or ("paper" if paper else "capped"),
            cfg.distill.lr_schedule or ("constant" if paper else "cosine"))


def constrained_clients(requested: int, num_clients: int) -> int:
    """FedMHO's resource-constrained client count: -1 = half the fleet (K // 2), as in the paper's Table IV."""
    return num_clients // 2 if requested < 0 else requested


def placeholder_changes(cfg: RunConfig, resolved: Mapping[str, Any]) -> dict[str, Any]:
    """{key: requested value} for every key whose recorded value differs from what the run config asked
    (result.json `config_requested`: the placeholders as given, and the preset's keys left to it)."""
    return {key: cfg.requested[key] for key, value in resolved.items()
            if key in cfg.requested and cfg.requested[key] != value}


# --- run-config text: what -c / --run-config take, read by tomllib ------------------------------------------

def toml_value(value: Any) -> str:
    """A Python value as a TOML literal for --run-config."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


def run_config_items(overrides: Mapping[str, Any]) -> list[str]:
    """{key: value} -> ['key=<TOML literal>', ...], what --run-config (and a replay's -c) reads back."""
    return [f"{k}={toml_value(v)}" for k, v in overrides.items()]


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """--run-config values ('k=v k2=v2' strings or TOML files) -> flat dict.

    A string holds TOML key/value pairs separated by whitespace, as `flwr run --run-config` takes them; every key and
    value is read by tomllib (`run_config_pairs`), so what TOML accepts is accepted (spaces around '=', dotted and
    quoted keys, every string and number form), and what it refuses ends in one line with a fix that parses.
    Items are parsed one by one and merged key by key: flwr's own merge replaces a whole table, so
    ["feddf.source='dataset'", "feddf.lr=0.1"] would silently lose feddf.source.
    """
    merged: dict[str, Any] = {}
    for item in items:
        if not item.endswith(".toml"):
            merged.update(run_config_pairs(item))
            continue
        try:  # as `flwr run --run-config file.toml` reads it: the file's tables flattened to dotted keys
            with Path(item).expanduser().open("rb") as fh:
                merged.update(_flatten(tomllib.load(fh)))
        except OSError:  # a TOML file that is not there: the caller's one-line error says which
            raise
        except tomllib.TOMLDecodeError as exc:  # a malformed file (the error names the line)
            raise ConfigError(f"cannot parse run config file {item}: {exc}") from None
    return merged


def _toml_key(text: str) -> str | None:
    """A TOML key ('alpha', 'local.epochs', 'local . epochs', '"odd key"') as its flat dotted name, else None."""
    if not text.strip() or "\n" in text:
        return None
    try:
        table = tomllib.loads(f"{text} = 0")
    except tomllib.TOMLDecodeError:
        return None
    flat = _flatten(table)
    return next(iter(flat)) if len(flat) == 1 else None


def _starts_pair(text: str) -> bool:
    """Whether `text` begins with a TOML key and '=' (the next pair of a run-config string)."""
    eq = text.find("=")
    return eq > 0 and _toml_key(text[:eq]) is not None


def _boundaries(text: str, start: int) -> list[int]:
    """Where a value that begins at `start` may end: before each whitespace run, and at the end."""
    return [i for i in range(start + 1, len(text)) if text[i].isspace() and not text[i - 1].isspace()] + [len(text)]


def _read_value(text: str, start: int) -> tuple[bool, Any, int]:
    """(found, value, end) of the TOML value at `start`: the shortest text up to a whitespace that tomllib reads as
    one value and after which the next pair (or nothing) follows; else the shortest that reads at all."""
    first = None
    for end in _boundaries(text, start):
        try:
            table = tomllib.loads(f"v = {text[start:end]}")
        except tomllib.TOMLDecodeError:
            continue
        if list(table) != ["v"]:
            continue
        if end == len(text) or _starts_pair(text[end:].lstrip()):
            return True, table["v"], end
        first = first or (True, table["v"], end)
    return first or (False, None, start)


def _literal(value: Any) -> str:
    """A value as TOML inside a double-quoted -c "...": strings in single quotes where they can be."""
    if isinstance(value, str) and "'" not in value and "\n" not in value:
        return f"'{value}'"
    return toml_value(value)


def _owner_of(name: str) -> str | None:
    """The run-config key a bare name is a value of ('mnist' -> 'dataset'), None when the core does not know it (a
    method's name, a typo: the methods are the strategies' registry, above this module)."""
    from oneshot_fl.data.datasets import DATASETS

    for key, names in (("dataset", DATASETS), ("partition", PARTITIONS), ("preset", PRESETS)):
        if name in names:
            return key
    return None


def _value_fix(key: str, raw: str) -> tuple[str, Any]:
    """(what is wrong, a value that parses) for a value tomllib refused, by the type of the key's default: the value
    meant where it can be told (quotes added or balanced, a number or boolean written as TOML writes it), else the
    default, named as such. What is wrong is "" for a string that only lacks its quotes."""
    default = default_run_config().get(key)
    bare = raw.strip().strip("'\"").strip()
    shown = f"{key}={raw}"
    if isinstance(default, bool) or (default is None and bare.lower() in ("true", "false")):
        if bare.lower() in ("true", "false"):
            return f"{shown} is not true or false as TOML writes them", bare.lower() == "true"
        return f"{shown}: {key} takes true or false (its default: {toml_value(default)})", default
    if isinstance(default, (int, float)) or default is None:
        try:
            number = float(bare.replace("_", ""))
        except ValueError:
            number = None
        if number is not None and math.isfinite(number):
            integral = (isinstance(default, int) or "." not in bare) and number == int(number)
            return f"{shown} is not a number as TOML writes it", int(number) if integral else number
        if default is not None:
            what = f"{key} has no value" if not bare else f"{shown} is not a number"
            return f"{what} (its default: {toml_value(default)})", default
    if not bare:
        return f"{key} has no value" + (f" (its default: {_literal(default)})" if default is not None else ""), \
            default if default is not None else ""
    return "", bare


def run_config_pairs(item: str) -> dict[str, Any]:
    """One -c string -> {flat key: value}. Pairs are separated by whitespace; each key and value is read by tomllib.
    Whatever it cannot read is refused in one line ending in the whole string with every part fixed (`(e.g. -c
    "...")`, left out when a part has no fix): a value with the quotes it lacked (or balanced), a number or boolean
    as TOML writes it, a bare name as the pair it is a value of; where only the type is known, the key's default."""
    pairs: dict[str, Any] = {}
    quotes: list[str] = []  # string values that only lack their quotes: the message of the common case
    problems: list[str] = []
    fixed: list[str] = []
    fixable, twice, pos = True, [], 0
    while True:
        while pos < len(item) and item[pos].isspace():
            pos += 1
        if pos >= len(item):
            break
        eq = item.find("=", pos)
        key = _toml_key(item[pos:eq]) if eq > pos else None
        if key is None:  # a bare word, or '=' with no key before it
            end = next((i for i in range(pos, len(item)) if item[i].isspace()), len(item))
            word, pos = item[pos:end], end
            name = word.strip("'\"").lstrip("=").strip("'\"")
            owner = _owner_of(name) if name else None
            if name in default_run_config():  # a key without '=' and value
                problem, value = _value_fix(name, "")
                problems.append(f"{word!r} is not a key=value pair: {problem}")
                fixed.append(f"{name}={_literal(value)}")
            elif owner is not None:
                problems.append(f"{word!r} is not a key=value pair ({name} is a {owner})")
                fixed.append(f"{owner}={_literal(name)}")
            elif re.fullmatch(r"[A-Za-z][A-Za-z0-9_-]*", name):  # a word, perhaps a method's name
                problems.append(f"{word!r} is not a key=value pair (method={_literal(name)} if it names a method; "
                                "oneshot-fl list keys shows every key)")
                fixed.append(f"method={_literal(name)}")
            else:
                problems.append(f"{word!r} is not a key=value pair (oneshot-fl list keys shows every key)")
                fixable = False
            continue
        if key in pairs:
            twice.append(key)
        start = eq + 1
        while start < len(item) and item[start] in " \t":
            start += 1
        found, value, end = (False, None, start) if start > eq + 1 and _starts_pair(item[start:]) \
            else _read_value(item, start)
        if found:
            pairs[key] = value
            fixed.append(f"{key}={_literal(value)}")
            pos = end
            continue
        if not (start > eq + 1 and _starts_pair(item[start:])):  # else: no value before the next pair
            end = next((i for i in range(start, len(item)) if item[i].isspace()), len(item))
            if item[start:start + 1] in ("'", '"') and not item[start + 1:end].endswith(item[start]):
                # an unclosed quote: the value runs on to the next pair (or the end)
                end = next(i for i in _boundaries(item, start) if i == len(item) or _starts_pair(item[i:].lstrip()))
        problem, value = _value_fix(key, item[start:end])
        if problem:
            problems.append(problem)
        else:
            quotes.append(f"{key}={_literal(value)}")
            problems.append(f"{key}={item[start:end]} needs quotes")
        fixed.append(f"{key}={_literal(value)}")
        pos = end
    if twice:  # TOML refuses a repeated key; across -c items the later one wins
        raise ConfigError(f"cannot parse run config {item!r}: {', '.join(sorted(set(twice)))} given twice in one "
                          "string (a later -c may override an earlier one)")
    if not problems:
        out: dict[str, Any] = {}
        for key, value in pairs.items():
            out.update(_flatten(value, f"{key}.") if isinstance(value, Mapping) else {key: value})
        return out
    text = " ".join(fixed)
    shown = f'"{text}"' if not set(text) & set('"$`\\!') else shlex.quote(text)
    example = f" (e.g. -c {shown})" if fixable else ""
    if len(quotes) == len(problems):
        raise ConfigError(f"string values need quotes: {' '.join(quotes)}{example}")
    raise ConfigError(f"cannot parse run config {item!r}: {'; '.join(problems)}{example}")


# --- what each key means: the comments of pyproject.toml's [tool.flwr.app.config], the one place ---------------

CONFIG_TABLE = "tool.flwr.app.config"


def _comment_start(line: str) -> int | None:
    """Where the comment of a `key = value  # comment` line begins: the first '#' before which the line reads as
    TOML (a '#' inside a string value is not one); None without a comment."""
    for pos in (i for i, char in enumerate(line) if char == "#"):
        try:
            tomllib.loads(line[:pos])
        except tomllib.TOMLDecodeError:
            continue
        return pos
    return None


@lru_cache(maxsize=1)
def run_config_help() -> dict[str, str]:
    """{flat key: one line of help} for every key of the run config, and {"<section>.": its help} for the sections
    that have a comment of their own: the comment beside each key in pyproject.toml's [tool.flwr.app.config]
    tables, joined with the comment lines that continue it below (indented to the same column). Those comments are
    the help: `oneshot-fl list keys` prints them, so the defaults and what they mean are written once."""
    help_text: dict[str, str] = {}
    section, key, column = None, None, None
    for line in (PROJECT_ROOT / "pyproject.toml").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            name = stripped.strip("[]").strip()
            section = name[len(CONFIG_TABLE):].lstrip(".") if name.startswith(CONFIG_TABLE) else None
            key, column = (f"{section}." if section else None), 0
            continue
        if section is None or not stripped:
            key = None
            continue
        prefix = f"{section}." if section else ""
        if stripped.startswith("#"):  # a comment line: continues the key's (or the section's) comment
            if key is not None and line.index("#") == column:
                help_text[key] = f"{help_text.get(key, '')} {stripped.lstrip('#').strip()}".strip()
            continue
        pos = _comment_start(line)
        table = tomllib.loads(line if pos is None else line[:pos])
        key = prefix + next(iter(_flatten(table)))
        column = pos
        help_text[key] = line[pos + 1:].strip() if pos is not None else ""
    return help_text


def run_config_key_lines() -> list[str]:
    """`oneshot-fl list keys`: per key of the run config, `key = <default as TOML>  # help`, under its section's
    comment where it has one; every line parses as TOML."""
    helps = run_config_help()
    lines: list[str] = []
    section = None
    for key, default in default_run_config().items():
        here = key.rsplit(".", 1)[0] + "." if "." in key else ""
        if here != section:
            section = here
            if helps.get(here):
                lines.append(f"# {here}*: {helps[here]}")
        lines.append(f"{key} = {toml_value(default)}  # {helps.get(key, '')}".rstrip(" #"))
    return lines
