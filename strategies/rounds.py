"""Multi-round mode (rounds = T > 1): the run folder per round and the final summary.

Round r's uploads, global model and results go to <run>/round-<r>/ (a complete one-shot run folder,
uploads archive included, so any round can be replayed); after the last round <run>/result.json is
that round's result plus `rounds` (one summary per round) and <run>/global_model.pt the final model.
One-shot runs (T = 1) keep the flat layout and never touch this module.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from torch import nn

from oneshot_fl.results import PhaseTimer, save_model, write_json


def round_dir(run_root: Path, server_round: int) -> Path:
    return run_root / f"round-{server_round}"


def round_context(ctx, run_root: Path, server_round: int, previous_model: nn.Module | None):
    """The FuseContext of one round: its own folder, timer, seeds and the previous global model."""
    path = round_dir(run_root, server_round)  # created by serve once the round has its quorum
    return dataclasses.replace(ctx, run_dir=path, timer=PhaseTimer(), round=server_round,
                               previous_model=previous_model)


def round_summary(result: dict) -> dict:
    """The per-round line of the final result (from that round's result.json)."""
    g = result["global"]
    return {
        "round": result["round"],
        "accuracy": g["accuracy"],
        "accuracy_best": g.get("accuracy_best"),
        "ensemble_accuracy": g.get("ensemble_accuracy"),
        "client_accuracy": [c["local_accuracy"] for c in result["clients"]],
        "num_uploads": len(result["clients"]),
        "timings": result["timings"],
    }


def write_round_summaries(run_root: Path, summaries: list[dict], final: bool, model: nn.Module | None = None,
                          arch: str = "", input_shape=(), num_classes: int = 0) -> None:
    """rounds.json after every round; after the last one also result.json and global_model.pt."""
    write_json(run_root / "rounds.json", summaries)
    if not final:
        return
    last = json.loads((round_dir(run_root, summaries[-1]["round"]) / "result.json").read_text())
    last["rounds"] = summaries
    last["round_dirs"] = [round_dir(run_root, s["round"]).name for s in summaries]
    last["timings"] = {**last["timings"], "all_rounds_total": sum(s["timings"]["total"] for s in summaries)}
    write_json(run_root / "result.json", last)
    save_model(run_root / "global_model.pt", model, arch, input_shape, num_classes)
