"""The launcher-CPU benchmark splits a run's process tree the way its docstring says."""

from benchmarks.launcher_cpu import classify

LAUNCHER = 100


def test_launcher_and_its_flower_cli_commands_count_as_launcher():
    assert classify(["/v/bin/python", "/v/bin/oneshot-fl", "run"], LAUNCHER, LAUNCHER, 1) == "launcher"
    for sub in ("ls", "log", "run", "stop"):
        command = ["/v/bin/python3.11", "/v/bin/flwr", sub, "--format", "json"]
        assert classify(command, 7, LAUNCHER, LAUNCHER) == "launcher"
    assert classify(["/v/bin/flwr", "ls"], 7, LAUNCHER, LAUNCHER) == "launcher"


def test_everything_else_is_the_run():
    # the SuperLink the launcher's `flwr run` starts, and anything below it
    assert classify(["/v/bin/python", "/v/bin/flower-superlink", "--insecure"], 8, LAUNCHER, LAUNCHER) == "run"
    assert classify(["/v/bin/python", "/v/bin/flwr", "ls"], 9, LAUNCHER, 8) == "run"  # not the launcher's child
    assert classify(["/v/bin/python", "/v/bin/flwr-simulation"], 10, LAUNCHER, 8) == "run"
    assert classify(["ray::ClientAppActor"], 11, LAUNCHER, 10) == "run"
    assert classify([], 12, LAUNCHER, LAUNCHER) == "run"  # a zombie with no command line


def test_flwr_subcommand_names_the_cli_command_only():
    from benchmarks.launcher_cpu import flwr_subcommand

    assert flwr_subcommand(["/v/bin/flwr", "ls", "--format", "json"]) == "ls"
    assert flwr_subcommand(["/v/bin/python3", "/v/bin/flwr", "log", "3", "--stream"]) == "log"
    assert flwr_subcommand(["/v/bin/flwr", "version"]) is None
    assert flwr_subcommand(["/v/bin/python", "/v/bin/flower-superlink"]) is None
    assert flwr_subcommand([]) is None
