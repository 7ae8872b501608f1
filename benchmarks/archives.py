"""Client archives known by their content: the uploads' fingerprint, and the fleets kept for reuse.

`uploads_fp(archive)` is what "the same uploads" means: a hash of every upload's tensors (names, dtypes, shapes,
bytes) with its role, architecture, partition id, label counts and example count, in partition order. It leaves out
what differs between two trainings of byte-identical clients (node ids, file names, wire sizes, the clients' timing
metrics) and where the archive lies, so two tables that trained the same fleet get the same fingerprint, and one
changed weight gives another. Every record a fleet's run or replay writes carries it (`uploads_fp`), and the
renderers refuse a row whose methods disagree (benchmarks.cells).

`uploads_id` (benchmarks.fleets) is the hash of one training run's manifest, node ids included: it names that run's
archive, and the resume logic of the table commands pairs records with kept archives by it. The two answer different
questions and both stay: two trainings of identical clients have different ids and the same fingerprint.

The fleet store (benchmarks/runs/fleets/<key>.json, git-ignored) remembers each archive a table trained under the key
of what fixes its clients: the training method, dataset, cell, seed, number of clients, preset, client-side settings
and the code version, never a node id or a path. Another table asking for the same fleet at the same code version is
served that archive, after its tensors are checked against the fingerprint it was stored with. An archive of a dirty
tree is never stored: no one could say which code trained it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from oneshot_fl.archive import load_manifest

ENTRY_FIELDS = ("role", "arch", "partition_id", "label_counts", "num_examples", "extra")
STORE = "fleets"  # under benchmarks/runs/
FLEET_FILE = "fleet.json"  # beside a stored archive: its key, settings, code version and fingerprint


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's elements as raw bytes (any dtype, bfloat16 included)."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def uploads_fp(archive: Path) -> str:
    """A 16-hex-digit fingerprint of an uploads archive's content (see the module docstring)."""
    archive = Path(archive)
    entries = sorted(load_manifest(archive)["uploads"], key=lambda e: (e.get("partition_id", -1), e.get("role", "")))
    digest = hashlib.sha256()
    for entry in entries:
        if "file" not in entry:
            raise ValueError(f"{archive}: an upload entry names no tensor file: {json.dumps(entry)[:200]}")
        meta = {field: entry.get(field) for field in ENTRY_FIELDS}
        digest.update(json.dumps(meta, sort_keys=True).encode())
        state = torch.load(archive / entry["file"], map_location="cpu", weights_only=True)
        for name in sorted(state):
            tensor = state[name]
            digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
            digest.update(tensor_bytes(tensor))
    return digest.hexdigest()[:16]


def fleet_key(settings: dict, version: str) -> str:
    """The store key of a fleet: its settings (what trains its clients) and the code version, as canonical JSON."""
    text = json.dumps({"settings": settings, "code": version}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def storable(version: str) -> bool:
    """A code version whose archives may be stored and served again: a commit, not a dirty or unknown tree."""
    return bool(version) and version != "unknown" and not version.endswith("-dirty")


def remember(runs: Path, settings: dict, archive: Path, version: str) -> str | None:
    """Store `archive` as the fleet of `settings` at `version` (nothing for a dirty tree); its fingerprint, or None
    where it was not stored."""
    if not storable(version):
        return None
    fp = uploads_fp(archive)
    key = fleet_key(settings, version)
    entry = {"key": key, "settings": settings, "code_version": version, "uploads_fp": fp,
             "archive": str(Path(archive).resolve())}
    text = json.dumps(entry, sort_keys=True, indent=1, default=str)
    (Path(archive).parent / FLEET_FILE).write_text(text)
    store = Path(runs) / STORE
    store.mkdir(parents=True, exist_ok=True)
    (store / f"{key}.json").write_text(text)
    return fp


def recall(runs: Path, settings: dict, version: str) -> Path | None:
    """The stored archive of the fleet of `settings` at `version`, if it is still there with the content it was
    stored with; None otherwise (an archive trained again or damaged since is not served)."""
    if not storable(version):
        return None
    path = Path(runs) / STORE / f"{fleet_key(settings, version)}.json"
    if not path.is_file():
        return None
    entry = json.loads(path.read_text())
    archive = Path(entry["archive"])
    try:
        same = (archive / "manifest.json").is_file() and uploads_fp(archive) == entry["uploads_fp"]
    except (OSError, ValueError, RuntimeError):
        same = False
    return archive if same else None


def trained_at(archive: Path, version: str) -> bool:
    """The kept archive was stored by a run of `version` and still holds what it held then."""
    marker = Path(archive).parent / FLEET_FILE
    if not storable(version) or not marker.is_file():
        return False
    entry = json.loads(marker.read_text())
    try:
        return entry.get("code_version") == version and uploads_fp(archive) == entry.get("uploads_fp")
    except (OSError, ValueError, RuntimeError):
        return False
