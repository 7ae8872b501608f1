"""The ServerApp computes after the clients have returned: it takes `server-threads` (0 = all cores),
not the per-client `threads` the launcher pins."""

import pytest
from flwr.app import Context, RecordDict

import server_app.app as server_app
from oneshot_fl.config import ConfigError, default_run_config, from_run_config


class _Stop(Exception):
    pass


def _threads_the_server_sets(monkeypatch, overrides):
    seen = []
    monkeypatch.setattr(server_app, "set_threads", lambda n=0, concurrent_processes=1: seen.append(n))

    def stop(grid, num_clients):
        raise _Stop
    monkeypatch.setattr(server_app, "check_simulated_fleet", stop)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(),
                      run_config={**default_run_config(), **overrides})
    with pytest.raises(_Stop):
        server_app.main(None, context)  # @app.main() registers the function and returns it as is
    return seen


def test_server_threads_default_is_all_cores_and_explicit_values_win(monkeypatch):
    assert _threads_the_server_sets(monkeypatch, {"threads": 1}) == [0]  # set_threads(0): all cores
    assert _threads_the_server_sets(monkeypatch, {"threads": 1, "server-threads": 3}) == [3]


def test_server_threads_must_not_be_negative():
    assert from_run_config({**default_run_config(), "server-threads": 2}).server_threads == 2
    with pytest.raises(ConfigError, match="server-threads"):
        from_run_config({**default_run_config(), "server-threads": -1})
