"""Moved: the deployment tooling is launcher.deploy. What is left here only names the new place, so that
`python -m oneshot_fl.deploy`, `python -m oneshot_fl.deploy.cli` and an import from oneshot_fl.deploy fail in
one line that says where to go."""

MOVED = "oneshot_fl.deploy moved to launcher.deploy"
HOW = "run the oneshot-fl-deploy command (or python -m launcher.deploy) with the same arguments"


def __getattr__(name: str):
    if name.startswith("__"):  # Python's own lookups (__path__, __wrapped__, ...) get the usual answer
        raise AttributeError(name)
    raise ImportError(f"{MOVED}: import {name} from launcher.deploy")
