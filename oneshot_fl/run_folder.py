"""The run folder: where a run writes, who writes into it, and when a folder may not be written into.

A finished run (result.json) is never overwritten; a folder holding files that no run wrote is someone else's
and is refused. One process at a time owns a folder: it holds an exclusive flock on the folder's `run.lock`, which
the kernel drops when the process ends, however it ends. A launcher (`oneshot-fl run`, the deploy tool) takes it
before anything starts and keeps it until the run has ended (`claim_run_folder`); the ServerApp, which is the
process that writes, checks again before it writes (`serving`): it goes on under the lock of the launcher that
submitted it, takes the lock itself where no launcher holds it (a plain `flwr run`), and is refused otherwise. An
unfinished folder is continued only by a launch of the same resolved run config (its launch record, launch.json);
another config is refused with the difference, unless --force starts the folder over.

A default run name carries a time stamp, so `oneshot-fl run` finds the folder of an earlier, unfinished
launch of the same command by its launch record: the same resolved run config, and no process holding it."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import sys
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Iterator

from oneshot_fl.config import RunConfig, resolve_data_dir, resolve_output_dir
from oneshot_fl.errors import RunFolderTaken


def run_name_prefix(cfg: RunConfig) -> str:
    """The default run name without its time stamp: <method>-<dataset>-<partition>-k<clients>-s<seed>-."""
    part = cfg.partition.replace("/", "") + (f"{cfg.alpha:g}" if cfg.partition in ("dirichlet", "niid-bench") else "")
    return f"{cfg.method}-{cfg.dataset}-{part}-k{cfg.num_clients}-s{cfg.seed}-"


def default_run_name(cfg: RunConfig) -> str:
    return f"{run_name_prefix(cfg)}{datetime.now():%Y%m%d-%H%M%S}"


LAUNCH_RECORD = "launch.json"  # the resolved config of the run in the folder (claim_run_folder, serving)
LOCK_FILE = "run.lock"  # held (flock) by the process that owns the folder: RunFolderLock

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
    """Not a finished run (check_not_finished). A folder that holds files but nothing a run writes is someone
    else's: the run's files would mix into it (and overwrite any of the same names), so it is refused too. Whether
    an unfinished run's folder may be continued is `check_continues`'s question (under the folder's lock)."""
    check_not_finished(run_dir)
    if run_dir.is_dir():
        entries = sorted(entry.name for entry in run_dir.iterdir() if entry.name != LOCK_FILE)
        if entries and not any(name in RUN_FOLDER_ENTRIES or name.startswith("round-") for name in entries):
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise RunFolderTaken(f"run folder {run_dir} holds files that no run wrote ({shown}); "
                                 "choose another run-name / output folder (a new or empty one)")


def run_dir_of(cfg: RunConfig, run_dir: Path | None = None) -> Path:
    """The run's folder: `run_dir` when given (a replay's --out), else <output-dir>/<run-name>."""
    return run_dir if run_dir is not None else resolve_output_dir(cfg) / (cfg.run_name or default_run_name(cfg))


# --- who owns a folder: one process at a time, by an flock that dies with it -------------------------------

class RunFolderLock:
    """An exclusive flock on <run folder>/run.lock, and what the file says about the process that holds it.

    The kernel drops an flock when its process ends, however it ends (Ctrl-C, SIGKILL, a closed terminal), so a
    lock is never left behind and no process id has to be checked for being alive."""

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir, self.fd = run_dir, fd
        self.info: dict = {}

    @classmethod
    def take(cls, run_dir: Path, create: bool = True) -> RunFolderLock | None:
        """The folder's lock (the folder is made when `create`), or None while another process holds it (or,
        without `create`, when the folder is not there)."""
        run_dir, path = Path(run_dir), Path(run_dir) / LOCK_FILE
        while True:
            if create:
                run_dir.mkdir(parents=True, exist_ok=True)
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except FileNotFoundError:  # the folder is gone (its holder removed it as it let go)
                if not create:
                    return None
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return None
            try:
                current = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                current = False
            if current:
                return cls(run_dir, fd)
            os.close(fd)  # the holder removed this file as it let go (release): lock the one there now

    def record(self, **info) -> None:
        """Write into the lock file who holds it (pid, host, command, the Flower run id it submitted): what a refused
        launch is told, and how a ServerApp knows that the launcher holding the lock is its own (`serving`)."""
        self.info.update(info)
        data = json.dumps(self.info).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    def release(self) -> None:
        """Let go. The file goes first: a process that opened it meanwhile finds, once it has the lock, that the
        file is no longer the folder's lock file, and takes the new one (`take`)."""
        if self.fd < 0:
            return
        try:
            (self.run_dir / LOCK_FILE).unlink(missing_ok=True)
        except OSError:
            pass
        os.close(self.fd)
        self.fd = -1


def _read_object(path: Path) -> dict:
    """The JSON object in `path`; {} when the file is missing, unreadable or holds anything else."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def read_holder(run_dir: Path) -> dict:
    """What the lock file of `run_dir` says about its holder ({} when it says nothing readable)."""
    return _read_object(Path(run_dir) / LOCK_FILE)


def describe_holder(info: dict) -> str:
    """'`oneshot-fl run -c ...` (pid 123 on host, since 2025-01-01T12:00:00)' for a refusal's one line."""
    if not info.get("pid"):
        return "another process"
    where = f"pid {info['pid']} on {info.get('host', '?')}, since {info.get('since', '?')}"
    return f"`{info['command']}` ({where})" if info.get("command") else f"another process ({where})"


def this_process(command: str) -> dict:
    """The lock file's record of this process: a refused launch names it."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": datetime.now().isoformat(timespec="seconds"),
            "command": command}


def take_or_refuse(run_dir: Path) -> RunFolderLock:
    """The folder's lock, or RunFolderTaken naming the process that holds it (a run in progress)."""
    lock = RunFolderLock.take(run_dir)
    if lock is None:
        raise RunFolderTaken(f"run folder {run_dir} is in use by {describe_holder(read_holder(run_dir))}; "
                             "choose another run-name, or wait until that run ends")
    return lock


def let_go(lock: RunFolderLock) -> None:
    """Release a folder's lock; a folder that holds nothing but the launch's bookkeeping (its launch record and
    lock file: the run wrote nothing) is removed with it, so a refused or failed launch leaves no empty folder."""
    run_dir = lock.run_dir
    try:
        if not run_files(run_dir):
            (run_dir / LAUNCH_RECORD).unlink(missing_ok=True)
    except OSError:
        pass
    lock.release()
    try:
        run_dir.rmdir()  # only if empty: anything else there stays
    except OSError:
        pass


_HELD: dict[Path, RunFolderLock] = {}  # the folders this process's launches hold, until release_run_folder


def record_run_id(run_dir: Path, run_id: int) -> None:
    """Write the Flower run this launch submitted into its folder's lock file: the ServerApp of that run goes on
    under the launcher's lock, a ServerApp of any other run is refused (`serving`). A no-op for a folder this
    process does not hold (a remote ServerApp's)."""
    lock = _HELD.get(Path(run_dir))
    if lock is not None:
        lock.record(run_id=run_id)


def release_run_folder(run_dir: Path) -> None:
    """The launch is over: let go of its folder (`let_go`)."""
    lock = _HELD.pop(Path(run_dir), None)
    if lock is not None:
        let_go(lock)


# --- which folder a launch writes: a new one, or the unfinished run of the same config ------------------------

_STAMP = re.compile(r"\d{8}-\d{6}(-\d+)?")  # the time stamp, and a count when one second gave two launches
FORCE_HINT = "add --force to start it over (the unfinished run's files there, its checkpoint among them, are " \
             "removed first)"


def launch_identity(cfg: RunConfig, pins: dict | None = None) -> dict:
    """What makes two launches the same run: the resolved run config (preset applied) with the launcher's pins
    (threads), the data and output folders as absolute paths, without the run name. The ServerApp of a launch
    computes the same from the run config it is given (the pins are in it)."""
    flat = {**cfg.flat, **(pins or {})}
    flat["data-dir"] = str(flat.get("data-dir") or resolve_data_dir(cfg))
    flat["output-dir"] = str(Path(flat.get("output-dir") or resolve_output_dir(cfg)).expanduser().resolve())
    return {key: value for key, value in sorted(flat.items()) if key != "run-name"}


def run_files(run_dir: Path) -> list[str]:
    """What a run wrote into the folder, beside a launch's bookkeeping (launch record, lock file, temporary files)."""
    try:
        return sorted(entry.name for entry in Path(run_dir).iterdir()
                      if entry.name not in (LAUNCH_RECORD, LOCK_FILE) and not entry.name.startswith("."))
    except OSError:
        return []


def read_launch_record(run_dir: Path) -> dict:
    """The run folder's launch record ({} when it has none readable)."""
    return _read_object(Path(run_dir) / LAUNCH_RECORD)


_UNSET = object()


def _shown(values: dict, key: str) -> str:
    if key not in values:
        return "unset"
    value = values[key]
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


def config_difference(recorded: dict, now: dict, shown: int = 3) -> str:
    """"method: 'dense' in the folder, 'fedavg' now" for the keys where two launch identities differ (the method
    first, then by name; at most `shown`, then how many more)."""
    keys = sorted((key for key in recorded.keys() | now.keys() if recorded.get(key, _UNSET) != now.get(key, _UNSET)),
                  key=lambda key: (key != "method", key))
    parts = [f"{key}: {_shown(recorded, key)} in the folder, {_shown(now, key)} now" for key in keys[:shown]]
    if len(keys) > shown:
        parts.append(f"{len(keys) - shown} more")
    return "; ".join(parts)


def check_continues(run_dir: Path, identity: dict, *, force: bool, how_to_force: str = FORCE_HINT) -> bool:
    """Under the folder's lock: True when this launch continues the unfinished run there (the same resolved config
    recorded in its launch record), False when it starts a new one (nothing there yet, or `force` removed what the
    unfinished run wrote). Refused (RunFolderTaken, one line) without `force`: the folder holds an unfinished run of
    another config (the difference is named), or one whose config is not recorded."""
    files = run_files(run_dir)
    if not files:
        return False
    recorded = read_launch_record(run_dir).get("identity")
    if recorded == identity and not force:
        return True
    if not force:
        what = (f"an unfinished run of another config ({config_difference(recorded, identity)})"
                if isinstance(recorded, dict) else
                f"an unfinished run whose config is not recorded (no {LAUNCH_RECORD})")
        raise RunFolderTaken(f"run folder {run_dir} holds {what}; choose another run-name, or {how_to_force}")
    removed = [name for name in files if name in RUN_FOLDER_ENTRIES or name.startswith("round-")]
    for name in removed:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    print(f"[oneshot-fl] --force: starting {run_dir} over; removed the unfinished run's {', '.join(removed)}",
          file=sys.stderr, flush=True)
    return False


def unfinished_run_folders(cfg: RunConfig, output_dir: Path, identity: dict) -> list[Path]:
    """Folders under `output_dir` with this config's default name (any time stamp), newest first, that a launch of
    the same resolved run config (`launch_identity`) left unfinished (no result.json). One of them may still be
    running: its lock says so (`claim_run_folder`)."""
    prefix = run_name_prefix(cfg)
    try:
        names = sorted(entry.name for entry in Path(output_dir).iterdir()
                       if entry.name.startswith(prefix) and _STAMP.fullmatch(entry.name[len(prefix):])
                       and entry.is_dir())
    except OSError:
        return []
    return [Path(output_dir) / name for name in reversed(names)
            if not (Path(output_dir) / name / "result.json").exists()
            and read_launch_record(Path(output_dir) / name).get("identity") == identity]


def record_launch(run_dir: Path, identity: dict) -> None:
    """Write the folder's launch record: the resolved config of the run in it (and which process launched it)."""
    record = {"identity": identity, "host": socket.gethostname(), "pid": os.getpid()}
    tmp = run_dir / f".{LAUNCH_RECORD}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(record, indent=1))
    os.replace(tmp, run_dir / LAUNCH_RECORD)


def new_run_folder(output_dir: Path, name: str) -> RunFolderLock:
    """A folder no launch has used, `name` or, when that exists (another launch of this config in the same second),
    `name`-2, -3, ...; made by this process (mkdir is atomic: two launches never get one folder) and locked."""
    folder, count = Path(output_dir) / name, 1
    while True:
        try:
            folder.mkdir(parents=True)
            break
        except FileExistsError:
            count += 1
            folder = Path(output_dir) / f"{name}-{count}"
    return take_or_refuse(folder)


def claim_run_folder(cfg: RunConfig, output_dir: Path, new_name: str, pins: dict, *, resume: bool = True,
                     force: bool = False, command: str = "") -> str:
    """The run name this launch writes under, with its folder locked by this process until `release_run_folder`.

    With `run-name`: that folder, refused while another process holds it, and when it holds an unfinished run of
    another config (unless `force`, which starts it over). Without: with `resume` (and no `force`), the newest folder
    the same command left unfinished that no process holds (the run continues there: its distillation checkpoint
    resumes), else `new_name` (new_name-2, ... when taken). The folder gets this launch's record."""
    identity = launch_identity(cfg, pins)
    output_dir, lock, continues = Path(output_dir), None, False
    if cfg.run_name:
        lock = take_or_refuse(output_dir / cfg.run_name)
        try:
            check_run_dir_free(lock.run_dir)  # again under the lock: the run that held it may have just finished
            continues = check_continues(lock.run_dir, identity, force=force)
        except BaseException:
            let_go(lock)
            raise
    elif resume and not force:
        for folder in unfinished_run_folders(cfg, output_dir, identity):
            lock = RunFolderLock.take(folder, create=False)
            if lock is None:
                continue  # still running
            if (folder / "result.json").exists() or read_launch_record(folder).get("identity") != identity:
                lock.release()  # it finished, or was started over, before the lock was ours
                lock = None
                continue
            continues = True
            break
    if lock is None:
        lock = new_run_folder(output_dir, new_name)
    run_dir = lock.run_dir
    if continues:
        print(f"[oneshot-fl] continuing the unfinished run of this command in {run_dir} (what it saved there is "
              "reused: the archived uploads, no client trains again, and the checkpoints; the log says what)",
              file=sys.stderr, flush=True)
    record_launch(run_dir, identity)
    lock.record(**this_process(command))
    _HELD[run_dir] = lock
    return run_dir.name


# --- the ServerApp's check: the last line of defence -------------------------------------------------------

class _Successor(threading.Thread):
    """Takes the folder's lock once the launcher that holds it lets go while this ServerApp still runs (the launcher
    was killed, or its terminal closed): the folder stays held by a process that writes into it."""

    def __init__(self, run_dir: Path, info: dict):
        super().__init__(daemon=True, name="run-folder-successor")
        self.run_dir, self.info = run_dir, info
        self.stopped = threading.Event()
        self.lock: RunFolderLock | None = None

    def run(self) -> None:
        while not self.stopped.wait(1.0):
            lock = RunFolderLock.take(self.run_dir, create=False)
            if lock is not None:
                lock.record(**self.info)
                self.lock = lock
                return

    def finish(self) -> None:
        self.stopped.set()
        self.join(10)
        if self.lock is not None:
            self.lock.release()


@contextlib.contextmanager
def serving(cfg: RunConfig, run_id: int, command: str, wait: float = 120.0) -> Iterator[tuple[Path, dict]]:
    """The ServerApp's hold on its run folder while it runs: yields (run folder, the launcher's lock record).

    A launcher checked the folder before anything started and holds its lock: when the lock record names this
    Flower run, the ServerApp goes on under it (it waits up to `wait` s for the launcher to write the run id, which
    it learns only once `flwr run` returns), and takes the lock over if the launcher lets go first. A plain `flwr
    run` has no launcher: the ServerApp takes the lock itself and makes the launcher's checks (a run in progress,
    an unfinished run of another config; without run-name a new folder), and yields {} as the record. A folder
    held by any other process is refused (RunFolderTaken, one line)."""
    log = logging.getLogger("oneshot_fl")
    if not cfg.run_name:  # a plain `flwr run` without run-name: a new folder (the launcher always pins the name)
        lock = new_run_folder(resolve_output_dir(cfg), default_run_name(cfg))
    else:
        run_dir = resolve_output_dir(cfg) / cfg.run_name
        check_run_dir_free(run_dir)  # before the lock file goes into someone else's folder
        deadline = time.monotonic() + wait
        while (lock := RunFolderLock.take(run_dir)) is None:
            holder = read_holder(run_dir)
            if holder.get("run_id") == run_id:
                successor = _Successor(run_dir, {**holder, **this_process(holder.get("command", command))})
                successor.start()
                try:
                    yield run_dir, holder
                finally:
                    successor.finish()
                return
            if holder.get("run_id") is not None or time.monotonic() > deadline:
                raise RunFolderTaken(f"run folder {run_dir} is in use by {describe_holder(holder)}; choose another "
                                     "run-name, or wait until that run ends")
            time.sleep(0.5)
    try:
        check_run_dir_free(lock.run_dir)
        identity = launch_identity(cfg)
        if check_continues(lock.run_dir, identity, force=False,
                           how_to_force="start it over with `oneshot-fl run --force` (or empty that folder)"):
            log.info("continuing the unfinished run of this config in %s", lock.run_dir)
        record_launch(lock.run_dir, identity)
        lock.record(**this_process(command), run_id=run_id)
    except BaseException:
        let_go(lock)
        raise
    try:
        yield lock.run_dir, {}
    finally:
        let_go(lock)


def interrupted_message(run_dir: Path) -> str:
    """What an interrupted `oneshot-fl run` says about its unfinished run and the two ways on."""
    if (run_dir / "result.json").is_file():
        return f"[oneshot-fl] the run had finished: its results are in {run_dir}"
    if not run_dir.is_dir():
        return "[oneshot-fl] the run had written nothing yet; run the same command again to start it"
    uploads = run_dir / "uploads"
    archived = (uploads / "manifest.json").is_file()
    clients = "the clients' archived uploads are reused, no client trains again" if archived else \
        "the clients train again"
    lines = [f"[oneshot-fl] the unfinished run is in {run_dir}",
             f"  - run the same command again to resume it: it continues in that folder ({clients}; the "
             "checkpoints there resume where they stopped)"]
    if archived:
        lines.append(f"  - or run a server method on the clients' saved uploads, without training them again (a new "
                     f"run folder): oneshot-fl replay {uploads} [-c \"method='...'\"]")
    else:
        lines.append("  - (no client uploads were saved yet, so `oneshot-fl replay` has nothing to run on)")
    return "\n".join(lines)
