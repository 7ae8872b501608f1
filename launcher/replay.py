"""Re-run any server method on a saved uploads archive: identical client models, no retraining."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from oneshot_fl.archive import load_manifest
from oneshot_fl.config import ConfigError, default_run_config, from_run_config, merge_overrides, resolve_output_dir
from oneshot_fl.devices import set_threads
from oneshot_fl.errors import EXPECTED_ERRORS, QuorumError, error_line
from oneshot_fl.logs import setup_logging
from oneshot_fl.provenance import user_command
from oneshot_fl.run_folder import (check_continues, check_not_finished, check_run_dir_free, default_run_name,
                                   launch_identity, let_go, new_run_folder, record_launch, run_dir_of, take_or_refuse,
                                   this_process)
from strategies import STRATEGIES, build_strategy
from strategies.archived import read_archive
from strategies.context import Rejection
from launcher.launch import parse_overrides

log = logging.getLogger("oneshot_fl")

# What the clients did is fixed by the archive; a replay may change only the server side.
CLIENT_SIDE_KEYS = ("dataset", "partition", "alpha", "num-clients", "min-partition-size", "model",
                    "client-models", "upload-half")
CLIENT_SIDE_PREFIXES = ("local.",)


def server_method_prefixes() -> tuple[str, ...]:
    """Run-config sections that only a server method reads: every method's section and distill.*."""
    return tuple(sorted({f"{cls.section or cls.name}." for cls in STRATEGIES.values()} | {"distill."}))


def replay_config(uploads_dir: Path, overrides: dict, manifest: dict | None = None) -> dict:
    """Current defaults <- the archived run's config <- overrides (server-side keys only).

    The archive fixes the clients and the run (dataset, partition, seed, preset, local.*); the
    server methods' own knobs (their sections and distill.*) are not taken from it: the archive
    holds whatever defaults the training run had, so inheriting them would replay today's method
    with yesterday's defaults. Set them with overrides to reproduce an older run. `manifest`: the archive's,
    when the caller has read it already."""
    archived = (manifest or load_manifest(uploads_dir))["context"]["run_config"]
    changed = [k for k, v in overrides.items()
               if (k in CLIENT_SIDE_KEYS or k.startswith(CLIENT_SIDE_PREFIXES)) and archived.get(k) != v]
    if changed:
        values = ", ".join(f"{k}={overrides[k]!r} (archive: {archived.get(k)!r})" for k in changed)
        raise ConfigError(f"{values}: {'these describe' if len(changed) > 1 else 'it describes'} the clients, "
                          "which the archive fixes; train new clients instead of replaying")
    defaults = default_run_config()
    # the run name is the original run's; a replay writes a new folder unless one is given
    method_knobs = server_method_prefixes()
    base = {**defaults, **{k: v for k, v in archived.items()
                           if k in defaults and k != "run-name" and not k.startswith(method_knobs)}}
    flat = merge_overrides(overrides, base=base)
    # keep the clients' resolved local settings even if the preset changes the server side
    flat.update({k: v for k, v in archived.items() if k.startswith(CLIENT_SIDE_PREFIXES)})
    return flat


def expected_failure(exc: BaseException) -> str | None:
    """The one line to print for a replay failure the user can act on (bad config, missing data or
    archive, too few valid uploads), the same as every oneshot-fl command prints after
    `oneshot-fl: error: `; None for anything else, which deserves its traceback."""
    if isinstance(exc, EXPECTED_ERRORS):
        return error_line(exc)
    return None


def check_not_over_source(run_dir: Path, uploads_dir: Path, save_uploads: bool) -> None:
    """A replay never writes into the archive it reads: its run folder inside the archive would mix results
    into it, and its own archive (`run_dir`/uploads) written over the source would keep only the uploads this
    method accepted (a FedMHO fleet's decoders replayed by fedavg would be deleted)."""
    run_dir, uploads_dir = Path(run_dir).resolve(), Path(uploads_dir).resolve()
    if run_dir.is_relative_to(uploads_dir) or (save_uploads and run_dir / "uploads" == uploads_dir):
        raise ConfigError(f"run folder {run_dir} would write into the uploads archive being replayed "
                          f"({uploads_dir}); choose another --out or run-name")


def replay(uploads_dir: Path, run_config_args: list[str], run_dir: Path | None = None, strategy_cls=None) -> dict:
    """Run the configured server method on the archive's uploads; `strategy_cls` (a subclass of the method's
    strategy, e.g. a benchmark's variant) replaces the method's class. The run folder is held (its lock) from
    before the strategy is built until the replay ends, as a launcher holds a run's."""
    setup_logging()
    uploads_dir = Path(uploads_dir).resolve()
    overrides = parse_overrides(run_config_args)  # a malformed -c fails first, whatever the archive
    manifest = load_manifest(uploads_dir)  # read once: the config, the uploads and the entries left out
    cfg = from_run_config(replay_config(uploads_dir, overrides, manifest))
    set_threads(cfg.threads)
    if run_dir is None and not cfg.run_name:  # a new folder, named after the run
        name = default_run_name(cfg) + "-replay"
        check_not_over_source(resolve_output_dir(cfg) / name, uploads_dir, cfg.save_uploads)
        lock = new_run_folder(resolve_output_dir(cfg), name)
        cfg = from_run_config({**cfg.flat, "run-name": lock.run_dir.name})
    else:
        run_dir = run_dir_of(cfg, run_dir)
        # the specific refusals first, then anyone else's files, before the lock file goes into the folder
        check_not_finished(run_dir)
        check_not_over_source(run_dir, uploads_dir, cfg.save_uploads)
        check_run_dir_free(run_dir)
        lock = take_or_refuse(run_dir)
    try:
        check_run_dir_free(lock.run_dir)  # again, under the lock: the run that held it may have just finished
        identity = launch_identity(cfg)
        check_continues(lock.run_dir, identity, force=False,
                        how_to_force="empty that folder to start it over (--out / run-name)")
        record_launch(lock.run_dir, identity)
        lock.record(**this_process(user_command()))
        strategy = build_strategy(cfg, lock.run_dir, strategy_cls)
        uploads, rejected, left_out = _archived_uploads(uploads_dir, manifest, cfg, strategy)
        log.info("replaying %s on %d uploads from %s", cfg.method, len(uploads), uploads_dir)
        strategy.cfg.flat["replayed-from"] = str(uploads_dir)
        strategy.serve(uploads, rejected, left_out=left_out)
        return json.loads((strategy.ctx.run_dir / "result.json").read_text())
    finally:
        let_go(lock)


def _archived_uploads(uploads_dir: Path, manifest: dict, cfg, strategy) -> tuple[list, list, list[str]]:
    """The archive's uploads this method uses, each checked as a live one is, the rejections, and the roles of the
    uploads left out (a failed quorum's hint names the ways on: min-clients, or another method). Too few intact
    uploads for the run's quorum because archive files are damaged or missing: QuorumError, one line naming them and
    the two ways on (replay the intact ones with min-clients, or restore the files)."""
    archived = read_archive(uploads_dir, manifest, strategy)
    uploads, invalid, duplicates = archived.uploads, archived.invalid, archived.duplicates
    for exc in invalid:
        log.warning("rejected archived upload of node %d: %s", exc.node_id, exc.reason)
    skipped = len(manifest["uploads"]) - len(uploads) - len(duplicates) - len(invalid)
    if skipped:  # e.g. the decoder uploads of a FedMHO fleet replayed with fedavg; min-clients decides
        log.info("%s accepts only %s uploads: leaving out %d of the archive's uploads",
                 cfg.method, "/".join(strategy.roles), skipped)
    for rej in duplicates:
        log.warning("rejected archived upload of node %d: %s", rej.node_id, rej.reason)
    unreadable = [exc for exc in invalid if getattr(exc, "file", None)]  # archive.py names the file it could not read
    if unreadable and len(uploads) < cfg.required_clients:
        files = ", ".join(exc.file for exc in unreadable)
        what = "; ".join(exc.reason for exc in unreadable)
        count = f"{len(uploads)} intact upload{'' if len(uploads) == 1 else 's'}"
        intact = f"replay the {count} with -c \"min-clients={len(uploads)}\", or " if uploads else ""
        raise QuorumError(f"{what}: {count}, {cfg.required_clients} required "
                          f"(min-clients={cfg.min_clients}, num-clients={cfg.num_clients}); {intact}restore {files} "
                          f"from a copy of {uploads_dir}")
    return uploads, [Rejection(exc.node_id, exc.reason) for exc in invalid] + duplicates, archived.left_out
