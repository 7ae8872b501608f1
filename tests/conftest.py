"""Shared test set-up: the data directory (../shared/data unless ONESHOT_FL_DATA_DIR is set),
a private cache dir, quiet Flower/Ray, and helpers to build fake Flower replies."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_shared = ROOT.parent / "shared" / "data"
if not os.environ.get("ONESHOT_FL_DATA_DIR") and _shared.is_dir():
    os.environ["ONESHOT_FL_DATA_DIR"] = str(_shared)
for key, value in {"FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                   "RAY_USAGE_STATS_ENABLED": "0", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}.items():
    os.environ.setdefault(key, value)

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def data_dir() -> Path:
    path = Path(os.environ.get("ONESHOT_FL_DATA_DIR", ""))
    if not (path / "mnist").is_dir():
        pytest.skip("MNIST not found: set ONESHOT_FL_DATA_DIR (tests expect ../shared/data)")
    return path


@pytest.fixture
def mnist_dir() -> Path:
    return data_dir()


@pytest.fixture(autouse=True)
def _private_dirs(tmp_path_factory, monkeypatch):
    # decoded-dataset cache shared by the session, outputs per test
    monkeypatch.setenv("ONESHOT_FL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))
    monkeypatch.setenv("ONESHOT_FL_OUTPUT_DIR", str(tmp_path_factory.mktemp("runs")))


def reply_message(content, src_node_id: int, error: str | None = None):
    """A reply as the server receives it, built with public Flower API (explicit metadata)."""
    from flwr.app import Error, Message, Metadata

    metadata = Metadata(run_id=1, message_id="", src_node_id=src_node_id, dst_node_id=0,
                        reply_to_message_id="instruction", group_id="1", created_at=time.time(),
                        ttl=60.0, message_type="train")
    if error is not None:
        return Message(Error(code=0, reason=error), metadata=metadata)
    return Message(content, metadata=metadata)


def random_counts(rng: np.random.Generator, num_classes: int = 10, total: int = 100) -> np.ndarray:
    return rng.multinomial(total, np.ones(num_classes) / num_classes).astype(np.int64)
