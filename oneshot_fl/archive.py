"""Uploads archive: the validated client uploads of a run, saved so that any server method can
be re-run on identical client models without retraining (`oneshot-fl replay`).

Layout: <dir>/manifest.json (run context + one entry per upload) and <dir>/node-<id>.pt
(the tensors, loaded with weights_only=True). Loading re-validates every upload with the same
checks a live reply gets (uploads.encode -> uploads.decode_and_check).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from oneshot_fl.errors import ArchiveError  # noqa: F401 (raised here, named by callers)
from oneshot_fl.uploads import Expectation, InvalidUpload, Upload, decode_and_check, encode

MANIFEST = "manifest.json"
ARCHIVE_FORMAT = 1  # the manifest layout below; a reader refuses a layout it does not know


def _atomic_write_bytes(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    write(tmp)
    os.replace(tmp, path)


def save_uploads(directory: Path, uploads: list[Upload], context: dict) -> Path:
    """Write every upload and a manifest; `context` holds what a replay needs (dataset, seed, ...)."""
    directory.mkdir(parents=True, exist_ok=True)
    entries = []
    for up in uploads:
        name = f"node-{up.node_id}.pt"
        _atomic_write_bytes(directory / name, lambda p, up=up: torch.save(up.state, p))
        entries.append({
            "file": name, "node_id": up.node_id, "partition_id": up.partition_id, "role": up.role,
            "arch": up.arch, "label_counts": up.label_counts.tolist(), "num_examples": up.num_examples,
            "metrics": up.metrics, "received_bytes": up.received_bytes, "raw_bytes": up.raw_bytes,
            "extra": up.extra,
        })
    manifest = {"format": ARCHIVE_FORMAT, "context": context, "uploads": entries}
    _atomic_write_bytes(directory / MANIFEST, lambda p: p.write_text(json.dumps(manifest, indent=2)))
    kept = {entry["file"] for entry in entries}
    for stale in directory.glob("node-*.pt"):  # an earlier attempt's uploads are not this run's
        if stale.name not in kept:
            stale.unlink()
    return directory




def load_manifest(directory: Path) -> dict:
    """The manifest, checked for the shape every reader relies on: a context holding the run config
    and a list of upload entries (each entry's own fields are checked when its upload is loaded)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        inner = Path(directory) / "uploads" / MANIFEST  # a run folder given for its archive
        hint = f"; the run folder's archive is {inner.parent}" if inner.is_file() else ""
        raise FileNotFoundError(f"{path}: no uploads archive here (expected {MANIFEST} + node-*.pt){hint}")
    try:
        manifest = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArchiveError(f"{path} is not valid JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise ArchiveError(f"{path}: expected a JSON object, found {type(manifest).__name__}")
    if manifest.get("format", ARCHIVE_FORMAT) != ARCHIVE_FORMAT:  # archives written before the field had none
        raise ArchiveError(f"{path}: archive format {manifest['format']!r}; this oneshot-fl reads format "
                           f"{ARCHIVE_FORMAT} (written by another version)")
    context, entries = manifest.get("context"), manifest.get("uploads")
    if not isinstance(context, dict) or not isinstance(context.get("run_config"), dict):
        raise ArchiveError(f"{path}: no 'context' object with the run's 'run_config'")
    if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
        raise ArchiveError(f"{path}: 'uploads' must be a list of upload entries (objects)")
    return manifest


def load_uploads(directory: Path, num_classes: int, input_shape: tuple[int, int, int],
                 roles: tuple[str, ...], skip_other_roles: bool = False, expect: Expectation | None = None,
                 rejected: list[InvalidUpload] | None = None, manifest: dict | None = None) -> list[Upload]:
    """Read an archive back, re-checking every upload as if it had just arrived.

    skip_other_roles: leave out uploads of roles not in `roles` (e.g. FedAvg on the classifier
    uploads of a FedMHO fleet) instead of rejecting them; the caller's quorum still applies.
    rejected: collect the uploads that fail the checks there (an archive is input too) instead of
    raising InvalidUpload for the first one.
    manifest: the archive's (load_manifest), when the caller has read it already.
    """
    directory = Path(directory)
    manifest = manifest or load_manifest(directory)
    uploads = []
    for entry in manifest["uploads"]:
        if skip_other_roles and "role" in entry and entry["role"] not in roles:  # no role: rejected below
            continue
        try:
            uploads.append(_load_entry(directory, entry, num_classes, input_shape, roles, expect))
        except InvalidUpload as exc:
            if rejected is None:
                raise
            rejected.append(exc)
    return uploads


def _load_tensors(directory: Path, entry: dict, node_id) -> dict:
    """The tensors of one archive entry. A file that is missing or cannot be read as a tensor file (damaged,
    truncated, replaced) is that upload's rejection, naming the file (`.file`, for the replay's way on): torch's own
    message is left out, as its advice (load with weights_only=False) would run whatever the file holds and cannot
    repair a damaged file anyway."""
    name = entry.get("file")
    if not isinstance(name, str) or Path(name).name != name:
        raise InvalidUpload(node_id, f"archive entry names no file of the archive ({name!r})")
    try:
        return torch.load(directory / name, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any read failure: the file is not the tensors the manifest promises
        what = "is missing" if isinstance(exc, FileNotFoundError) else \
            f"is damaged: torch cannot read it as a tensor file ({type(exc).__name__})"
        error = InvalidUpload(node_id, f"archive file {name!r} {what}")
        error.file = name
        raise error from None


def _load_entry(directory: Path, entry: dict, num_classes: int, input_shape: tuple[int, int, int],
                roles: tuple[str, ...], expect: Expectation | None) -> Upload:
    node_id = entry.get("node_id", -1)
    state = _load_tensors(directory, entry, node_id)
    try:
        metrics = {k: v for k, v in entry["metrics"].items() if k != "num-examples"}
        content = encode(entry["role"], entry["arch"], state, np.asarray(entry["label_counts"]),
                         entry["partition_id"], metrics, extra=entry.get("extra"))
        received_bytes, raw_bytes = int(entry["received_bytes"]), int(entry["raw_bytes"])
    except Exception as exc:  # noqa: BLE001 - a damaged or tampered archive entry is that upload's rejection
        raise InvalidUpload(node_id, f"archive entry {entry.get('file')!r} cannot be read "
                                     f"({type(exc).__name__}: {str(exc)[:200]})") from None
    upload = decode_and_check(content, node_id, num_classes, input_shape, roles, expect)
    upload.received_bytes = received_bytes  # what the original run measured on the wire
    upload.raw_bytes = raw_bytes
    return upload
