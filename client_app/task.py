"""What one client does with its shard, per upload role. Flower-free: the ClientApp calls these.

ROLE_TASKS maps an upload role to the function that trains and packs it:
  classifier  train the node's classifier, upload the whole model (every method)
  decoder     train a CVAE, upload only its decoder (FedMHO's resource-constrained clients, FedCVAE)
Node configs may name roles in FedMHO's words: role=sufficient (classifier), role=constrained (decoder).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from oneshot_fl.config import RunConfig, resolve_cvae_settings, resolve_data_dir
from oneshot_fl.data.datasets import DATASETS, Split, load_split, test_subset
from oneshot_fl.data.partition import label_counts, partition_indices
from oneshot_fl.devices import pick_device
from oneshot_fl.evaluation import evaluate
from oneshot_fl.fastpath import FastPath
from oneshot_fl.local.cvae import train_cvae, train_private_cvae
from oneshot_fl.local.dp import train_private
from oneshot_fl.local.losses import frozen_copy, make_local_loss
from oneshot_fl.local.train import cap_shard, train_local
from oneshot_fl.models.cvae import build_cvae
from oneshot_fl.models.registry import build, check_dp_arch, has_batchnorm
from oneshot_fl.seeding import derive_seed, torch_generator
from oneshot_fl.uploads import encode

log = logging.getLogger("oneshot_fl.client")


@dataclass(frozen=True)
class ClientJob:
    """One node's part of a run: its partition, architecture and the instruction's settings."""

    cfg: RunConfig
    partition_id: int
    arch: str
    instruction: dict
    global_state: dict[str, torch.Tensor] | None = None  # multi-round mode, rounds >= 2: the start point

    @property
    def round(self) -> int:
        return int(self.instruction.get("server-round", 1))


def load_shard(cfg: RunConfig, partition_id: int) -> Split:
    """This client's training shard: the seeded partition, capped by local.max-samples."""
    train = load_split(cfg.dataset, "train", str(resolve_data_dir(cfg)), cfg.download)
    shards = partition_indices(train.labels, cfg.partition, cfg.num_clients, cfg.alpha,
                               cfg.min_partition_size, derive_seed(cfg.seed, "partition"))
    shard = train.subset(shards[partition_id])
    return cap_shard(shard, cfg.local.max_samples, derive_seed(cfg.seed, "cap", partition_id))


def load_test(cfg: RunConfig) -> Split:
    test = load_split(cfg.dataset, "test", str(resolve_data_dir(cfg)), cfg.download)
    return test_subset(test, cfg.eval.test_samples, derive_seed(cfg.seed, "test-subset"))


def stream_names(cfg: RunConfig) -> tuple:
    """What local.stream adds to a client's training stream name: nothing at 0, so stream 0 is every earlier run's."""
    return () if cfg.local.stream == 0 else ("stream", cfg.local.stream)


def init_names(cfg: RunConfig) -> tuple:
    """What local.init-draw adds to an init's seed name: nothing at 0, so draw 0 is every earlier run's init."""
    return () if cfg.local.init_draw == 0 else ("draw", cfg.local.init_draw)


def start_model(job: ClientJob, info) -> torch.nn.Module:
    """Round 1: the seeded init, shared by every client of the architecture (parameter averaging
    needs a common start) unless local.init = "independent". Later rounds: the global model the
    server sent, which must be of this node's architecture."""
    cfg = job.cfg
    names = ("init", job.arch) if cfg.local.init == "shared" else ("init", job.arch, job.partition_id)
    model = build(job.arch, info.input_shape, info.num_classes, seed=derive_seed(cfg.seed, *names, *init_names(cfg)))
    if job.global_state is not None:
        sent_arch = job.instruction.get("global-arch")
        if sent_arch != job.arch:
            raise ValueError(f"round {job.round}: the server sent a {sent_arch!r} global model but this node "
                             f"trains {job.arch!r}; multi-round mode needs a homogeneous fleet")
        model.load_state_dict(job.global_state)
    return model


def train_classifier(job: ClientJob):
    """Train the node's classifier from its start model (seeded init or global model) and pack the upload."""
    cfg, pid = job.cfg, job.partition_id
    if cfg.dp.enabled:
        return train_private_classifier(job)
    info = DATASETS[cfg.dataset]
    device = pick_device()
    shard = load_shard(cfg, pid)
    counts = label_counts(shard.labels, info.num_classes)
    log.info("client p%d: %s on %d samples, label counts %s (round %d)", pid, job.arch, len(shard),
             counts.tolist(), job.round)
    model = start_model(job, info)
    # FedLMD's teacher: the global model received (round 1: none, or the init if lmd-round1 = "init")
    has_teacher = job.global_state is not None or cfg.local.lmd_round1 == "init"
    teacher = frozen_copy(model).to(device) if cfg.local.loss == "fedlmd" and has_teacher else None
    loss_fn, loss_name = make_local_loss(cfg.local, counts, teacher)
    log.info("client p%d: local loss %s", pid, loss_name)
    # round 1 keeps the one-shot stream; later rounds shuffle differently
    names = ("local", pid) if job.round == 1 else ("local", pid, "round", job.round)
    names += stream_names(cfg)
    start = time.perf_counter()
    fast = FastPath.for_device(device, cfg.gpu)
    if fast.on:
        log.info("client p%d: fast path on %s: %s", pid, device, fast.describe())
    stats = train_local(model, shard, cfg.local, device, torch_generator(cfg.seed, *names),
                        loss_fn=loss_fn, label=f"client p{pid}", fast=fast)
    train_seconds = time.perf_counter() - start
    accuracy = evaluate(model, load_test(cfg), info.num_classes, device, cfg.eval.batch_size).accuracy
    log.info("client p%d: local test accuracy %.4f", pid, accuracy)
    metrics = {"local-test-accuracy": accuracy, "train-seconds": train_seconds,
               "train-loss": stats.final_loss, "train-accuracy": stats.train_accuracy}
    return encode("classifier", job.arch, model.state_dict(), counts, pid, metrics,
                  half_precision=bool(job.instruction.get("half-precision", False)))


def train_private_classifier(job: ClientJob):
    """A differentially private client (local.dp.epsilon > 0; oneshot_fl/local/dp.py): DP-SGD from the seeded
    init, then an upload of the model, the noised label histogram and the guarantee, which covers both. No BN
    statistics (the architecture must be a DP one: checked before the shard is read) and no metric of the
    client's data (training loss and accuracy stay in this node's log)."""
    cfg, pid = job.cfg, job.partition_id
    check_dp_arch(job.arch, "node config arch" if job.arch not in cfg.client_archs else "model", cfg.dataset)
    info = DATASETS[cfg.dataset]
    device = pick_device()
    shard = load_shard(cfg, pid)
    counts = label_counts(shard.labels, info.num_classes)
    log.info("client p%d: %s on %d samples, label counts %s (kept here: the upload carries them noised)", pid,
             job.arch, len(shard), counts.tolist())
    model = start_model(job, info)
    result = train_private(model, shard, cfg.local, cfg.dp, counts, device, label=f"client p{pid}")
    if has_batchnorm(model):  # check_dp_arch refused these; a DP upload never carries running statistics
        raise RuntimeError(f"client p{pid}: {job.arch} has BatchNorm; a DP upload cannot carry its statistics")
    accuracy = evaluate(model, load_test(cfg), info.num_classes, device, cfg.eval.batch_size).accuracy
    log.info("client p%d: local test accuracy %.4f; uploaded label counts (noised) %s", pid, accuracy,
             result.label_counts.tolist())
    metrics = {"local-test-accuracy": accuracy, "train-seconds": result.stats.seconds}
    return encode("classifier", job.arch, model.state_dict(), result.label_counts, pid, metrics,
                  half_precision=bool(job.instruction.get("half-precision", False)),
                  extra=result.guarantee.to_meta())


def train_decoder(job: ClientJob):
    """Train a CVAE on the node's shard; upload only the decoder and the integer label counts (a DP client: DP-SGD,
    the noised counts and the guarantee)."""
    cfg, pid = job.cfg, job.partition_id
    info = DATASETS[cfg.dataset]
    settings = resolve_cvae_settings(cfg.cvae, cfg.dataset, info.input_shape, private=cfg.dp.enabled)
    device = pick_device()
    shard = load_shard(cfg, pid)
    counts = label_counts(shard.labels, info.num_classes)
    log.info("client p%d: %s (latent %d) on %d samples, label counts %s", pid, settings.arch,
             settings.latent_dim, len(shard), counts.tolist())
    model = build_cvae(settings.arch, info.input_shape, info.num_classes, settings.latent_dim,
                       seed=derive_seed(cfg.seed, "cvae-init", pid, *init_names(cfg)))
    extra: dict = {"latent-dim": settings.latent_dim}
    if cfg.dp.enabled:  # DP-SGD on the whole CVAE; the upload carries the noised histogram and the guarantee
        result = train_private_cvae(model, shard, settings, cfg.dp, counts, device, label=f"client p{pid}")
        counts, extra = result.label_counts, {**extra, **result.guarantee.to_meta()}
        metrics = {"train-seconds": result.stats.seconds}  # the ELBO terms are statistics of the data: they stay here
        log.info("client p%d: uploaded label counts (noised) %s", pid, counts.tolist())
    else:
        stats = train_cvae(model, shard, settings, device, torch_generator(cfg.seed, "cvae", pid, *stream_names(cfg)),
                           label=f"client p{pid}")
        metrics = {"train-seconds": stats.seconds, "train-loss": stats.final_loss,
                   "train-recon": stats.final_recon, "train-kl": stats.final_kl}
    # The encoder stays here: it is the part that maps real images to codes (FedMHO Sec. 4.2: only decoders and label
    # distributions are sent to the server).
    return encode("decoder", settings.arch, model.decoder.state_dict(), counts, pid, metrics,
                  half_precision=bool(job.instruction.get("half-precision", False)), extra=extra)


ROLE_TASKS: dict[str, Callable[[ClientJob], object]] = {"classifier": train_classifier, "decoder": train_decoder}
ROLE_ALIASES = {"sufficient": "classifier", "constrained": "decoder"}  # FedMHO's words for the two roles


def role_for(cfg: RunConfig, partition_id: int, node_config: dict, instruction: dict) -> str:
    """The node's upload role: node config `role` > the method's per-partition rule > the method's
    role > classifier.

    The instruction is the same for every node, so a mixed fleet's default split travels as a
    rule: `constrained-clients = n` makes partition ids >= K - n constrained (FedMHO code: the
    classifier clients first, then the CVAE clients).
    """
    role = node_config.get("role")
    if not role and "constrained-clients" in instruction:
        constrained = int(instruction["constrained-clients"])
        role = "decoder" if partition_id >= cfg.num_clients - constrained else "classifier"
    role = str(role or instruction.get("role") or "classifier")
    role = ROLE_ALIASES.get(role, role)
    if role not in ROLE_TASKS:
        known = [*ROLE_TASKS, *ROLE_ALIASES]
        raise ValueError(f"unknown client role {role!r}; known: {', '.join(known)}")
    return role


def run_client(cfg: RunConfig, node_config: dict, instruction: dict,
               global_state: dict[str, torch.Tensor] | None = None):
    """Validate the node's place in the run, then run its role's task. Returns the reply content."""
    if "partition-id" not in node_config:
        raise ValueError("node config has no partition-id (start the SuperNode with "
                         "--node-config 'partition-id=N num-partitions=K')")
    pid = int(node_config["partition-id"])
    parts = int(node_config.get("num-partitions", cfg.num_clients))
    if parts != cfg.num_clients:
        raise ValueError(f"node config num-partitions={parts} but run config num-clients={cfg.num_clients}")
    if not 0 <= pid < cfg.num_clients:
        raise ValueError(f"partition-id={pid} outside 0..{cfg.num_clients - 1}")
    role = role_for(cfg, pid, node_config, instruction)
    # node config `arch` names the classifier; a decoder node's CVAE comes from cvae.arch
    arch = cfg.arch_for(pid, node_config) if role == "classifier" else cfg.arch_for(pid)
    job = ClientJob(cfg, pid, arch, instruction, global_state)
    return ROLE_TASKS[role](job)
