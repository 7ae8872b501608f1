"""Moved: launcher.deploy.cli (see oneshot_fl.deploy)."""

from oneshot_fl.deploy import MOVED


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    raise ImportError(f"{MOVED}: import {name} from launcher.deploy.cli")
