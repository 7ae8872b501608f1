"""The run folder: where a run writes, and when a folder may not be written into.

A finished run (result.json) is never overwritten; an unfinished one is a resume; a folder holding files
that no run wrote is someone else's and is refused. The launcher checks this before Flower starts, the
ServerApp and replay again before anything is written.

A default run name carries a time stamp, so `oneshot-fl run` finds the folder of an earlier, unfinished
launch of the same command by its launch record (`claim_run_folder`): the same resolved run config, and
the launcher that wrote it no longer running."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
from datetime import datetime
from pathlib import Path

import psutil

from oneshot_fl.config import RunConfig, resolve_output_dir
from oneshot_fl.errors import RunFolderTaken


def run_name_prefix(cfg: RunConfig) -> str:
    """The default run name without its time stamp: <method>-<dataset>-<partition>-k<clients>-s<seed>-."""
    part = cfg.partition.replace("/", "") + (f"{cfg.alpha:g}" if cfg.partition in ("dirichlet", "niid-bench") else "")
    return f"{cfg.method}-{cfg.dataset}-{part}-k{cfg.num_clients}-s{cfg.seed}-"


def default_run_name(cfg: RunConfig) -> str:
    return f"{run_name_prefix(cfg)}{datetime.now():%Y%m%d-%H%M%S}"


LAUNCH_RECORD = "launch.json"  # which launch made the folder: its resolved config and process (claim_run_folder)

# What a run writes into its folder before result.json (an unfinished run leaves some of these)
RUN_FOLDER_ENTRIES = ("uploads", "checkpoints", "stratification.json", "synthetic_samples.png",
                      "synthetic_dropped.png", "rounds.json", "run.log", "global_model.pt", LAUNCH_RECORD)


def check_not_finished(run_dir: Path) -> None:
    """A finished run (result.json) is never overwritten, and a file is no run folder."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunFolderTaken(f"run folder {run_dir} is a file; choose another run-name / output folder")
    if (run_dir / "result.json").exists():
        raise RunFolderTaken(f"run folder {run_dir} already holds a finished run (result.json); "
                             "choose another run-name / output folder, or delete that folder to run it again")


def check_run_dir_free(run_dir: Path) -> None:
    """Not a finished run (check_not_finished); an unfinished folder is a resume (the data-free methods'
    checkpoint resumes only with a matching fingerprint, else starts fresh). A folder that holds files but
    nothing a run writes is someone else's: the run's files would mix into it (and overwrite any of the
    same names), so it is refused too."""
    check_not_finished(run_dir)
    if run_dir.is_dir():
        entries = sorted(entry.name for entry in run_dir.iterdir())
        if entries and not any(name in RUN_FOLDER_ENTRIES or name.startswith("round-") for name in entries):
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise RunFolderTaken(f"run folder {run_dir} holds files that no run wrote ({shown}); "
                                 "choose another run-name / output folder (a new or empty one)")


def run_dir_of(cfg: RunConfig, run_dir: Path | None = None) -> Path:
    """The run's folder: `run_dir` when given (a replay's --out), else <output-dir>/<run-name>."""
    return run_dir if run_dir is not None else resolve_output_dir(cfg) / (cfg.run_name or default_run_name(cfg))


# --- the same `oneshot-fl run` command again continues the run it left unfinished --------------------------

_STAMP = re.compile(r"\d{8}-\d{6}(-\d+)?")  # the time stamp, and a count when one second gave two launches


def launch_identity(cfg: RunConfig, pins: dict) -> dict:
    """What makes two launches the same command: the resolved run config (preset applied) with the launcher's
    pins (absolute data and output folders, threads), without the run name."""
    return {key: value for key, value in sorted({**cfg.flat, **pins}.items()) if key != "run-name"}


def _launcher_alive(record: dict) -> bool:
    """Whether the launch that wrote `record` may still be running (then its folder is not taken over). A
    record from another machine, or one that cannot be read, counts as running: two live runs must never
    share a folder, and not resuming costs only time."""
    if record.get("host") != socket.gethostname() or not isinstance(record.get("pid"), int):
        return True
    try:
        return abs(psutil.Process(record["pid"]).create_time() - float(record.get("started", 0))) < 1.0
    except psutil.NoSuchProcess:
        return False
    except (psutil.Error, OSError, TypeError, ValueError):
        return True


def unfinished_run_folder(cfg: RunConfig, output_dir: Path, identity: dict) -> Path | None:
    """The newest folder under `output_dir` with this config's default name (any time stamp) that a launch
    of the same resolved run config (`launch_identity`) left unfinished: no result.json, and the launcher
    that wrote its record is gone."""
    prefix = run_name_prefix(cfg)
    try:
        names = sorted(entry.name for entry in Path(output_dir).iterdir()
                       if entry.name.startswith(prefix) and _STAMP.fullmatch(entry.name[len(prefix):])
                       and entry.is_dir())
    except OSError:
        return None
    for name in reversed(names):
        folder = Path(output_dir) / name
        if (folder / "result.json").exists():
            continue
        try:
            record = json.loads((folder / LAUNCH_RECORD).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and record.get("identity") == identity and not _launcher_alive(record):
            return folder
    return None


def record_launch(run_dir: Path, identity: dict) -> None:
    """Write the folder's launch record (creating the folder): this config, this process."""
    run_dir.mkdir(parents=True, exist_ok=True)
    record = {"identity": identity, "host": socket.gethostname(), "pid": os.getpid(),
              "started": psutil.Process().create_time()}
    tmp = run_dir / f".{LAUNCH_RECORD}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, run_dir / LAUNCH_RECORD)


def claim_run_folder(cfg: RunConfig, output_dir: Path, new_name: str, pins: dict) -> str:
    """The run name for a launch without `run-name`: the folder the same command left unfinished (its
    distillation checkpoint resumes there), else `new_name`; the chosen folder gets this launch's record."""
    identity = launch_identity(cfg, pins)
    folder = unfinished_run_folder(cfg, output_dir, identity)
    if folder is not None:
        check_run_dir_free(folder)
        print(f"[oneshot-fl] continuing the unfinished run of this command in {folder} (a distillation "
              "checkpoint there resumes; client training runs again)", file=sys.stderr, flush=True)
    else:
        folder, count = Path(output_dir) / new_name, 1
        while folder.exists():  # the same second as another launch of this config (that one may be running)
            count += 1
            folder = Path(output_dir) / f"{new_name}-{count}"
    record_launch(folder, identity)
    return folder.name


def release_run_folder(run_dir: Path) -> None:
    """Remove a folder that holds nothing but its launch record (the run wrote nothing: no empty folders)."""
    try:
        if [entry.name for entry in run_dir.iterdir()] == [LAUNCH_RECORD]:
            (run_dir / LAUNCH_RECORD).unlink()
            run_dir.rmdir()
    except OSError:
        pass


def interrupted_message(run_dir: Path) -> str:
    """What an interrupted `oneshot-fl run` says about its unfinished run and the two ways on."""
    if (run_dir / "result.json").is_file():
        return f"[oneshot-fl] the run had finished: its results are in {run_dir}"
    if not run_dir.is_dir():
        return "[oneshot-fl] the run had written nothing yet; run the same command again to start it"
    lines = [f"[oneshot-fl] the unfinished run is in {run_dir}",
             "  - run the same command again to resume it: it continues in that folder (the clients train again; "
             "a distillation checkpoint there resumes where it stopped)"]
    uploads = run_dir / "uploads"
    if (uploads / "manifest.json").is_file():
        lines.append(f"  - or run a server method on the clients' saved uploads, without training them again (a new "
                     f"run folder): oneshot-fl replay {uploads} [-c \"method='...'\"]")
    else:
        lines.append("  - (no client uploads were saved yet, so `oneshot-fl replay` has nothing to run on)")
    return "\n".join(lines)
