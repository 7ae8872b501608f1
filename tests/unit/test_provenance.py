"""The provenance block of result.json."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys

import pytest

from launcher import provenance as launcher_provenance
from oneshot_fl import provenance


@pytest.fixture(autouse=True)
def _no_command_told(monkeypatch):
    monkeypatch.setattr(provenance, "_COMMAND", {})


def test_collect_names_versions_code_machine_device_and_command(monkeypatch):
    for key in (provenance.ENV_COMMIT, provenance.ENV_DIRTY):
        monkeypatch.delenv(key, raising=False)
    block = provenance.collect()
    assert set(block["versions"]) == {"flwr", "torch", "torchvision", "numpy", "python"}
    assert block["versions"]["flwr"] == "1.41.0" and block["versions"]["torch"]
    assert block["versions"]["python"].startswith("3.")
    assert block["cpu_count"] >= 1 and block["hostname"] and block["platform"]
    assert block["device"] == "cpu" or block["device"].startswith("cuda: ")
    assert block["command"] and block["command_source"] == "this process"  # pytest's command line
    assert block["git"]["source"] == "code directory"
    inside_git = subprocess.run(["git", "-C", str(provenance.CODE_DIR), "rev-parse", "HEAD"],
                                capture_output=True, text=True)
    if inside_git.returncode == 0:
        assert block["git"]["commit"] == inside_git.stdout.strip()
        assert isinstance(block["git"]["dirty"], bool)


def test_the_launcher_hands_git_state_to_the_server(monkeypatch):
    env = launcher_provenance.launcher_env()
    assert set(env) <= {provenance.ENV_COMMIT, provenance.ENV_DIRTY}  # no command line, no credential: git only
    for key, value in {provenance.ENV_COMMIT: "abc123", provenance.ENV_DIRTY: "1"}.items():
        monkeypatch.setenv(key, value)
    assert provenance.collect()["git"] == {"commit": "abc123", "dirty": True, "source": "launcher"}


TOKEN = "0f3c9a7d5e1b2468ace0f3c9a7d5e1b2"


@pytest.mark.parametrize("argv", [
    ["/venv/bin/flwr-simulation", "--app", "/home/u/.flwr/apps/x", "--token", TOKEN, "--parent-pid", "7"],
    ["/venv/bin/python", "/venv/bin/flwr-serverapp", "--insecure", f"--token={TOKEN}"],
])
def test_a_flower_process_command_line_is_never_recorded(monkeypatch, argv):
    monkeypatch.setattr(sys, "argv", argv)
    block = provenance.collect()
    assert block["command"] is None and block["command_source"] == "unknown"
    assert TOKEN not in json.dumps(block)


def test_the_command_the_server_is_told_is_recorded_with_its_secrets_redacted(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/venv/bin/flwr-simulation", "--token", TOKEN])
    provenance.set_command(f"oneshot-fl run -c \"method='fedavg'\" --auth-token {TOKEN} --api-key=abc", "launcher")
    block = provenance.collect()
    assert block["command"] == "oneshot-fl run -c \"method='fedavg'\" --auth-token '***' '--api-key=***'"
    assert block["command_source"] == "launcher" and TOKEN not in json.dumps(block)


@pytest.mark.parametrize("argv, shown", [
    (["oneshot-fl", "run", "-c", "seed=1"], "oneshot-fl run -c seed=1"),
    (["x", "--token", "t", "--key-file=k", "--secret", "s", "--password", "p", "-c", "a=1"],
     "x --token '***' '--key-file=***' --secret '***' --password '***' -c a=1"),
    (["x", "--tokens-left", "3"], "x --tokens-left '***'"),  # cautious: any option naming a token
    (["oneshot-fl", "run", "-c", "method='dense' run-name='a b'"],
     "oneshot-fl run -c \"method='dense' run-name='a b'\""),
    (["x", "-c", "run-name=\"it's $HOME\""], "x -c 'run-name=\"it'\"'\"'s $HOME\"'"),
])
def test_user_command_redacts_secret_options_and_reads_back_as_the_argv(argv, shown):
    assert provenance.user_command(argv) == shown
    assert shlex.split(shown) == provenance.redact(argv)


def test_no_git_state_outside_a_checkout(tmp_path):
    assert provenance.git_state(tmp_path) == {"commit": None, "dirty": None}


def test_changed_benchmark_records_leave_the_code_clean_a_changed_source_file_does_not(tmp_path):
    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    (tmp_path / "benchmarks" / "results" / "table.jsonl").write_text("{}\n")
    (tmp_path / "code.py").write_text("x = 1\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "start")
    assert provenance.git_state(tmp_path)["dirty"] is False
    (tmp_path / "benchmarks" / "results" / "table.jsonl").write_text("{}\n{}\n")  # a benchmark appended a record
    assert provenance.git_state(tmp_path)["dirty"] is False
    (tmp_path / "code.py").write_text("x = 2\n")
    assert provenance.git_state(tmp_path)["dirty"] is True


@pytest.mark.parametrize("argv, module, shown", [
    (["/home/u/oneshot-fl/.venv/bin/oneshot-fl", "run", "-c", "method='dense'"], None,
     "oneshot-fl run -c \"method='dense'\""),  # a console script: its name, not its path in the environment
    (["/home/u/oneshot-fl/.venv/bin/oneshot-fl-deploy", "run", "-c", "seed=1"], None,
     "oneshot-fl-deploy run -c seed=1"),
    (["/home/u/oneshot-fl/launcher/deploy/__main__.py", "run", "-c", "seed=1"], "launcher.deploy.__main__",
     "python -m launcher.deploy run -c seed=1"),  # a package run with -m: argv[0] is its __main__.py
    (["/home/u/oneshot-fl/launcher/cli.py", "list", "keys"], "launcher.cli", "python -m launcher.cli list keys"),
    (["scripts/probe.py", "--token", "t"], None, "scripts/probe.py --token '***'"),  # a script as it was given
])
def test_the_command_is_written_as_the_user_typed_it(argv, module, shown):
    assert provenance.user_command(argv, module) == shown


def test_a_real_module_run_and_a_real_installed_command_are_recorded_as_typed(tmp_path):
    """The processes as Python starts them: `python -m pkg` (sys.argv[0] is pkg/__main__.py), `python -m pkg.tool`,
    and a console script (a file without .py in a bin/ folder, sys.argv[0] its whole path)."""
    show = "from oneshot_fl.provenance import user_command\nprint(user_command())\n"
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__main__.py").write_text(show)
    (tmp_path / "pkg" / "tool.py").write_text(show)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "oneshot-fl").write_text(show)
    for argv, shown in (
            (["-m", "pkg", "run", "-c", "method='dense'"], "python -m pkg run -c \"method='dense'\""),
            (["-m", "pkg.tool", "--secret", "s"], "python -m pkg.tool --secret '***'"),
            ([str(tmp_path / "bin" / "oneshot-fl"), "run", "-c", "seed=1"], "oneshot-fl run -c seed=1")):
        done = subprocess.run([sys.executable, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == shown
