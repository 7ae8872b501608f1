"""The results writer: what a served round leaves in its run folder (result.json, global_model.pt, the label-count
table and the plots). The layout of the folder is described in oneshot_fl/results.py."""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any, Sequence

import numpy as np

from oneshot_fl import plots, provenance
from oneshot_fl.config import RunConfig, placeholder_changes
from oneshot_fl.data.datasets import DATASETS
from oneshot_fl.evaluation import Evaluation
from oneshot_fl.results import classes_without_data, label_count_table, save_model, write_json
from oneshot_fl.uploads import Upload
from strategies.context import FuseContext, FuseResult, Rejection

log = logging.getLogger("oneshot_fl.strategy")


def write_results(ctx: FuseContext, method: str, uploads: list[Upload], rejected: Sequence[Rejection],
                  missing: Sequence[Rejection], result: FuseResult, ev: Evaluation, *, fuse_seconds: float,
                  wait_seconds: float, config: dict[str, Any], unresolved: dict[str, str],
                  method_settings: dict[str, Any]) -> None:
    """The run folder of one served round: result.json (`config` and `unresolved` as the strategy's
    recorded_config gives them, `method_settings` its resolved_settings), global_model.pt, the label-count
    table and plots, the accuracy plots."""
    cfg = ctx.cfg
    run_dir = ctx.run_dir
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
        "wait_for_uploads": wait_seconds,
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
        "method": method, "dataset": cfg.dataset, "partition": cfg.partition, "alpha": cfg.alpha,
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
        "method_settings": method_settings,
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
                                f"{method} on {cfg.dataset}, {partition}: clients vs global model",
                                roles=roles)
    if result.history:
        refs = {"best client": max((a for _, a in rated), default=None)}
        if result.metrics.get("ensemble_accuracy") is not None:
            refs["teacher ensemble"] = result.metrics["ensemble_accuracy"]
        plots.accuracy_curve(result.history, run_dir / "accuracy.png",
                             f"{method} on {cfg.dataset}, {partition}: global test accuracy", refs)
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
