"""The `oneshot-fl` command line: one-line errors, exit codes, --version, list; and the
--run-config parsing it shares with replay and partition."""

from __future__ import annotations

import re
import shlex
import tomllib

import pytest

from launcher import cli
from oneshot_fl.config import ConfigError, default_run_config
from launcher.launch import RunFailed, check_run_config, parse_overrides, run_config_items, toml_value


def test_parse_overrides_merges_key_by_key():
    merged = parse_overrides(["feddf.source='dataset' alpha=0.1", "feddf.lr=0.1", "alpha=0.3 seed=2"])
    assert merged == {"feddf.source": "dataset", "feddf.lr": 0.1, "alpha": 0.3, "seed": 2}


@pytest.mark.parametrize("item, expected", [
    ("method = 'dense'", {"method": "dense"}),  # spaces around '=', as TOML writes a pair
    ("alpha =0.1  seed= 2", {"alpha": 0.1, "seed": 2}),
    ("local . epochs = 3", {"local.epochs": 3}),  # a dotted key with spaces
    ('"alpha"=0.1', {"alpha": 0.1}),  # a quoted key
    ("local={epochs=3, lr=0.1}", {"local.epochs": 3, "local.lr": 0.1}),  # an inline table
    ("run-name='a b=c' seed=1_000", {"run-name": "a b=c", "seed": 1000}),  # '=' and a space inside a string
    ('run-name="it\'s" alpha=1e-1', {"run-name": "it's", "alpha": 0.1}),  # a basic string with an escape
    ("alpha=+0.5 seed=0x10", {"alpha": 0.5, "seed": 16}),
    ("alpha=0.1\nseed=2", {"alpha": 0.1, "seed": 2}),  # TOML's own separator
])
def test_what_toml_accepts_is_accepted(item, expected):
    assert parse_overrides([item]) == expected


@pytest.mark.parametrize("item, message", [
    ("alpha=", "alpha has no value (its default: 0.5)"),
    ("alpha", "'alpha' is not a key=value pair: alpha has no value (its default: 0.5)"),
    ("=3", "'=3' is not a key=value pair (oneshot-fl list keys shows every key)"),
    ("alpha=0.1 =", "'=' is not a key=value pair"),
    ("seed=1 oops", "'oops' is not a key=value pair (method='oops' if it names a method"),
    ("seed=1 0.1", "'0.1' is not a key=value pair (oneshot-fl list keys shows every key)"),
])
def test_parse_overrides_refuses_what_is_not_a_pair(item, message):
    # flwr keeps the pairs it finds and drops the rest: "alpha=" would be a run at the default alpha
    with pytest.raises(ConfigError, match="^cannot parse run config " + re.escape(repr(item)) + ": "
                       + re.escape(message)):
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


def hinted(message: str) -> str | None:
    """The -c text a refusal proposes, as the shell would pass it ('(e.g. -c "...")' at the end), or None."""
    found = re.search(r"\(e\.g\. -c (.+)\)$", message)
    return shlex.split(found.group(1))[0] if found else None


MALFORMED = [
    "method='dense",  # the closing quote missing (the hint was method=''dense', which failed as "not a pair")
    "method=dense'",  # the opening one
    "method=\"dense'",  # unbalanced
    "method='dense alpha=0.1",  # unclosed, with a pair after it
    "method=dense",  # a bare word as a value
    "dense",  # a bare word as a pair
    "mnist seed=1",  # a dataset's name as a pair
    "alpha=0.5.3",  # the hint was quotes, then "expected a number"
    "alpha=.5",  # a number TOML does not write
    "num-clients=5.",
    "alpha=",
    "alpha= seed=1",
    "alpha",
    "download=True",
    "save-uploads=yes",
    "run-name='my run",
    "partition=2c/c client-models=cnn2,lenet",
    "seed=1 oops",
]


@pytest.mark.parametrize("item", MALFORMED)
def test_every_hint_applied_parses_or_fails_differently(item):
    with pytest.raises(ConfigError) as err:
        parse_overrides([item])
    message = str(err.value)
    assert "\n" not in message
    fix = hinted(message)
    assert fix is not None, message
    try:  # applied as a user would: the whole launch's config check, not only the parse
        check_run_config(parse_overrides([fix]))
    except ConfigError as again:
        assert str(again) != message, (item, fix)


def test_the_hints_are_what_was_meant():
    def fix_of(item):
        with pytest.raises(ConfigError) as err:
            parse_overrides([item])
        return parse_overrides([hinted(str(err.value))])

    assert fix_of("method='dense") == {"method": "dense"}
    assert fix_of("method=\"dense'") == {"method": "dense"}
    assert fix_of("method='dense alpha=0.1") == {"method": "dense", "alpha": 0.1}
    assert fix_of("dense") == {"method": "dense"}
    assert fix_of("mnist seed=1") == {"dataset": "mnist", "seed": 1}
    assert fix_of("alpha=.5") == {"alpha": 0.5}
    assert fix_of("num-clients=5.") == {"num-clients": 5}
    assert fix_of("download=True") == {"download": True}
    assert fix_of("run-name='my run") == {"run-name": "my run"}
    assert fix_of("alpha=0.5.3") == {"alpha": 0.5}  # the default, named as such in the message
    with pytest.raises(ConfigError, match=r"alpha=0\.5\.3 is not a number \(its default: 0\.5\)"):
        parse_overrides(["alpha=0.5.3"])


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


def test_list_keys_prints_every_key_with_its_default_and_help_from_pyproject(capsys):
    assert cli.main(["list", "keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    keys = [line for line in lines if not line.startswith("# ")]
    defaults = default_run_config()
    assert [line.split(" = ", 1)[0] for line in keys] == list(defaults)  # every key, in pyproject's order
    for line, (key, default) in zip(keys, defaults.items()):
        value, _, help_text = line.split(" = ", 1)[1].partition("  # ")
        assert tomllib.loads(f"v = {value}")["v"] == default, line
        assert help_text.strip(), f"{key} has no help: give it a comment in pyproject.toml's [tool.flwr.app.config]"
        assert tomllib.loads(line)  # the line is TOML: key = default, the help its comment
    # the help is pyproject's comment, continuation lines joined: the text is written once
    assert "num-clients = 5  # number of partitions / simulated SuperNodes" in lines
    assert ("rounds = 1  # global rounds T; 1 = one-shot. T > 1: the global model goes back to the clients, who train "
            "local.epochs from it (homogeneous fleets only; FedHydra paper App. E)") in lines
    assert next(line for line in lines if line.startswith("# cvae.*: ")).endswith("their label counts.")


def test_the_help_parser_reads_comments_not_strings(monkeypatch, tmp_path):
    from oneshot_fl import config

    (tmp_path / "pyproject.toml").write_text(
        '[tool.flwr.app.config]\n'
        'a = "x # not a comment"   # the help of a\n'
        '                          # and its second line\n'
        'b = 1\n'
        '[tool.flwr.app.config.sec]\n'
        '# what sec is for\n'
        'c = true                  # c\n'
        '# a comment at another column: not c\'s\n'
        '[tool.other]\n'
        'd = 2                     # not a run-config key\n')
    monkeypatch.setattr(config, "PROJECT_ROOT", tmp_path)
    config.run_config_help.cache_clear()
    try:
        assert config.run_config_help() == {"a": "the help of a and its second line", "b": "",
                                            "sec.": "what sec is for", "sec.c": "c"}
    finally:
        config.run_config_help.cache_clear()


def test_run_help_names_resume_run_name_presets_keys_and_the_run_folder(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for fragment in ("oneshot-fl list keys", "oneshot-fl list presets", "preset='smoke'|'cpu'|'paper'",
                     "<output-dir>/<run-name>", "./runs", "result.json", "the same command again continues it",
                     "--force starts it over", "run-name"):
        assert fragment in text, fragment


def test_partition_run_config_has_help(capsys):
    with pytest.raises(SystemExit):
        cli.main(["partition", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "-c RUN_CONFIG, --run-config RUN_CONFIG the run config whose partition to compute" in text


def test_a_failed_quiet_runs_log_tail_has_no_colour_codes_off_a_terminal(capsys, monkeypatch, tmp_path):
    import launcher.launch as launch

    failed = launch.SimulationRun(7, "finished:failed", "ServerApp raised", tmp_path, 1.0, tmp_path,
                                  log_text="\x1b[91mERROR \x1b[0m:  boom\n")
    monkeypatch.setattr(cli, "run_simulation", lambda *a, **k: failed)
    assert cli.main(["run", "--quiet"]) == 1
    err = capsys.readouterr().err
    assert "ERROR :  boom" in err and "\x1b" not in err
