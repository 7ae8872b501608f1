"""The provenance block of result.json."""

from __future__ import annotations

import subprocess

from launcher import provenance as launcher_provenance
from oneshot_fl import provenance


def test_collect_names_versions_code_machine_device_and_command(monkeypatch):
    for key in (provenance.ENV_COMMIT, provenance.ENV_DIRTY, provenance.ENV_COMMAND):
        monkeypatch.delenv(key, raising=False)
    block = provenance.collect()
    assert set(block["versions"]) == {"flwr", "torch", "torchvision", "numpy", "python"}
    assert block["versions"]["flwr"] == "1.41.0" and block["versions"]["torch"]
    assert block["versions"]["python"].startswith("3.")
    assert block["cpu_count"] >= 1 and block["hostname"] and block["platform"]
    assert block["device"] == "cpu" or block["device"].startswith("cuda: ")
    assert block["command"]  # this process's command line
    assert block["git"]["source"] == "code directory"
    inside_git = subprocess.run(["git", "-C", str(provenance.CODE_DIR), "rev-parse", "HEAD"],
                                capture_output=True, text=True)
    if inside_git.returncode == 0:
        assert block["git"]["commit"] == inside_git.stdout.strip()
        assert isinstance(block["git"]["dirty"], bool)


def test_the_launcher_hands_git_state_and_command_to_the_server(monkeypatch):
    env = launcher_provenance.launcher_env(["oneshot-fl", "run", "-c", "method='fedavg'"])
    assert env[provenance.ENV_COMMAND] == "oneshot-fl run -c 'method='\"'\"'fedavg'\"'\"''"
    for key, value in {**env, provenance.ENV_COMMIT: "abc123", provenance.ENV_DIRTY: "1"}.items():
        monkeypatch.setenv(key, value)
    block = provenance.collect()
    assert block["git"] == {"commit": "abc123", "dirty": True, "source": "launcher"}
    assert block["command"].startswith("oneshot-fl run -c ")


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
