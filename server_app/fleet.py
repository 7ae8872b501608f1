"""Fail fast when a simulation has the wrong number of SuperNodes for the run.

In Flower's simulation runtime every virtual SuperNode is registered when the run starts (none
connect later) and node i gets `partition-id=i num-partitions=<num-supernodes>`; a client refuses
to train when num-partitions differs from the run's num-clients. So a simulation whose SuperNode
count differs from num-clients cannot succeed: say so at once, naming the flag that fixes it,
instead of waiting node-wait-timeout (600 s) for nodes that will never come. Flower 1.41's local
simulation starts 2 SuperNodes unless told otherwise. Deployments (SuperNodes that connect over
time) are left to the strategy's node wait.
"""

from __future__ import annotations

import time

from flwr.serverapp import Grid

from oneshot_fl.config import ConfigError


def is_simulation(grid: Grid) -> bool:
    """True when the ServerApp runs inside Flower's simulation runtime (in-memory grid)."""
    try:
        from flwr.superlink.grid import InMemoryGrid  # where Flower 1.41 keeps it; other versions may not
    except ImportError:  # pragma: no cover - layout of other Flower versions
        return type(grid).__name__ == "InMemoryGrid"
    return isinstance(grid, InMemoryGrid)


def fleet_size_error(num_nodes: int, num_clients: int) -> str | None:
    """The message for a simulation of `num_nodes` SuperNodes running a `num_clients` run, or None."""
    if num_nodes == num_clients:
        return None
    return (f"this simulation has {num_nodes} SuperNodes but the run has num-clients={num_clients} "
            f"(one SuperNode per client). Run it with --federation-config \"num-supernodes={num_clients}\" "
            f"(or once: flwr federation simulation-config --num-supernodes {num_clients}), or set "
            f"num-clients={num_nodes}")


def check_simulated_fleet(grid: Grid, num_clients: int, settle: float = 2.0, timeout: float = 60.0,
                          poll: float = 0.25) -> None:
    """In a simulation, wait until the registered SuperNodes stop changing (they are registered
    right after the ServerApp starts), then raise ConfigError unless there are num-clients of them.
    A no-op outside simulations."""
    if not is_simulation(grid):
        return
    deadline = time.monotonic() + timeout
    count, stable_since = len(grid.get_node_ids()), time.monotonic()
    while time.monotonic() < deadline:
        if count >= num_clients or (count and time.monotonic() - stable_since >= settle):
            break
        time.sleep(poll)
        now_count = len(grid.get_node_ids())
        if now_count != count:
            count, stable_since = now_count, time.monotonic()
    message = fleet_size_error(count, num_clients)
    if message:
        raise ConfigError(message)
