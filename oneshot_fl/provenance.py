"""Where a result came from: library versions, code version, machine, device, command line.

`collect()` is the `provenance` block of every result.json. The ServerApp of a simulation runs
from the installed app bundle (FLWR_HOME/apps/<publisher>.<app>.<version>.<fab hash>, see
`app_dir`), not from the checkout, so the launcher hands the checkout's git state and its own
command line down through the environment (ENV_COMMIT, ENV_DIRTY, ENV_COMMAND: launcher.provenance sets
them); without them (plain `flwr run`, replay, a deployment) the git state is read from the code's own
directory when that is a git checkout, and the command line is this process's.
"""

from __future__ import annotations

import os
import platform
import shlex
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

CODE_DIR = Path(__file__).resolve().parents[1]
ENV_COMMIT = "ONESHOT_FL_GIT_COMMIT"
ENV_DIRTY = "ONESHOT_FL_GIT_DIRTY"
ENV_COMMAND = "ONESHOT_FL_COMMAND"
PACKAGES = ("flwr", "torch", "torchvision", "numpy")


def package_versions(names: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    versions = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def git_state(path: Path = CODE_DIR) -> dict[str, Any]:
    """{"commit": sha or None, "dirty": bool or None} of the git checkout holding `path`."""
    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout if done.returncode == 0 else None

    top, commit = git("rev-parse", "--show-toplevel"), git("rev-parse", "HEAD")
    if not commit or not top or Path(top.strip()).resolve() != path.resolve():  # not the code's own checkout
        return {"commit": None, "dirty": None}
    # benchmark records are data the runs append to, not code: a records file changed by the run that is being
    # recorded does not make its code dirty
    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results")
    return {"commit": commit.strip(), "dirty": None if status is None else bool(status.strip())}


def device_name() -> str:
    try:
        import torch  # the launcher imports this module and never needs torch

        if torch.cuda.is_available():
            return f"cuda: {torch.cuda.get_device_name(0)}"
    except Exception:  # noqa: BLE001 - provenance must never fail a run
        pass
    return "cpu"


def collect() -> dict[str, Any]:
    """The provenance block of result.json."""
    if os.environ.get(ENV_COMMIT):
        git = {"commit": os.environ[ENV_COMMIT], "dirty": os.environ.get(ENV_DIRTY) == "1", "source": "launcher"}
    else:
        git = {**git_state(), "source": "code directory"}
    try:
        usable_cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable_cpus = None
    return {
        "versions": {**package_versions(), "python": platform.python_version()},
        "git": git,
        "app_dir": str(CODE_DIR),
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "usable_cpus": usable_cpus,
        "device": device_name(),
        "command": os.environ.get(ENV_COMMAND) or shlex.join(sys.argv),
    }
