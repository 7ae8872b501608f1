"""OneShotStrategy: all Flower plumbing of a one-shot method, written once.

One train round: wait for the SuperNodes, send each of at most num-clients one TRAIN instruction,
collect the replies, validate every upload against what this run expects (a bad one is logged with
its node id and reason and dropped: one hostile client never costs the round), enforce the quorum,
archive the valid uploads, then hand them to the method's Flower-free `fuse`. The
global model is evaluated centrally and the run folder written (`serve`), the same way whether
the uploads came over the wire or from an archive (`oneshot-fl replay`).
"""

from __future__ import annotations

import json
import logging
import time
from abc import abstractmethod
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any, ClassVar, Iterable

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from torch import nn

from oneshot_fl import archive, plots, provenance
from oneshot_fl.config import RunConfig, parse_section, placeholder_changes, resolve_data_dir, resolved_config
from oneshot_fl.errors import QuorumError, RunFolderTaken  # noqa: F401 (raised here, named by callers)
from oneshot_fl.run_folder import (RUN_FOLDER_ENTRIES, check_not_finished, check_run_dir_free,  # noqa: F401
                                   default_run_name, run_dir_of)
from oneshot_fl.data.datasets import DATASETS, Split, load_split, test_subset
from oneshot_fl.devices import pick_device
from oneshot_fl.evaluation import Evaluation, evaluate
from oneshot_fl.fastpath import FastPath, HeldImages
from oneshot_fl.results import PhaseTimer, classes_without_data, label_count_table, save_model, write_json
from oneshot_fl.seeding import derive_seed
from oneshot_fl.local.cvae import resolve_cvae_settings
from oneshot_fl.uploads import GLOBAL_MODEL_KEY, Expectation, InvalidUpload, Upload, decode_and_check
from strategies import rounds

log = logging.getLogger("oneshot_fl.strategy")




@dataclass
class FuseContext:
    """What a server algorithm may use: config, device, the central test set, the run folder."""

    cfg: RunConfig
    device: torch.device
    num_classes: int
    input_shape: tuple[int, int, int]
    test: Split
    run_dir: Path
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    round: int = 1  # multi-round mode: the global round this fuse belongs to
    previous_model: nn.Module | None = None  # multi-round mode, rounds >= 2: the last global model

    @property
    def fast(self) -> FastPath:
        """The fast path of this device and the run's gpu.* knobs (all off on a CPU)."""
        return FastPath.for_device(self.device, self.cfg.gpu)

    @cached_property
    def held_test(self) -> HeldImages | None:
        """The test images on the device, on the fast path (copied once, read by every evaluation)."""
        return HeldImages(self.test.images, self.device) if self.fast.device_data else None

    def evaluate(self, model: nn.Module) -> Evaluation:
        return evaluate(model, self.test, self.num_classes, self.device, self.cfg.eval.batch_size, self.held_test)

    def seed(self, *names: object) -> int:
        # round 1 keeps the one-shot streams; later rounds draw fresh ones
        return derive_seed(self.cfg.seed, *(names if self.round == 1 else ("round", self.round, *names)))


@dataclass
class FuseResult:
    """A server algorithm's output: the global model plus whatever it measured on the way."""

    model: nn.Module
    arch: str
    metrics: dict[str, Any] = field(default_factory=dict)  # e.g. ensemble_accuracy, accuracy_best
    history: list[dict] = field(default_factory=list)  # per distillation epoch


@dataclass
class Rejection:
    node_id: int
    reason: str
    role: str = ""  # set when the upload was of a known role this method cannot use (the quorum message counts them)


# Error replies that Flower writes itself when no reply can come (dead SuperNode, crashed
# ClientApp, expired message): the node is missing, not a sender of a bad upload.
NO_REPLY_ERRORS = {ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE,
                   ErrorCode.NODE_UNAVAILABLE, ErrorCode.CLIENT_APP_CRASHED}


class OneShotStrategy(Strategy):
    """Base of every method: subclasses set `name`, optionally `roles` and `Params`, and implement `fuse`."""

    name: ClassVar[str] = ""
    roles: ClassVar[tuple[str, ...]] = ("classifier",)  # upload roles the method accepts
    Params: ClassVar[type | None] = None  # frozen dataclass parsed from "<section>.*" keys
    section: ClassVar[str] = ""  # run-config section of Params; "" = name (variants may share one)

    def __init__(self, cfg: RunConfig, ctx: FuseContext):
        self.cfg = cfg
        self.ctx = ctx
        self.run_root = ctx.run_dir  # multi-round mode: the round folders live under it
        self.round_summaries: list[dict] = []
        self._last_model: nn.Module | None = None
        self.params = self.parse_params(cfg.flat)
        self.check_fleet()
        self.evaluation: Evaluation | None = None
        self._sent: list[int] = []
        self._instructions: list[Message] = []
        self._sent_at = 0.0
        self._wait_seconds = 0.0
        self._config_logged = False

    @classmethod
    def parse_params(cls, flat: dict[str, Any]):
        """This method's Params from the run config (raises ConfigError on bad values)."""
        return parse_section(flat, f"{cls.section or cls.name}.", cls.Params) if cls.Params else None

    # --- method hooks ------------------------------------------------------------------------

    def resolved_settings(self) -> dict:
        """What the method's fixed recipe sets beyond its run-config keys (result.json `method_settings`)."""
        return {}

    def check_fleet(self) -> None:
        """Refuse, before any work, a fleet this method cannot handle (e.g. FedAvg on mixed models)."""

    def assigned_archs(self, role: str, partition_id: int) -> set[str] | None:
        """The architectures this run assigns a partition's client for an upload role, as
        client_app.task.run_client decides them (None: not pinned). Node configs may pick an
        architecture the server cannot see; the run config names those in node-archs."""
        cfg = self.cfg
        if role == "classifier":
            return {cfg.arch_for(partition_id), *cfg.node_archs}
        if role == "decoder":
            return {resolve_cvae_settings(cfg.cvae, cfg.dataset, self.ctx.input_shape).arch}
        return None

    def expectation(self) -> Expectation:
        """What an upload of this run must match beyond its layout (partition range, arch, size)."""
        dp = (self.cfg.dp.epsilon, self.cfg.dp.delta) if self.cfg.dp.enabled else None
        return Expectation(num_partitions=self.cfg.num_clients, max_examples=DATASETS[self.cfg.dataset].train_size,
                           archs=self.assigned_archs, dp=dp)

    def client_config(self) -> dict[str, Any]:
        """Extra instruction settings for the ClientApps (sent in the TRAIN message's config)."""
        return {}

    @abstractmethod
    def fuse(self, uploads: list[Upload], ctx: FuseContext) -> FuseResult:
        """The server algorithm: validated uploads -> global model. No Flower in here."""

    # --- Flower Strategy API -------------------------------------------------------------------

    @property
    def replayed_from(self) -> str | None:
        """The uploads archive a replay serves (oneshot_fl.replay sets it), None in a live run: no client trains."""
        return self.cfg.flat.get("replayed-from")

    def summary(self) -> None:
        log.info("%s: %d clients (%d required), dataset %s, partition %s alpha %s, preset %s, run folder %s",
                 self.name, self.cfg.num_clients, self.cfg.required_clients, self.cfg.dataset,
                 self.cfg.partition, self.cfg.alpha, self.cfg.preset, self.ctx.run_dir)
        self.log_config()
        if settings := self.resolved_settings():
            log.info("%s settings: %s", self.name, settings)

    def recorded_config(self) -> tuple[dict[str, Any], dict[str, str]]:
        """(config, unresolved) for result.json and the log: the run config with every placeholder ("0 = preset",
        -1 = the paper's value or no cap, "" = the default) replaced by the value this run uses."""
        test, threads = self.ctx.test, torch.get_num_threads()
        return resolved_config(self.cfg, run_dir=self.run_root, test_samples=None if test is None else len(test),
                               server_threads=threads,
                               # a replay has no clients: `threads` sets its own torch threads (oneshot_fl.replay)
                               threads=threads if self.replayed_from else None)

    def log_config(self) -> None:
        """Once per run: what each placeholder of the run config resolved to, and this method's settings."""
        if self._config_logged:
            return
        self._config_logged = True
        config, unresolved = self.recorded_config()
        changes = placeholder_changes(self.cfg, config)
        log.info("config (preset %s; requested -> used): %s", self.cfg.preset,
                 ", ".join(f"{k} {v!r} -> {config[k]!r}" for k, v in changes.items()) or "no placeholders")
        if unresolved:
            log.info("config left to each process: %s", "; ".join(f"{k}={self.cfg.flat.get(k)!r} ({why})"
                                                                  for k, why in unresolved.items()))
        requested = self.cfg.requested
        if (self.cfg.dp.enabled and requested.get("local.epochs") and not requested.get("local.dp.epochs")
                and not self.replayed_from):
            # a DP classifier trains local.dp.epochs passes (its own preset value), so this override moves nothing
            log.warning("local.epochs=%s does not apply to DP clients: they train local.dp.epochs=%s passes "
                        "(preset %s); set local.dp.epochs to change that", requested["local.epochs"],
                        config["local.dp.epochs"], self.cfg.preset)
        prefix = f"{self.section or self.name}."
        if self.params is not None:
            log.info("%s params: %s", self.name,
                     ", ".join(f"{k[len(prefix):]}={v!r}" for k, v in config.items() if k.startswith(prefix)))

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        node_ids = self._wait_for_nodes(grid)
        instruction = ConfigRecord({**dict(config), "server-round": server_round, "method": self.name,
                                    "half-precision": self.cfg.upload_half, **self.client_config()})
        content = {"config": instruction}
        if server_round > 1:  # multi-round mode: clients start from the global model (homogeneous fleet)
            instruction["global-arch"] = self.cfg.global_arch
            content[GLOBAL_MODEL_KEY] = arrays
        self._sent = node_ids
        self._sent_at = time.perf_counter()
        log.info("sending the round-%d training instruction to %d nodes", server_round, len(node_ids))
        self._instructions = [Message(RecordDict(content), dst_node_id=node, message_type=MessageType.TRAIN)
                              for node in node_ids]
        return self._instructions

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        self._wait_seconds = time.perf_counter() - self._sent_at
        uploads, rejected, missing = self.collect(replies)
        if self.cfg.rounds == 1:
            result = self.serve(uploads, rejected, missing)
        else:
            result = self.serve_round(server_round, uploads, rejected, missing)
        return ArrayRecord(result.model.state_dict()), MetricRecord({"accuracy": self.evaluation.accuracy})

    def configure_evaluate(self, server_round, arrays, config, grid) -> Iterable[Message]:
        return []  # the global model is evaluated centrally

    def aggregate_evaluate(self, server_round, replies) -> MetricRecord | None:
        return None

    def central_evaluate(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """`evaluate_fn` for Strategy.start: the evaluation `serve` already ran on the global model."""
        if server_round == 0 or self.evaluation is None:
            return None
        return MetricRecord({"accuracy": self.evaluation.accuracy, "loss": self.evaluation.loss})

    # --- the one-shot round ---------------------------------------------------------------------

    def _wait_for_nodes(self, grid: Grid) -> list[int]:
        """Wait until num-clients SuperNodes are connected (or the timeout, then go on with enough)."""
        deadline = time.monotonic() + self.cfg.node_wait_timeout
        node_ids = sorted(grid.get_node_ids())
        while len(node_ids) < self.cfg.num_clients and time.monotonic() < deadline:
            time.sleep(1.0)
            node_ids = sorted(grid.get_node_ids())
        if len(node_ids) < self.cfg.required_clients:
            raise QuorumError(
                f"only {len(node_ids)} SuperNodes connected after {self.cfg.node_wait_timeout:.0f}s; "
                f"{self.cfg.required_clients} required (num-clients={self.cfg.num_clients}, "
                f"min-clients={self.cfg.min_clients})")
        if len(node_ids) < self.cfg.num_clients:
            log.warning("%d of %d SuperNodes connected; going on (min-clients=%d)",
                        len(node_ids), self.cfg.num_clients, self.cfg.required_clients)
        return self._cap_nodes(node_ids)

    def _cap_nodes(self, node_ids: list[int]) -> list[int]:
        """At most num-clients nodes get an instruction: there are only that many partitions, and
        extra nodes could only duplicate one (or outvote the honest ones)."""
        if len(node_ids) <= self.cfg.num_clients:
            return node_ids
        extra = node_ids[self.cfg.num_clients:]
        log.warning("%d SuperNodes connected for num-clients=%d: not instructing nodes %s",
                    len(node_ids), self.cfg.num_clients, extra)
        return node_ids[:self.cfg.num_clients]

    def collect(self, replies: Iterable[Message]) -> tuple[list[Upload], list[Rejection], list[Rejection]]:
        """Validate every reply; log and drop the bad ones; name the nodes that sent nothing, and why."""
        uploads, rejected, missing, answered = [], [], [], set()
        # Flower's own error replies come from the SuperLink (src 1): find the node by the instruction
        sent_to = {m.metadata.message_id: m.metadata.dst_node_id for m in self._instructions
                   if m.metadata.message_id}
        expect = self.expectation()
        for reply in replies:
            node = int(sent_to.get(reply.metadata.reply_to_message_id, reply.metadata.src_node_id))
            if self._sent and node not in self._sent:
                rejected.append(Rejection(node, "reply from a node that was not sent an instruction"))
                continue
            answered.add(node)
            if reply.has_error() and reply.error.code in NO_REPLY_ERRORS:
                missing.append(Rejection(node, f"no upload: {reply.error.reason}"))
                continue
            if reply.has_error():
                rejected.append(Rejection(node, f"client error: {client_error_message(reply.error.reason)}"))
                continue
            try:
                uploads.append(decode_and_check(reply.content, node, self.ctx.num_classes, self.ctx.input_shape,
                                                self.roles, expect))
            except InvalidUpload as exc:
                rejected.append(Rejection(node, exc.reason, self.unusable_role(reply)))
        uploads, duplicates = first_claims(uploads)
        rejected += duplicates
        for rej in rejected:
            log.warning("rejected upload from node %d: %s", rej.node_id, rej.reason)
        silent = sorted(set(self._sent) - answered)
        missing += [Rejection(node, f"no reply within round-timeout={self.cfg.round_timeout:g}s") for node in silent]
        for miss in missing:
            log.warning("missing node %d: %s", miss.node_id, miss.reason)
        uploads.sort(key=lambda u: (u.partition_id, u.node_id))
        missing.sort(key=lambda m: m.node_id)
        return uploads, rejected, missing

    def serve(self, uploads: list[Upload], rejected: list[Rejection] = (), missing: list[Rejection] = ()) -> FuseResult:
        """Quorum -> archive -> fuse -> central evaluation -> run folder. Shared with replay."""
        ctx = self.ctx
        self.log_config()
        if len(uploads) < self.cfg.required_clients:
            details = "; ".join(f"node {r.node_id}: {r.reason}" for r in rejected)
            raise QuorumError(
                f"{len(uploads)} valid uploads, {self.cfg.required_clients} required "
                f"(min-clients={self.cfg.min_clients}, num-clients={self.cfg.num_clients}); "
                f"missing nodes: {[m.node_id for m in missing]}; rejected: {details or 'none'}. "
                f"{self.unusable_hint(uploads, rejected)}No global model written.")
        log.info("%d valid uploads (%d rejected, %d missing); running %s", len(uploads), len(rejected),
                 len(missing), self.name)
        empty = classes_without_data(np.stack([up.label_counts for up in uploads]))
        if empty:  # the counts are the clients' word: reported, never acted on
            log.warning("classes %s: no accepted upload reports an example of them (uploaded label counts); the "
                        "global model is unlikely to learn them", empty)
        ctx.run_dir.mkdir(parents=True, exist_ok=True)  # first write of the run: no empty folder on early failures
        if self.cfg.save_uploads:  # before fusion: a failing fusion must not cost the uploads
            archive.save_uploads(ctx.run_dir / "uploads", uploads, self.archive_context())
        start = time.perf_counter()
        try:
            result = self.fuse(uploads, ctx)
        except Exception as exc:
            kept = f"the {len(uploads)} valid uploads are archived in {ctx.run_dir / 'uploads'}" \
                if self.cfg.save_uploads else "save-uploads=false: the uploads were not archived"
            log.error("%s fusion failed after the quorum (%s: %s); %s", self.name, type(exc).__name__, exc, kept)
            exc.add_note(f"{self.name} fusion failed; {kept}")
            raise
        fuse_seconds = time.perf_counter() - start
        with ctx.timer.phase("evaluation"):
            self.evaluation = ctx.evaluate(result.model)
        log.info("%s global model (%s): test accuracy %.4f", self.name, result.arch, self.evaluation.accuracy)
        self.write_results(uploads, rejected, missing, result, fuse_seconds)
        return result

    def unusable_role(self, reply: Message) -> str:
        """The role of a rejected reply when it is a known upload role this method does not use, else ""."""
        from oneshot_fl.uploads import UPLOAD_ROLES

        try:
            role = reply.content.config_records["meta"].get("role")
        except Exception:  # noqa: BLE001 - a hostile reply may hold anything; it is only not counted
            return ""
        return role if isinstance(role, str) and role in UPLOAD_ROLES and role not in self.roles else ""

    def unusable_hint(self, uploads: list[Upload], rejected: list[Rejection]) -> str:
        """For a failed quorum: how many uploads were of a role this method cannot use (rejected replies, or a
        replayed archive's entries it skipped), and the two ways on: min-clients = the usable count, or a method
        that uses those roles too. "" when no upload was of another role."""
        other = {}
        for rej in rejected:
            if rej.role:
                other[rej.role] = other.get(rej.role, 0) + 1
        total = len(uploads) + len(rejected)
        source = self.replayed_from
        if source:  # a replay leaves such entries out before they reach serve: count them in its archive
            try:
                entries = archive.load_manifest(Path(source))["uploads"]
            except Exception:  # noqa: BLE001 - the replay read it already; an unreadable one only loses the hint
                entries = []
            skipped = [e["role"] for e in entries
                       if isinstance(e, dict) and isinstance(e.get("role"), str) and e["role"] not in self.roles]
            for role in skipped:
                other[role] = other.get(role, 0) + 1
            total += len(skipped)
        if not other:
            return ""
        from strategies import STRATEGIES

        roles = set(other) | {up.role for up in uploads}
        methods = [name for name, cls in STRATEGIES.items() if roles <= set(cls.roles)]
        where = "the archive's" if source else "the"
        count = sum(other.values())
        if len(other) == 1:
            what = f"{next(iter(other))} uploads, which {self.name} cannot use"
        else:
            what = f"of roles {self.name} cannot use ({', '.join(f'{n} {r}' for r, n in sorted(other.items()))})"
        hint = f"{count} of {where} {total} uploads are {what} (it uses {'/'.join(self.roles)} uploads): "
        ways = []
        if uploads:
            usable = "/".join(sorted({up.role for up in uploads}))
            ways.append(f"set min-clients={len(uploads)} to go on with the {len(uploads)} {usable} uploads")
        if methods:
            ways.append(f"{'replay' if source else 'run'} with a method that uses {' and '.join(sorted(roles))} "
                        f"uploads: {', '.join(methods)}")
        return hint + (", or ".join(ways) or "no method uses them") + ". "

    def serve_round(self, server_round: int, uploads: list[Upload], rejected, missing) -> FuseResult:
        """Multi-round mode: serve one round into <run>/round-<r>/, then update the run's summary."""
        previous = self._last_model if server_round > 1 else None
        self.ctx = rounds.round_context(self.ctx, self.run_root, server_round, previous)
        result = self.serve(uploads, rejected, missing)
        self._last_model = result.model
        summary = rounds.round_summary(json.loads((self.ctx.run_dir / "result.json").read_text()))
        self.round_summaries.append(summary)
        final = server_round == self.cfg.rounds
        rounds.write_round_summaries(self.run_root, self.round_summaries, final, result.model, result.arch,
                                     self.ctx.input_shape, self.ctx.num_classes)
        log.info("round %d/%d: global accuracy %.4f", server_round, self.cfg.rounds, self.evaluation.accuracy)
        return result

    def archive_context(self) -> dict[str, Any]:
        cfg = self.cfg
        return {"dataset": cfg.dataset, "partition": cfg.partition, "alpha": cfg.alpha,
                "num_clients": cfg.num_clients, "seed": cfg.seed, "preset": cfg.preset,
                "num_classes": self.ctx.num_classes, "input_shape": list(self.ctx.input_shape),
                "run_config": cfg.flat}

    def write_results(self, uploads: list[Upload], rejected, missing, result: FuseResult, fuse_seconds: float) -> None:
        ctx, cfg, ev = self.ctx, self.cfg, self.evaluation
        run_dir = ctx.run_dir
        config, unresolved = self.recorded_config()
        save_model(run_dir / "global_model.pt", result.model, result.arch, ctx.input_shape, ctx.num_classes)
        clients = []
        for up in uploads:
            clients.append({
                "node_id": up.node_id, "partition_id": up.partition_id, "role": up.role, "arch": up.arch,
                "num_examples": up.num_examples, "label_counts": up.label_counts.tolist(),
                "local_accuracy": up.metrics.get("local-test-accuracy"),
                "train_seconds": up.metrics.get("train-seconds"),
                "received_bytes": up.received_bytes, "raw_bytes": up.raw_bytes,
                "bytes_ratio": up.received_bytes / up.raw_bytes if up.raw_bytes else None,
                "dp": up.dp.report() if up.dp else None,  # the client's verified guarantee (None: not private)
            })
        accuracies = [h["accuracy"] for h in result.history if h.get("accuracy") is not None]
        train_seconds = [c["train_seconds"] or 0.0 for c in clients]
        timings = {
            "local_max": max(train_seconds, default=0.0),
            "local_sum": float(sum(train_seconds)),
            "wait_for_uploads": self._wait_seconds,
            **ctx.timer.seconds,
            "server_fuse": fuse_seconds,
        }
        timings["total"] = timings["wait_for_uploads"] + fuse_seconds + ctx.timer.seconds.get("evaluation", 0.0)
        received = [c["received_bytes"] for c in clients]
        counts = np.stack([up.label_counts for up in uploads])
        per_role = {}
        for role in sorted({up.role for up in uploads}):
            ups = [up for up in uploads if up.role == role]
            counts_bytes = ups[0].label_counts.nbytes  # the int64 histogram every upload carries
            per_role[role] = {
                "clients": len(ups),
                "archs": sorted({up.arch for up in ups}),
                "received_bytes": [up.received_bytes for up in ups],
                "raw_bytes": [up.raw_bytes for up in ups],
                "label_count_bytes": counts_bytes,
                # received / (raw tensor bytes + histogram): the framing overhead of this role's uploads
                "max_ratio_to_raw_plus_counts": max(up.received_bytes / (up.raw_bytes + counts_bytes) for up in ups),
            }
        record = {
            "status": "completed",
            "finished_at": datetime.now().isoformat(timespec="seconds"),
            "method": self.name, "dataset": cfg.dataset, "partition": cfg.partition, "alpha": cfg.alpha,
            "num_clients": cfg.num_clients, "seed": cfg.seed, "preset": cfg.preset,
            "round": ctx.round, "num_rounds": cfg.rounds,
            "global": {
                "arch": result.arch,
                "accuracy": ev.accuracy,
                "accuracy_final": ev.accuracy,
                "accuracy_best": max(accuracies) if accuracies else ev.accuracy,
                "loss": ev.loss,
                "per_class_accuracy": ev.per_class_accuracy,
                **result.metrics,
            },
            "clients": clients,
            "rejected": [{"node_id": r.node_id, "reason": r.reason} for r in rejected],
            "missing_nodes": [m.node_id for m in missing],
            "missing": [{"node_id": m.node_id, "reason": m.reason} for m in missing],
            "classes_without_data": classes_without_data(counts),
            "privacy": privacy_summary(cfg, uploads),
            "timings": timings,
            "upload_bytes": {
                "total": int(sum(received)),
                "per_client": received,
                "max_ratio_to_raw": max((c["bytes_ratio"] or 0.0 for c in clients), default=None),
                "per_role": per_role,
            },
            "history": result.history,
            "config": config,  # every placeholder resolved; config_requested: those keys as the run config had them
            "config_requested": placeholder_changes(cfg, config),
            **({"config_unresolved": unresolved} if unresolved else {}),
            "method_settings": self.resolved_settings(),
            "provenance": provenance.collect(),
        }
        write_json(run_dir / "result.json", record)
        names = [f"p{up.partition_id} {up.arch}" for up in uploads]
        (run_dir / "label_counts.md").write_text(label_count_table(list(zip(names, counts))))
        roles = [up.role for up in uploads]  # the plots name each client's role where they differ (FedMHO)
        partition = plots.partition_text(cfg.partition, cfg.alpha)
        class_names = DATASETS[cfg.dataset].class_names
        plots.label_distribution(counts, run_dir / "label_counts.png",
                                 f"{cfg.dataset}, {partition}, K={cfg.num_clients}: label counts per client "
                                 "(as uploaded)", names=names, roles=roles, class_names=class_names)
        rated = [(name, c["local_accuracy"]) for name, c in zip(names, clients) if c["local_accuracy"] is not None]
        if rated:  # clients without a classifier (e.g. FedMHO's decoder clients) have no accuracy: marked so
            plots.client_accuracies(names, [c["local_accuracy"] for c in clients], ev.accuracy,
                                    run_dir / "client_accuracy.png",
                                    f"{self.name} on {cfg.dataset}, {partition}: clients vs global model",
                                    roles=roles)
        if result.history:
            refs = {"best client": max((a for _, a in rated), default=None)}
            if result.metrics.get("ensemble_accuracy") is not None:
                refs["teacher ensemble"] = result.metrics["ensemble_accuracy"]
            plots.accuracy_curve(result.history, run_dir / "accuracy.png",
                                 f"{self.name} on {cfg.dataset}, {partition}: global test accuracy", refs)
        log.info("results written to %s", run_dir)


def privacy_summary(cfg: RunConfig, uploads: list[Upload]) -> dict[str, Any]:
    """result.json `privacy`: the run's DP setting and the fleet's worst guarantee (the largest epsilon and
    delta any accepted upload claims; None when some upload has no guarantee, or none has)."""
    claims = [up.dp for up in uploads if up.dp is not None]
    private = bool(uploads) and len(claims) == len(uploads)
    summary = {
        "dp": cfg.dp.enabled,
        "target_epsilon": cfg.dp.epsilon if cfg.dp.enabled else None,
        "target_delta": cfg.dp.delta if cfg.dp.enabled else None,
        "clients_with_guarantee": len(claims),
        "clients_without_guarantee": [up.partition_id for up in uploads if up.dp is None],
        "worst_epsilon": max(c.epsilon for c in claims) if private else None,
        "worst_delta": max(c.delta for c in claims) if private else None,
    }
    if claims:
        log.info("privacy: %d of %d uploads differentially private; the fleet's worst guarantee: %s", len(claims),
                 len(uploads), f"({summary['worst_epsilon']:.4f}, {summary['worst_delta']:g})-DP" if private
                 else "none (some uploads have no guarantee)")
    return summary


def client_error_message(reason: str) -> str:
    """The client's own exception message out of Flower's error reason: in simulation Ray wraps it in its
    actor's repr and the traceback ('... ClientAppException occurred. Message: <the message>'>'), which buried
    the one line that says what went wrong (the ClientApp's log keeps the traceback)."""
    head, found, message = reason.rpartition("Message: ")
    return message.strip().removesuffix("'>").strip() or reason if found else reason


def first_claims(uploads: list[Upload]) -> tuple[list[Upload], list[Rejection]]:
    """One partition, one client: the first upload (in arrival order) claiming a partition id keeps
    it; a second claim is a copy or a lie and is rejected."""
    owners: dict[int, int] = {}
    kept, rejected = [], []
    for up in uploads:
        if up.partition_id in owners:
            rejected.append(Rejection(up.node_id, f"partition-id {up.partition_id} already uploaded by "
                                                  f"node {owners[up.partition_id]}"))
            continue
        owners[up.partition_id] = up.node_id
        kept.append(up)
    return kept, rejected


def make_context(cfg: RunConfig, run_dir: Path | None = None) -> FuseContext:
    """Run folder + central test set + device: everything `fuse` gets besides the uploads. The
    folder is only named here (and refused if it holds a finished run or files no run wrote); `serve` creates it."""
    info = DATASETS[cfg.dataset]
    run_dir = run_dir_of(cfg, run_dir)
    check_run_dir_free(run_dir)
    test = load_split(cfg.dataset, "test", str(resolve_data_dir(cfg)), cfg.download)
    test = test_subset(test, cfg.eval.test_samples, derive_seed(cfg.seed, "test-subset"))
    return FuseContext(cfg=cfg, device=pick_device(), num_classes=info.num_classes,
                       input_shape=info.input_shape, test=test, run_dir=run_dir)
