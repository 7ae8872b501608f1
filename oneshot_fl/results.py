"""The run folder: result.json, the global model checkpoint, plots, tables.

<output-dir>/<run-name>/
  result.json            config, clients, global accuracy, timings, bytes (strategies.results_writer):
                         `config` holds the values the run used, every placeholder resolved (0 = preset,
                         -1 = the paper's per-dataset value / no cap, "" = the default; see
                         oneshot_fl.config.resolved_config); `config_requested` those keys as the run
                         config gave them; `config_unresolved` what only each node decides (threads=0)
  global_model.pt        {"arch", "input_shape", "num_classes", "state_dict"}
  label_counts.md/.png   per-client label-count table and plot (from the uploaded counts)
  accuracy.png ...       method-specific plots and files
  uploads/               the validated uploads archive (replayable)
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from oneshot_fl.models.registry import build

log = logging.getLogger(__name__)
NONFINITE_KEY = "nonfinite_values"  # where write_json records the values it had to write as null


def _json_default(obj: Any) -> Any:
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (np.floating,)):
        return float(obj)
    if isinstance(obj, (np.ndarray, torch.Tensor)):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serialisable: {type(obj).__name__}")


def _plain(obj: Any) -> Any:
    """numpy / torch values as the Python values they stand for (so the sanitizer sees every float)."""
    if isinstance(obj, (np.ndarray, torch.Tensor, np.generic)):
        return obj.tolist() if not isinstance(obj, np.generic) else obj.item()
    return obj


def sanitize(obj: Any, found: dict[str, str], where: str = "") -> Any:
    """`obj` with every NaN / Inf replaced by None; `found` maps each one's path to its value."""
    obj = _plain(obj)
    if isinstance(obj, float) and not math.isfinite(obj):
        found[where or "."] = str(obj)
        return None
    if isinstance(obj, dict):
        return {k: sanitize(v, found, f"{where}.{k}" if where else str(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [sanitize(v, found, f"{where}[{i}]") for i, v in enumerate(obj)]
    return obj


def write_json(path: Path, obj: Any) -> None:
    """Atomic JSON write (a killed process never leaves a half-written result). Always valid JSON:
    NaN / Inf (which json.dumps would write as bare NaN / Infinity) become null, and a dict
    records where they were under NONFINITE_KEY."""
    found: dict[str, str] = {}
    clean = sanitize(obj, found)
    if found:
        log.warning("%s: non-finite values written as null: %s", path.name, found)
        if isinstance(clean, dict):
            clean[NONFINITE_KEY] = {**clean.get(NONFINITE_KEY, {}), **found}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(clean, indent=2, default=_json_default, allow_nan=False))
    os.replace(tmp, path)


def save_model(path: Path, model: nn.Module, arch: str, input_shape: tuple[int, int, int], num_classes: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save({"arch": arch, "input_shape": list(input_shape), "num_classes": num_classes,
                "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}}, tmp)
    os.replace(tmp, path)


def load_model(path: Path) -> tuple[nn.Module, dict]:
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    model = build(ckpt["arch"], tuple(ckpt["input_shape"]), ckpt["num_classes"])
    model.load_state_dict(ckpt["state_dict"])
    return model, ckpt


@dataclass
class PhaseTimer:
    """Wall time per named phase (seconds); phases may repeat and accumulate."""

    seconds: dict[str, float] = field(default_factory=dict)

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def classes_without_data(counts: np.ndarray) -> list[int]:
    """The classes no client holds an example of, from per-client label counts (m, c): 2c/c with fewer
    than C/2 clients, or a fleet whose only owners of a class were rejected or never answered."""
    return [int(j) for j in np.flatnonzero(np.asarray(counts).sum(axis=0) == 0)]


def label_count_table(rows: list[tuple[str, np.ndarray]]) -> str:
    """Markdown table: one row per client, one column per class, plus the total."""
    num_classes = len(rows[0][1]) if rows else 0
    head = "| client | " + " | ".join(str(c) for c in range(num_classes)) + " | total |"
    sep = "|---" * (num_classes + 2) + "|"
    body = [f"| {name} | " + " | ".join(str(int(v)) for v in counts) + f" | {int(np.sum(counts))} |"
            for name, counts in rows]
    return "\n".join([head, sep, *body]) + "\n"
