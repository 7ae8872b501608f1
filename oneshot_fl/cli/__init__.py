"""Moved: the `oneshot-fl` command line is launcher.cli. What is left here only names the new place, so that
`python -m oneshot_fl.cli` and an import from oneshot_fl.cli fail in one line that says where to go."""

MOVED = "oneshot_fl.cli moved to launcher.cli"


def __getattr__(name: str):
    if name.startswith("__"):  # Python's own lookups (__path__, __wrapped__, ...) get the usual answer
        raise AttributeError(name)
    raise ImportError(f"{MOVED}: import {name} from launcher.cli")
