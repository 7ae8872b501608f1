"""Benchmark records: one JSON line per run, appended to benchmarks/results/<table>.jsonl.

Every record carries the fields all benchmark tables share:
  table, method, dataset, partition, alpha, num_clients, seed, preset, accuracy_final,
  accuracy_best, ensemble_accuracy, wall_s {local, stratification, distillation, ..., total},
  upload_bytes, raw_param_bytes, plus what was run (overrides, code version, machine); a run or replay on a
  fleet's uploads also `uploads_fp`, the fingerprint of their content (benchmarks.archives).
A table command resumes by skipping the runs that have a record (`has_record`); under a release run
($ONESHOT_FL_RELEASE = its commit, set by benchmarks.release) only records of that commit count.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import subprocess
from datetime import datetime
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
RELEASE_ENV = "ONESHOT_FL_RELEASE"
log = logging.getLogger("oneshot_fl.bench")


def code_version() -> str:
    """The checkout's short commit (+ "-dirty"), or the commit named in $ONESHOT_FL_GIT_COMMIT / _DIRTY when set:
    a copy of the tree sent to a GPU machine may sit in a git repository of its own at another commit, and only
    its sender knows which commit the copy is."""
    if os.environ.get("ONESHOT_FL_GIT_COMMIT"):
        return os.environ["ONESHOT_FL_GIT_COMMIT"][:7] + (
            "-dirty" if os.environ.get("ONESHOT_FL_GIT_DIRTY") != "0" else "")
    root = Path(__file__).resolve().parents[1]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        # the records files are data this very benchmark appends to, not code
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)benchmarks/results"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _processor() -> str:
    return platform.processor() or platform.machine()


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (Linux), else what `platform` knows."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _processor()


def machine() -> dict:
    """Where a record ran. The CPU model and the kernels torch picked for it (AVX2, AVX512, ...) go in too: the
    same seed and code can train a deep client to other weights on a CPU with other kernels (float sums in
    another order), so fleets trained on two machines may be two fleets."""
    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "processor": _processor(), "cpu": cpu_model(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


# Named method variants a benchmark can run beside the methods themselves: label -> (method, server settings).
# "fedhydra" is the project's default (robust mode); "fedhydra-paper" FedHydra as published (Eq. 2 score,
# logit-space SA routed by the synthetic label, no peer check).
# "fedlmd" / "fedlmd-tf": FedAvg whose clients train with FedLMD's label-masked loss (the multi-round table's rows).
VARIANTS: dict[str, tuple[str, dict]] = {
    "fedhydra-paper": ("fedhydra", {"fedhydra.mode": "paper"}),
    "fedlmd": ("fedavg", {"local.loss": "fedlmd"}),
    "fedlmd-tf": ("fedavg", {"local.loss": "fedlmd-tf"}),
}


def resolve_variant(label: str) -> tuple[str, dict]:
    """A --methods entry -> (method, the server settings that make it that variant)."""
    return VARIANTS.get(label, (label, {}))


def overrides_key(overrides: dict) -> str:
    return hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:12]


def run_code_version(result: dict) -> str | None:
    """The code a result's run ran, from its provenance (None where that names no commit): a run made elsewhere
    (e.g. on a lent GPU) and recorded here is not the code of this checkout."""
    git = (result.get("provenance") or {}).get("git") or {}
    if not git.get("commit"):
        return None
    return git["commit"][:7] + ("-dirty" if git.get("dirty") else "")


def record_from_result(table: str, result: dict, overrides: dict, extra: dict | None = None) -> dict:
    """Turn a run folder's result.json into a benchmark record."""
    g, t = result["global"], result["timings"]
    clients = result["clients"]
    server = {k: v for k, v in t.items() if k not in ("local_max", "local_sum", "wait_for_uploads", "total",
                                                      "server_fuse")}
    wall = {"local": t["local_sum"], **server, "server_total": t["server_fuse"] + t.get("evaluation", 0.0)}
    wall["total"] = wall["local"] + wall["server_total"]
    return {
        "table": table,
        "method": result["method"], "dataset": result["dataset"], "partition": result["partition"],
        "alpha": result["alpha"], "num_clients": result["num_clients"], "seed": result["seed"],
        "preset": result["preset"],
        "accuracy_final": g["accuracy_final"], "accuracy_best": g.get("accuracy_best", g["accuracy_final"]),
        "ensemble_accuracy": g.get("ensemble_accuracy"),
        # an adapting teacher (running calibration) is scored again after distillation: ensemble_accuracy is
        # then the teacher the student ended with, this the one it started from
        "ensemble_accuracy_start": g.get("ensemble_accuracy_start"),
        "mean_ensemble_accuracy": g.get("mean_ensemble_accuracy"),
        "client_accuracy": [c["local_accuracy"] for c in clients],
        "client_archs": [c["arch"] for c in clients],
        "round": result.get("round", 1), "num_rounds": result.get("num_rounds", 1),
        "wall_s": wall,
        "upload_bytes": sum(c["received_bytes"] for c in clients) / max(len(clients), 1),
        "raw_param_bytes": sum(c["raw_bytes"] for c in clients) / max(len(clients), 1),
        "overrides": overrides, "overrides_key": overrides_key(overrides),
        # a replay in a worker process says which code it ran (the tree may have changed since)
        "code_version": result.get("code_version") or run_code_version(result) or code_version(),
        "machine": machine(),
        "recorded_at": datetime.now().isoformat(timespec="seconds"),
        **(extra or {}),
    }


def not_applicable_record(table: str, method: str, run_config: dict, reason: str, overrides: dict,
                          extra: dict | None = None) -> dict:
    """A record saying that `method` cannot run on this cell's fleet, and why (tables show "n/a")."""
    return {
        "table": table, "method": method, "status": "not-applicable", "reason": reason,
        "dataset": run_config["dataset"], "partition": run_config["partition"], "alpha": run_config["alpha"],
        "num_clients": run_config["num-clients"], "seed": run_config["seed"], "preset": run_config["preset"],
        "accuracy_final": None, "accuracy_best": None, "ensemble_accuracy": None, "client_accuracy": [],
        "wall_s": {}, "overrides": overrides, "overrides_key": overrides_key(overrides),
        "code_version": code_version(), "machine": machine(),
        "recorded_at": datetime.now().isoformat(timespec="seconds"),
        **(extra or {}),
    }


def repo_relative(path: str | Path) -> str | None:
    """`path` relative to the checkout (committed records name no machine's paths), None if outside it."""
    for candidate in (Path(path).absolute(), Path(path).resolve()):  # a symlinked runs/ resolves outside it
        if candidate.is_relative_to(REPO_ROOT):
            return str(candidate.relative_to(REPO_ROOT))
    return None


def append_record(record: dict, table: str | None = None) -> Path:
    if record.get("run_dir"):
        record = {**record, "run_dir": repo_relative(record["run_dir"]) or record["run_dir"]}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{table or record['table']}.jsonl"
    line = (json.dumps(record, sort_keys=True) + "\n").encode()
    # one write on an O_APPEND descriptor: benchmark processes running side by side append whole lines
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            line = b"\n" + line  # a line torn by a killed writer must not swallow this record
        os.write(fd, line)
    finally:
        os.close(fd)
    return path


def append_to_json_list(path: Path, record: dict, indent: int = 1) -> list[dict]:
    """A benchmark whose records are one JSON list per file (one entry per run): add `record`, rewrite the
    file, return every entry (for the benchmark's report)."""
    records = json.loads(path.read_text()) if path.is_file() else []
    records.append(record)
    path.write_text(json.dumps(records, indent=indent) + "\n")
    return records


def load_records(table: str | None = None) -> list[dict]:
    """Every record of `table` (all tables: None). A line that is not a JSON object (torn by a process killed
    while it wrote) is skipped with a warning: that one record is lost and a resumable benchmark redoes it."""
    records = []
    for path in sorted(RESULTS_DIR.glob("*.jsonl")):
        if table and path.stem != table:
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict):
                log.warning("%s:%d is not a JSON record (a torn write?); skipped", path, number)
                continue
            records.append(record)
    return records


def release_version() -> str | None:
    """The commit of the release run this process belongs to ($ONESHOT_FL_RELEASE), None outside one."""
    return os.environ.get(RELEASE_ENV) or None


def has_record(table: str, match: dict) -> bool:
    """A record of `table` has every field of `match`; in a release run, a record of the release commit only (what
    other code measured is run again)."""
    release = release_version()
    return any(all(r.get(k) == v for k, v in match.items()) and (release is None or r.get("code_version") == release)
               for r in load_records(table))


def provenance_line(records) -> str:
    """The machines and code versions behind a rendered table, one sentence."""
    records = list(records)
    machines = sorted({json.dumps(r["machine"], sort_keys=True) for r in records})
    versions = sorted({r.get("code_version", "?") for r in records})
    return f"Machines: {'; '.join(machines) or 'none'}; code: {', '.join(versions) or 'none'}."
