"""Shared test set-up: the data directory (../shared/data unless ONESHOT_FL_DATA_DIR is set),
a private cache dir, quiet Flower/Ray, and helpers to build fake Flower replies.

Data tests skip when MNIST is missing, except under CI (CI=true): there a missing data directory
fails the run, before any test runs when a selected test asks for `mnist_dir`, and in the test
otherwise (tests that call `data_dir()` themselves). Skips and their reasons are listed at the end
of every run (-rs in pyproject's addopts)."""

from __future__ import annotations

import logging
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


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def _missing_data_reason() -> str | None:
    raw = os.environ.get("ONESHOT_FL_DATA_DIR", "")
    if raw and (Path(raw) / "mnist").is_dir():
        return None
    where = f"ONESHOT_FL_DATA_DIR={raw}" if raw else "ONESHOT_FL_DATA_DIR is unset and ../shared/data is missing"
    return (f"MNIST not found ({where}): set ONESHOT_FL_DATA_DIR to a folder holding mnist/ "
            "(tests expect ../shared/data)")


CI_DATA_MESSAGE = "CI=true: data tests must run in CI, not skip. "


def data_dir() -> Path:
    reason = _missing_data_reason()
    if reason is not None:
        if in_ci():
            pytest.fail(CI_DATA_MESSAGE + reason, pytrace=False)
        pytest.skip(reason)
    return Path(os.environ["ONESHOT_FL_DATA_DIR"])


def pytest_collection_modifyitems(session, config, items):
    """Under CI, stop before running anything when a selected test needs the missing data set."""
    if not in_ci():
        return
    reason = _missing_data_reason()
    needing = [item.nodeid for item in items if "mnist_dir" in getattr(item, "fixturenames", ())]
    if reason is not None and needing:
        raise pytest.UsageError(f"{CI_DATA_MESSAGE}{reason}; {len(needing)} selected test(s) need it, "
                                f"e.g. {needing[0]}")


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


def processes_mentioning(marker: str) -> list[int]:
    """Live (not zombie) processes whose command line contains `marker` (an e2e run's private folder)."""
    import psutil

    found = []
    for proc in psutil.process_iter(["pid", "cmdline", "status"]):
        if proc.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(proc.info["cmdline"] or []):
            found.append(proc.info["pid"])
    return found


class TokenWatch:
    """The `--token` values Flower passes to its task processes (flwr-simulation, flwr-serverapp, ...) under the
    process trees `roots()` names (this test's SuperLink or fleet, never another test's), gathered every 0.2 s in a
    background thread while a run is in progress: what no file the run writes may contain."""

    def __init__(self, roots):
        import threading

        self.roots, self.tokens = roots, set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        import psutil

        while not self._stop.wait(0.2):
            for root in self.roots():
                try:
                    procs = psutil.Process(root).children(recursive=True)
                except psutil.Error:
                    continue
                for proc in procs:
                    try:
                        args = proc.cmdline()
                    except psutil.Error:
                        continue
                    for i, arg in enumerate(args[:-1]):
                        if arg == "--token":
                            self.tokens.add(args[i + 1])
                    self.tokens.update(arg.split("=", 1)[1] for arg in args if arg.startswith("--token="))

    def __enter__(self) -> "TokenWatch":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)


def files_containing(folder: Path, secret: str) -> list[str]:
    """Every file under `folder` (binary ones too) whose bytes contain `secret`."""
    needle = secret.encode()
    return [str(path) for path in sorted(Path(folder).rglob("*")) if path.is_file() and needle in path.read_bytes()]


class FixedSource:
    """A synthesizer stand-in for distillation tests: the same labelled batch every epoch, no state."""

    def __init__(self, images, logits):
        self.images, self.logits = images, logits

    def synthesize(self):
        from oneshot_fl.engine.synthesizer import SynthBatch

        return SynthBatch(self.images, self.logits.argmax(1), self.logits, {"ce": 0.0, "bn": 0.0, "adv": 0.0})

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


@pytest.fixture
def log_text(caplog):
    """caplog that also hears the "oneshot_fl" loggers once setup_logging (replay, the apps) has stopped their
    propagation to the root logger."""
    logger = logging.getLogger("oneshot_fl")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.INFO)
    yield caplog
    logger.removeHandler(caplog.handler)


def superlinks_under(tmpdir: Path) -> list[int]:
    """The local SuperLinks of the private FLWR_HOMEs launchers made under their TMPDIR (for e2e clean-up)."""
    from launcher.launch import find_superlinks

    return [pid for home in (tmpdir.iterdir() if tmpdir.is_dir() else []) for pid in find_superlinks(home)]
