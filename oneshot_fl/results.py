"""The run folder: result.json, the global model checkpoint, plots, tables.

<output-dir>/<run-name>/
  result.json            config, clients, global accuracy, timings, bytes (see write_result)
  global_model.pt        {"arch", "input_shape", "num_classes", "state_dict"}
  label_counts.md/.png   per-client label-count table and plot (from the uploaded counts)
  accuracy.png ...       method-specific plots and files
  uploads/               the validated uploads archive (replayable)
"""

from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn


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


def write_json(path: Path, obj: Any) -> None:
    """Atomic JSON write (a killed process never leaves a half-written result)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default, allow_nan=True))
    os.replace(tmp, path)


def save_model(path: Path, model: nn.Module, arch: str, input_shape: tuple[int, int, int], num_classes: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save({"arch": arch, "input_shape": list(input_shape), "num_classes": num_classes,
                "state_dict": {k: v.detach().cpu() for k, v in model.state_dict().items()}}, tmp)
    os.replace(tmp, path)


def load_model(path: Path) -> tuple[nn.Module, dict]:
    from oneshot_fl.models.registry import build

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


def label_count_table(rows: list[tuple[str, np.ndarray]]) -> str:
    """Markdown table: one row per client, one column per class, plus the total."""
    num_classes = len(rows[0][1]) if rows else 0
    head = "| client | " + " | ".join(str(c) for c in range(num_classes)) + " | total |"
    sep = "|---" * (num_classes + 2) + "|"
    body = [f"| {name} | " + " | ".join(str(int(v)) for v in counts) + f" | {int(np.sum(counts))} |"
            for name, counts in rows]
    return "\n".join([head, sep, *body]) + "\n"
