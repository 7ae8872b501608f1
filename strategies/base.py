"""OneShotStrategy: the base of every method and its Flower adapter, written once.

A method sets `name`, its upload `roles` and `Params`, and implements the Flower-free `fuse`
(strategies/context.py says what it gets and returns). The Flower side of one train round: wait for the
SuperNodes, send each of at most num-clients one TRAIN instruction, collect the replies and validate every
upload against what this run expects (a bad one is logged with its node id and reason and dropped: one
hostile client never costs the round), then serve the valid ones (strategies/serving.py: quorum, archive,
fuse, central evaluation, run folder), the same way whether the uploads came over the wire or from an
archive (`oneshot-fl replay`). A resumed one-shot run whose interrupted launch archived its uploads
(strategies/archived.py) sends no instruction: its round has no messages (Flower's loop goes on as for the
evaluation round, which has none either), and it serves the archived uploads.
"""

from __future__ import annotations

import json
import logging
import time
from abc import abstractmethod
from typing import Any, ClassVar, Iterable, Mapping, Sequence

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Strategy
from torch import nn

from oneshot_fl.config import RunConfig, parse_section, placeholder_changes, resolve_cvae_settings, resolved_config
from oneshot_fl.data.datasets import DATASETS
from oneshot_fl.errors import QuorumError
from oneshot_fl.evaluation import Evaluation
from oneshot_fl.uploads import GLOBAL_MODEL_KEY, UPLOAD_ROLES, Expectation, InvalidUpload, Upload, decode_and_check
from strategies import rounds, serving
from strategies.archived import Resumed, uploads_to_resume
from strategies.context import FuseContext, FuseResult, Rejection
from strategies.serving import first_claims

log = logging.getLogger("oneshot_fl.strategy")


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

    def __init__(self, cfg: RunConfig, ctx: FuseContext, methods: Mapping[str, tuple[str, ...]] | None = None):
        self.cfg = cfg
        self.ctx = ctx
        # every registered method's upload roles (build_strategy passes the registry's): a failed quorum names the
        # methods that could use the uploads this one cannot
        self.methods = dict(methods or {})
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
        self._resumed: Resumed | None = None  # the archived uploads a resumed run serves instead of training clients

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
        """The uploads archive a replay serves (launcher.replay sets it), None in a live run: no client trains."""
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
                               # a replay has no clients: `threads` sets its own torch threads (launcher.replay)
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
        if server_round == 1 and self.cfg.rounds == 1 and not self.replayed_from:
            self._resumed = uploads_to_resume(self)
            if self._resumed is not None:  # the round sends nothing: aggregate_train serves the archived uploads
                return []
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
        if self._resumed is not None:
            uploads, rejected, missing = self._resumed.uploads, self._resumed.rejected, self._resumed.missing
        else:
            self._wait_seconds = time.perf_counter() - self._sent_at
            uploads, rejected, missing = self.collect(replies)
        if self.cfg.rounds == 1:
            result = self.serve(uploads, rejected, missing, archived=self._resumed is not None)
        else:
            result = self.serve_round(server_round, uploads, rejected, missing)
        # Flower's summary shows these under "ClientApp-side Train Metrics": what the accepted clients reported. The
        # global model's accuracy is the server-side evaluation (central_evaluate: "ServerApp-side Evaluate Metrics")
        return ArrayRecord(result.model.state_dict()), client_train_metrics(uploads)

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

    def serve(self, uploads: list[Upload], rejected: Sequence[Rejection] = (), missing: Sequence[Rejection] = (),
              left_out: Sequence[str] = (), archived: bool = False) -> FuseResult:
        """Serve the valid uploads (strategies/serving.py) and keep the global model's evaluation for Flower's
        central evaluation (`central_evaluate`). `left_out`, `archived`: see serving.serve."""
        served = serving.serve(self, uploads, rejected, missing, left_out=left_out, wait_seconds=self._wait_seconds,
                               archived=archived)
        self.evaluation = served.evaluation
        return served.result

    def unusable_role(self, reply: Message) -> str:
        """The role of a rejected reply when it is a known upload role this method does not use, else ""."""
        try:
            role = reply.content.config_records["meta"].get("role")
        except Exception:  # noqa: BLE001 - a hostile reply may hold anything; it is only not counted
            return ""
        return role if isinstance(role, str) and role in UPLOAD_ROLES and role not in self.roles else ""

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


def client_train_metrics(uploads: list[Upload]) -> MetricRecord:
    """The round's client-side training metrics: accepted uploads, their examples, and the mean of the local test
    accuracies the clients reported (clients without a classifier report none)."""
    metrics = {"accepted-uploads": len(uploads), "num-examples": int(sum(up.num_examples for up in uploads))}
    accuracies = [up.metrics.get("local-test-accuracy") for up in uploads]
    accuracies = [accuracy for accuracy in accuracies if accuracy is not None]
    if accuracies:
        metrics["mean-local-test-accuracy"] = float(np.mean(accuracies))
    return MetricRecord(metrics)


def client_error_message(reason: str) -> str:
    """The client's own exception message out of Flower's error reason: in simulation Ray wraps it in its
    actor's repr and the traceback ('... ClientAppException occurred. Message: <the message>'>'), which buried
    the one line that says what went wrong (the ClientApp's log keeps the traceback)."""
    head, found, message = reason.rpartition("Message: ")
    return message.strip().removesuffix("'>").strip() or reason if found else reason
