"""The launcher's part of provenance: the checkout's git state and the command line, handed down to the
ServerApp through the environment (the ServerApp runs from the installed app bundle, not from the checkout;
oneshot_fl.provenance.collect reads these entries into result.json)."""

from __future__ import annotations

import shlex
import sys

from oneshot_fl.provenance import ENV_COMMAND, ENV_COMMIT, ENV_DIRTY, git_state


def launcher_env(argv: list[str] | None = None) -> dict[str, str]:
    """Environment entries that carry the checkout's git state and the command line to the
    ServerApp (set by the launcher on the Flower processes it starts)."""
    state = git_state()
    env = {ENV_COMMAND: shlex.join(sys.argv if argv is None else argv)}
    if state["commit"]:
        env[ENV_COMMIT] = state["commit"]
        env[ENV_DIRTY] = "1" if state["dirty"] else "0"
    return env
