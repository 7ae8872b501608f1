"""The run folder: where a run writes, and when a folder may not be written into.

A finished run (result.json) is never overwritten; an unfinished one is a resume; a folder holding files
that no run wrote is someone else's and is refused. The launcher checks this before Flower starts, the
ServerApp and replay again before anything is written."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path

from oneshot_fl.config import RunConfig, resolve_output_dir
from oneshot_fl.errors import RunFolderTaken


def default_run_name(cfg: RunConfig) -> str:
    part = cfg.partition.replace("/", "") + (f"{cfg.alpha:g}" if cfg.partition in ("dirichlet", "niid-bench") else "")
    return f"{cfg.method}-{cfg.dataset}-{part}-k{cfg.num_clients}-s{cfg.seed}-{datetime.now():%Y%m%d-%H%M%S}"


# What a run writes into its folder before result.json (an unfinished run leaves some of these)
RUN_FOLDER_ENTRIES = ("uploads", "checkpoints", "stratification.json", "synthetic_samples.png",
                      "synthetic_dropped.png", "rounds.json", "run.log", "global_model.pt")


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
