"""The launcher's part of provenance: the checkout's git state, handed down to the ServerApp through the
environment (the ServerApp runs from the installed app bundle, not from the checkout; oneshot_fl.provenance.collect
reads these entries into result.json). The user's command reaches it through the run folder's lock file instead
(oneshot_fl.run_folder), never through a Flower process's command line."""

from __future__ import annotations

from oneshot_fl.provenance import ENV_COMMIT, ENV_DIRTY, git_state


def launcher_env() -> dict[str, str]:
    """Environment entries that carry the checkout's git state to the ServerApp (set by the launcher on
    the Flower processes it starts)."""
    state = git_state()
    env = {}
    if state["commit"]:
        env[ENV_COMMIT] = state["commit"]
        env[ENV_DIRTY] = "1" if state["dirty"] else "0"
    return env
