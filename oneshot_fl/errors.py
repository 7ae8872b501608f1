"""Errors a user can cause and fix, in one leaf module (it imports nothing of the project), so that the
command line, the launcher, replay and the core all name them without importing each other.

EXPECTED_ERRORS is what `oneshot-fl run`, `partition`, `replay` and `list` print as one line without a
traceback, `oneshot-fl: error: <error_line(exc)>`: a bad config, a failed run, missing or damaged data, a
damaged uploads archive, too few valid uploads."""

from __future__ import annotations

from pathlib import Path


class ConfigError(ValueError):
    """A run-config value is unknown, of the wrong type or out of range."""


class FleetNotSupported(ConfigError):
    """The method cannot run on this fleet at all (e.g. parameter averaging of mixed architectures);
    benchmarks report it as "not applicable" rather than as a failure."""


class RunFolderTaken(ConfigError):
    """The run folder already holds a finished run; it is never overwritten."""


class RunFailed(RuntimeError):
    """The Flower run ended in a status other than finished:completed."""


class QuorumError(RuntimeError):
    """Too few valid uploads to build a global model; nothing is written as a result."""


class DatasetNotFoundError(FileNotFoundError):
    """The dataset's files are not in the data directory and could not be downloaded."""


class DatasetDamagedError(ValueError):
    """A dataset file is there but cannot be read as what it should be (truncated, corrupt, another format)."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path}: {problem}; replace the file (or delete it and set download=true to fetch it again)")


class ArchiveError(ValueError):
    """The archive's manifest cannot be read as one (damaged, truncated, edited by hand)."""


def error_line(exc: BaseException) -> str:
    """An error's message on one line (a multi-line message's lines joined by spaces)."""
    return " ".join(line.strip() for line in str(exc).splitlines() if line.strip())


EXPECTED_ERRORS: tuple[type[BaseException], ...] = (ConfigError, FileNotFoundError, RunFailed, QuorumError,
                                                    DatasetDamagedError, ArchiveError)
