"""Where a result came from: library versions, code version, machine, device, the user's command.

`collect()` is the `provenance` block of every result.json. The ServerApp of a simulation runs
from the installed app bundle (FLWR_HOME/apps/<publisher>.<app>.<version>.<fab hash>, see
`app_dir`), not from the checkout, so the launcher hands the checkout's git state down through the
environment (`launcher.provenance.launcher_env`); without it (plain `flwr run`, replay, a deployment) the git state is
read from the code's own directory when that is a git checkout.

The command is the user's, never a Flower process's own command line (`flwr-simulation` /
`flwr-serverapp ... --token <credential>`): the ServerApp is told it (`set_command`: the launcher's
command from the run folder's lock file, or, for a plain `flwr run`, the run config it was given
written as that command), and any recorded command has the values of secret-bearing options
(tokens, keys, passwords, secrets) replaced by "***" (`user_command`). A launcher's command is written as the user
typed it (`typed_argv`): `python -m launcher.deploy run ...` or `oneshot-fl run ...`, not the module's file or the
console script's path that sys.argv[0] holds.
"""

from __future__ import annotations

import os
import platform
import re
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
# Flower's own task processes: their command line is Flower's (with the run's --token), never the user's
FLOWER_PROCESSES = ("flwr-simulation", "flwr-serverapp", "flwr-clientapp", "flower-superexec", "flower-superlink",
                    "flower-supernode")
SECRET_OPTION = re.compile(r"--?[\w-]*(token|secret|password|passwd|key)[\w-]*", re.IGNORECASE)
_COMMAND: dict[str, str] = {}  # what set_command told this process
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


def redact(argv: list[str]) -> list[str]:
    """`argv` with the value of every option that names a token, key, password or secret replaced by "***"
    (`--token abc`, `--token=abc`). A key's *file* (a path) is no secret, but a redacted path loses nothing a
    result needs."""
    out, hide = [], False
    for arg in argv:
        if hide:
            out.append("***")
            hide = False
            continue
        name, eq, _ = arg.partition("=")
        if SECRET_OPTION.fullmatch(name):
            out.append(f"{name}=***" if eq else arg)
            hide = not eq
        else:
            out.append(arg)
    return out


def shell_join(argv: list[str]) -> str:
    """A command line as a shell would take it back, written as a person would: an argument holding TOML's single
    quotes (-c "method='dense'") in double quotes where that needs no escape, else shlex's quoting."""
    def quoted(arg: str) -> str:
        if "'" in arg and not set(arg) & set('"$`\\!'):
            return f'"{arg}"'
        return shlex.quote(arg)

    return " ".join(quoted(arg) for arg in argv)


def main_module() -> str | None:
    """The module this process runs as `python -m <module>` (`launcher.deploy.__main__` for `python -m
    launcher.deploy`), else None. sys.argv[0] is then the module's file, which is the __main__ module's file."""
    main = sys.modules.get("__main__")
    spec, file = getattr(main, "__spec__", None), getattr(main, "__file__", None)
    if spec is None or not file or not sys.argv:
        return None
    return spec.name if os.path.abspath(sys.argv[0]) == os.path.abspath(file) else None


def typed_argv(argv: list[str], module: str | None = None) -> list[str]:
    """`argv` (sys.argv) as the user typed it: `python -m <module> ...` for a module run (`module` is
    main_module(): argv[0] is the module's file then, e.g. .../launcher/deploy/__main__.py), an installed command
    by its name (a console script's argv[0] is its path in the environment's bin/: `oneshot-fl`, not
    /.../.venv/bin/oneshot-fl), a script file as it was given."""
    if not argv:
        return []
    if module:
        return ["python", "-m", module.removesuffix(".__main__"), *argv[1:]]
    if Path(argv[0]).suffix == ".py":
        return list(argv)
    return [Path(argv[0]).name, *argv[1:]]


def user_command(argv: list[str] | None = None, module: str | None = None) -> str:
    """This process's command line (or `argv`, run as `python -m module` where `module` is given) as the shell
    command the user typed (typed_argv), secrets redacted; "" for one of Flower's own processes."""
    if argv is None:
        argv, module = sys.argv, main_module()
    if not argv or any(Path(arg).name in FLOWER_PROCESSES for arg in argv[:2]):
        return ""
    return shell_join(redact(typed_argv(list(argv), module)))


def set_command(command: str, source: str) -> None:
    """The user's command for this process's result.json (the ServerApp is told it: its own command line is
    Flower's), and where it comes from (e.g. "launcher")."""
    try:
        command = shell_join(redact(shlex.split(command)))
    except ValueError:  # not a shell command line (unbalanced quotes): kept as it is
        pass
    _COMMAND.update(command=command, source=source)


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
        **command_record(),
    }


def command_record() -> dict[str, str | None]:
    """{"command", "command_source"}: what `set_command` said, else this process's own command line (a replay's
    `oneshot-fl replay ...`), never a Flower process's."""
    if _COMMAND:
        return {"command": _COMMAND["command"] or None, "command_source": _COMMAND["source"]}
    command = user_command()
    return {"command": command or None, "command_source": "this process" if command else "unknown"}
