"""An uploads archive read back for serving: the source of a replay, and a resumed run's own uploads.

Every archived upload gets the checks a live reply gets (archive.load_uploads re-validates it against the method's
roles and the run's expectation), then one partition, one client (first_claims): in that order, for a replay and a
resume alike.

A resumed run (the same resolved config continuing its unfinished run folder: oneshot_fl/run_folder.py) serves the
uploads its interrupted launch archived instead of training the clients again (`uploads_to_resume`), when that
archive is complete and this run's: its manifest is there (written last, after every upload file), its run context
is the one this run would write, and every upload passes its checks. Otherwise the clients train again, and the log
says why.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oneshot_fl.archive import MANIFEST, load_manifest, load_uploads
from oneshot_fl.errors import ArchiveError
from oneshot_fl.run_folder import config_difference, run_files
from oneshot_fl.uploads import InvalidUpload, Upload
from strategies.context import Rejection
from strategies.serving import ROUND_KEY, first_claims

log = logging.getLogger("oneshot_fl.strategy")


@dataclass
class ArchivedUploads:
    """An archive's uploads as a method reads them."""

    uploads: list[Upload]  # the valid ones of the method's roles, one per partition
    invalid: list[InvalidUpload]  # entries that fail a check (a missing or damaged file among them: `.file`)
    duplicates: list[Rejection]  # second claims of a partition
    left_out: list[str]  # the roles of the entries of roles the method does not use


def read_archive(directory: Path, manifest: dict, method) -> ArchivedUploads:
    """The archive's uploads for `method` (a strategy: its roles, context and expectation), each checked as a live
    one is; `manifest` is the archive's (archive.load_manifest)."""
    invalid: list[InvalidUpload] = []
    uploads = load_uploads(directory, method.ctx.num_classes, method.ctx.input_shape, method.roles,
                           skip_other_roles=True, expect=method.expectation(), rejected=invalid, manifest=manifest)
    left_out = [entry["role"] for entry in manifest["uploads"]
                if isinstance(entry.get("role"), str) and entry["role"] not in method.roles]
    uploads, duplicates = first_claims(uploads)
    return ArchivedUploads(uploads, invalid, duplicates, left_out)


@dataclass
class Resumed:
    """The uploads a resumed run serves, and the round they came from: whom it rejected and missed (result.json
    names them as the interrupted launch would have)."""

    uploads: list[Upload]
    rejected: list[Rejection] = field(default_factory=list)
    missing: list[Rejection] = field(default_factory=list)


def uploads_to_resume(method) -> Resumed | None:
    """The uploads archived by the interrupted launch of this run, when the run continues an unfinished folder and
    that archive is complete and this run's (one log line: reused, or why the clients train again); None for a new
    run (its folder holds nothing a run wrote) and whenever the clients must train."""
    run_dir = method.ctx.run_dir
    if not run_files(run_dir):
        return None
    resumed, why = reusable_uploads(method, run_dir / "uploads")
    if resumed is None:
        log.warning("resuming: the clients train again: %s", why)
        return None
    log.info("resuming: the %d uploads archived by the interrupted run are reused; no client trains again",
             len(resumed.uploads))
    return resumed


def reusable_uploads(method, directory: Path) -> tuple[Resumed | None, str]:
    """(the archive's uploads, "") when `directory` holds a complete archive of this run whose every upload passes
    its checks, else (None, why not)."""
    directory = Path(directory)
    if not (directory / MANIFEST).is_file():
        if any(directory.glob("node-*.pt")):
            return None, (f"{directory} holds upload files but no {MANIFEST} (written last): the earlier launch "
                          "stopped while archiving its uploads")
        if not method.cfg.save_uploads:
            return None, "save-uploads=false: the earlier launch archived no uploads"
        return None, "the earlier launch archived no uploads (it stopped before its clients' uploads arrived)"
    try:
        manifest = load_manifest(directory)
    except (ArchiveError, OSError) as exc:
        return None, f"its uploads archive cannot be read: {exc}"
    if difference := context_difference(manifest["context"], method.archive_context()):
        return None, f"the uploads archive in {directory} is not this run's ({difference})"
    archived = read_archive(directory, manifest, method)
    problems = ([f"node {exc.node_id}: {exc.reason}" for exc in archived.invalid]
                + [f"node {rej.node_id}: {rej.reason}" for rej in archived.duplicates]
                + [f"an upload of role {role}, which {method.name} does not use" for role in archived.left_out])
    if problems:
        return None, f"archived uploads fail their checks ({'; '.join(problems)})"
    if len(archived.uploads) < method.cfg.required_clients:
        return None, (f"the archive holds {len(archived.uploads)} uploads, {method.cfg.required_clients} "
                      "required")
    served = manifest["context"].get(ROUND_KEY)
    served = served if isinstance(served, dict) else {}
    return Resumed(archived.uploads, rejections(served.get("rejected")), rejections(served.get("missing"))), ""


def context_difference(archived: dict, expected: dict[str, Any]) -> str:
    """"" when an archive's run context is the one this run writes (its round record aside), else what differs."""
    expected = json.loads(json.dumps(expected))  # as the manifest holds it (lists for tuples)
    keys = sorted(key for key in archived.keys() | expected.keys()
                  if key != ROUND_KEY and archived.get(key) != expected.get(key))
    if not keys:
        return ""
    if keys == ["run_config"] and isinstance(archived.get("run_config"), dict):
        return "run config: " + config_difference(archived["run_config"], expected["run_config"])
    return ", ".join(f"{key}: {archived.get(key)!r} in the archive, {expected.get(key)!r} now" for key in keys[:3])


def rejections(entries: Any) -> list[Rejection]:
    """The round record's rejections back (what serving.round_record wrote); anything malformed is left out."""
    if not isinstance(entries, list):
        return []
    return [Rejection(int(e["node_id"]), str(e.get("reason", "")), str(e.get("role", ""))) for e in entries
            if isinstance(e, dict) and isinstance(e.get("node_id"), int)]
