"""The `oneshot-fl` command line: one-line errors, exit codes, --version, list; and the
--run-config parsing it shares with replay and partition."""

from __future__ import annotations

import tomllib

import pytest

from launcher import cli
from oneshot_fl.config import ConfigError
from launcher.launch import RunFailed, override_hint, parse_overrides, run_config_items, toml_value


def test_parse_overrides_merges_key_by_key():
    merged = parse_overrides(["feddf.source='dataset' alpha=0.1", "feddf.lr=0.1", "alpha=0.3 seed=2"])
    assert merged == {"feddf.source": "dataset", "feddf.lr": 0.1, "alpha": 0.3, "seed": 2}


@pytest.mark.parametrize("item, leftover", [("alpha=", "alpha="), ("alpha", "alpha"), ("=3", "=3"),
                                            ("alpha=0.1 =", "="), ("seed=1 oops", "oops")])
def test_parse_overrides_refuses_what_is_not_a_pair(item, leftover):
    # flwr keeps the pairs it finds and drops the rest: "alpha=" would be a run at the default alpha
    with pytest.raises(ConfigError, match=f"{leftover!r} is not a key=value pair"):
        parse_overrides([item])
    assert parse_overrides(["run-name='a b' seed=2"]) == {"run-name": "a b", "seed": 2}


def test_a_key_given_twice_in_one_string_is_named():
    # flwr parses the string as TOML and says only "invalid format"; across -c items the later one wins
    with pytest.raises(ConfigError, match="'seed=1 alpha=0.1 seed=2': seed given twice in one string"):
        parse_overrides(["seed=1 alpha=0.1 seed=2"])
    assert parse_overrides(["seed=1", "seed=2"]) == {"seed": 2}
    assert parse_overrides(["run-name='seed=1 seed=2' seed=3"]) == {"run-name": "seed=1 seed=2", "seed": 3}


def test_parse_overrides_reads_toml_files(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('method = "dense"\n[distill]\nepochs = 3\n')
    assert parse_overrides([str(path), "seed=1"]) == {"method": "dense", "distill.epochs": 3, "seed": 1}


@pytest.mark.parametrize("item, fix", [
    ("method=fedavg", "method='fedavg'"),
    ("alpha=0.1 method=fedavg dataset='mnist'", "method='fedavg'"),
    ("partition=2c/c client-models=cnn2,lenet", "partition='2c/c' client-models='cnn2,lenet'"),
])
def test_unquoted_strings_get_a_one_line_hint(item, fix):
    with pytest.raises(ConfigError) as err:
        parse_overrides([item])
    message = str(err.value)
    assert message.startswith(f"string values need quotes: {fix}") and "\n" not in message
    assert override_hint("method='fedavg' alpha=0.1") is None


@pytest.mark.parametrize("value", [True, False, 3, -1, 0.5, 1e-5, "fedavg", "it's", 'say "hi"', "a\\b", "2c/c", ""])
def test_toml_value_round_trips(value):
    assert tomllib.loads(f"v = {toml_value(value)}")["v"] == value


def test_run_config_items_survive_flwr_parsing():
    items = {"method": "fedavg", "partition": "2c/c", "run-name": "it's a run", "upload-half": True, "alpha": 0.1}
    line = " ".join(run_config_items(items))  # as pin_run_config writes --run-config
    assert parse_overrides([line]) == items


def test_run_with_an_unquoted_string_fails_in_one_line(capsys):
    assert cli.main(["run", "-c", "method=fedavg"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "oneshot-fl: error: string values need quotes: method='fedavg' (e.g. -c \"method='fedavg'\")"


def test_fewer_supernodes_than_the_run_requires_fail_before_anything_starts(capsys, monkeypatch):
    import launcher.launch as launch

    monkeypatch.setattr(launch, "follow_run", lambda *a, **k: pytest.fail("a run was submitted"))
    assert cli.main(["run", "--num-supernodes", "3", "-c", "num-clients=5"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("oneshot-fl: error: --num-supernodes 3 is fewer than the 5 clients the run requires "
                   "(num-clients=5, min-clients=0); lower min-clients to simulate absent clients")
    assert cli.main(["run", "--num-supernodes", "3", "-c", "num-clients=5 min-clients=4"]) == 1
    assert "fewer than the 4 clients" in capsys.readouterr().err

    def submitted(*args, **kwargs):
        raise launch.RunFailed("stopped here")

    monkeypatch.setattr(launch, "follow_run", submitted)  # enough nodes for min-clients: a warning, then the run
    assert cli.main(["run", "--num-supernodes", "3", "-c", "num-clients=5 min-clients=3 node-wait-timeout=30"]) == 1
    err = capsys.readouterr().err
    assert ("warning: 3 SuperNodes for num-clients=5: the server waits node-wait-timeout=30s for the other 2, "
            "then goes on with 3") in err and "stopped here" in err


def test_bad_values_fail_in_one_line(capsys):
    assert cli.main(["partition", "-c", "dataset='nope'"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dataset='nope'" in err and "Traceback" not in err


@pytest.mark.parametrize("exc, code, text", [
    (ConfigError("num-clients=0 is below 1"), 1, "oneshot-fl: error: num-clients=0 is below 1"),
    (RunFailed("run 7 wrote no result.json"), 1, "oneshot-fl: error: run 7 wrote no result.json"),
    (FileNotFoundError("dataset files not found in /x"), 1, "oneshot-fl: error: dataset files not found in /x"),
    (KeyboardInterrupt(), 130, "oneshot-fl: interrupted"),
    (RuntimeError("boom"), 1, "oneshot-fl: unexpected error: RuntimeError: boom (--debug shows the traceback)"),
])
def test_errors_end_in_one_line_and_an_exit_code(exc, code, text, capsys):
    def fail(args):
        raise exc

    assert cli.run_command(fail, type("Args", (), {"debug": False})()) == code
    err = capsys.readouterr().err
    assert err.strip() == text and "Traceback" not in err


def test_quorum_errors_are_expected():
    from oneshot_fl.errors import QuorumError

    assert QuorumError in cli.expected_errors()


def test_debug_shows_the_traceback(capsys):
    def fail(args):
        raise ConfigError("bad")

    assert cli.run_command(fail, type("Args", (), {"debug": True})()) == 1
    assert "Traceback" in capsys.readouterr().err


def test_debug_flag_before_or_after_the_subcommand(monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "run_command", lambda func, args: seen.append(getattr(args, "debug", False)) or 0)
    cli.main(["--debug", "list", "methods"])
    cli.main(["list", "methods", "--debug"])
    cli.main(["list", "methods"])
    assert seen == [True, True, False]


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("oneshot-fl ") and "flwr 1.41.0" in out and "torch " in out


def test_list_comes_from_the_registries(capsys):
    from oneshot_fl.config import PARTITIONS
    from oneshot_fl.data.datasets import DATASETS
    from oneshot_fl.models.registry import ARCHITECTURES
    from oneshot_fl.presets import PRESETS
    from strategies import STRATEGIES

    for what, names in (("methods", STRATEGIES), ("presets", PRESETS), ("datasets", DATASETS),
                        ("models", ARCHITECTURES), ("partitions", PARTITIONS)):
        assert cli.main(["list", what]) == 0
        listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
        assert set(names) <= set(listed), (what, listed)
