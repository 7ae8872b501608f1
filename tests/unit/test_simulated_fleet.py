"""A simulation with the wrong number of SuperNodes fails at once, naming the fix."""

from __future__ import annotations

import pytest

from oneshot_fl.config import ConfigError
from server_app import fleet


class FakeGrid:
    def __init__(self, counts):
        self.counts = list(counts)

    def get_node_ids(self):
        return list(range(self.counts.pop(0) if len(self.counts) > 1 else self.counts[0]))


def test_message_names_the_flag():
    assert fleet.fleet_size_error(5, 5) is None
    message = fleet.fleet_size_error(2, 5)
    assert '--federation-config "num-supernodes=5"' in message and "num-clients=2" in message
    assert "flwr federation simulation-config --num-supernodes 5" in message


def test_too_few_simulated_nodes_fail_fast(monkeypatch):
    monkeypatch.setattr(fleet, "is_simulation", lambda grid: True)
    with pytest.raises(ConfigError, match="has 2 SuperNodes but the run has num-clients=5"):
        fleet.check_simulated_fleet(FakeGrid([0, 0, 2]), 5, settle=0.05, poll=0.01, timeout=5)


def test_too_many_simulated_nodes_fail_fast(monkeypatch):
    monkeypatch.setattr(fleet, "is_simulation", lambda grid: True)
    with pytest.raises(ConfigError, match="has 10 SuperNodes but the run has num-clients=5"):
        fleet.check_simulated_fleet(FakeGrid([10]), 5, settle=0.05, poll=0.01, timeout=5)


def test_nodes_registered_late_are_waited_for(monkeypatch):
    monkeypatch.setattr(fleet, "is_simulation", lambda grid: True)
    fleet.check_simulated_fleet(FakeGrid([0, 0, 0, 5]), 5, settle=0.05, poll=0.01, timeout=5)


def test_deployments_are_left_to_the_node_wait():
    fleet.check_simulated_fleet(FakeGrid([0]), 5, timeout=0.1)  # not an in-memory grid: no check


def test_the_simulation_grid_is_recognised():
    from flwr.superlink.grid import InMemoryGrid

    assert fleet.is_simulation(InMemoryGrid.__new__(InMemoryGrid))
    assert not fleet.is_simulation(FakeGrid([0]))
