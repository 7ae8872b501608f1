"""Serving uploads: quorum -> archive -> the method's `fuse` -> central evaluation -> run folder.

The same path whether the uploads came over the wire (the Flower adapter, strategies/base.py) or from an
archive (`oneshot-fl replay`): a replay is the server half of a run, on identical client models.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np

from oneshot_fl import archive
from oneshot_fl.config import RunConfig
from oneshot_fl.errors import QuorumError
from oneshot_fl.evaluation import Evaluation
from oneshot_fl.results import classes_without_data
from oneshot_fl.uploads import Expectation, Upload
from strategies.context import FuseContext, FuseResult, Rejection
from strategies.results_writer import write_results

log = logging.getLogger("oneshot_fl.strategy")

ROUND_KEY = "round"  # in the uploads archive's context: whom the round rejected and missed (a resumed run's record)


class Servable(Protocol):
    """What serving needs of a method (strategies.base.OneShotStrategy has it all)."""

    name: str
    roles: tuple[str, ...]
    cfg: RunConfig
    ctx: FuseContext
    methods: dict[str, tuple[str, ...]]  # every registered method's upload roles (for the quorum hint)

    @property
    def replayed_from(self) -> str | None: ...

    def fuse(self, uploads: list[Upload], ctx: FuseContext) -> FuseResult: ...

    def expectation(self) -> Expectation: ...

    def log_config(self) -> None: ...

    def archive_context(self) -> dict[str, Any]: ...

    def recorded_config(self) -> tuple[dict[str, Any], dict[str, str]]: ...

    def resolved_settings(self) -> dict: ...


@dataclass
class Served:
    """What serving one round produced: the global model (and what the method measured) and its evaluation."""

    result: FuseResult
    evaluation: Evaluation


def serve(method: Servable, uploads: list[Upload], rejected: Sequence[Rejection] = (),
          missing: Sequence[Rejection] = (), *, left_out: Sequence[str] = (), wait_seconds: float = 0.0,
          archived: bool = False) -> Served:
    """Quorum -> archive -> fuse -> central evaluation -> run folder. `left_out`: the roles of the archived uploads
    a replay left out as of a role this method does not use (a failed quorum counts them); `wait_seconds`: how
    long the round waited for its uploads (result.json timings); `archived`: the uploads are this run folder's
    archive already (a resumed run's), which is not written again."""
    ctx, cfg = method.ctx, method.cfg
    method.log_config()
    if len(uploads) < cfg.required_clients:
        details = "; ".join(f"node {r.node_id}: {r.reason}" for r in rejected)
        raise QuorumError(
            f"{len(uploads)} valid uploads, {cfg.required_clients} required "
            f"(min-clients={cfg.min_clients}, num-clients={cfg.num_clients}); "
            f"missing nodes: {[m.node_id for m in missing]}; rejected: {details or 'none'}. "
            f"{unusable_hint(method, uploads, rejected, left_out)}No global model written.")
    log.info("%d valid uploads (%d rejected, %d missing); running %s", len(uploads), len(rejected),
             len(missing), method.name)
    empty = classes_without_data(np.stack([up.label_counts for up in uploads]))
    if empty:  # the counts are the clients' word: reported, never acted on
        log.warning("classes %s: no accepted upload reports an example of them (uploaded label counts); the "
                    "global model is unlikely to learn them", empty)
    ctx.run_dir.mkdir(parents=True, exist_ok=True)  # first write of the run: no empty folder on early failures
    if cfg.save_uploads and not archived:  # before fusion: a failing fusion must not cost the uploads
        archive.save_uploads(ctx.run_dir / "uploads", uploads,
                             {**method.archive_context(), ROUND_KEY: round_record(rejected, missing)})
    start = time.perf_counter()
    try:
        result = method.fuse(uploads, ctx)
    except Exception as exc:
        kept = f"the {len(uploads)} valid uploads are archived in {ctx.run_dir / 'uploads'}" \
            if cfg.save_uploads else "save-uploads=false: the uploads were not archived"
        log.error("%s fusion failed after the quorum (%s: %s); %s", method.name, type(exc).__name__, exc, kept)
        exc.add_note(f"{method.name} fusion failed; {kept}")
        raise
    fuse_seconds = time.perf_counter() - start
    with ctx.timer.phase("evaluation"):
        evaluation = ctx.evaluate(result.model)
    log.info("%s global model (%s): test accuracy %.4f", method.name, result.arch, evaluation.accuracy)
    config, unresolved = method.recorded_config()
    write_results(ctx, method.name, uploads, rejected, missing, result, evaluation, fuse_seconds=fuse_seconds,
                  wait_seconds=wait_seconds, config=config, unresolved=unresolved,
                  method_settings=method.resolved_settings())
    return Served(result, evaluation)


def round_record(rejected: Sequence[Rejection], missing: Sequence[Rejection]) -> dict:
    """Whom the round rejected and missed, as the uploads archive keeps it: a run resumed on that archive
    (strategies/archived.py) reports the same in its result.json."""
    return {kind: [{"node_id": r.node_id, "reason": r.reason, "role": r.role} for r in entries]
            for kind, entries in (("rejected", rejected), ("missing", missing))}


def unusable_hint(method: Servable, uploads: list[Upload], rejected: Sequence[Rejection],
                  left_out: Sequence[str] = ()) -> str:
    """For a failed quorum: how many uploads were of a role this method cannot use (rejected replies, or a
    replayed archive's entries it left out), and the two ways on: min-clients = the usable count, or a method
    that uses those roles too. "" when no upload was of another role."""
    other: dict[str, int] = {}
    for role in [rej.role for rej in rejected if rej.role] + list(left_out):
        other[role] = other.get(role, 0) + 1
    total = len(uploads) + len(rejected) + len(left_out)
    if not other:
        return ""
    source = method.replayed_from
    roles = set(other) | {up.role for up in uploads}
    methods = [name for name, accepted in method.methods.items() if roles <= set(accepted)]
    where = "the archive's" if source else "the"
    count = sum(other.values())
    if len(other) == 1:
        what = f"{next(iter(other))} uploads, which {method.name} cannot use"
    else:
        what = f"of roles {method.name} cannot use ({', '.join(f'{n} {r}' for r, n in sorted(other.items()))})"
    hint = f"{count} of {where} {total} uploads are {what} (it uses {'/'.join(method.roles)} uploads): "
    ways = []
    if uploads:
        usable = "/".join(sorted({up.role for up in uploads}))
        ways.append(f"set min-clients={len(uploads)} to go on with the {len(uploads)} {usable} uploads")
    if methods:
        ways.append(f"{'replay' if source else 'run'} with a method that uses {' and '.join(sorted(roles))} "
                    f"uploads: {', '.join(methods)}")
    return hint + (", or ".join(ways) or "no method uses them") + ". "


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
