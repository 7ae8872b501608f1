"""benchmarks.records: the commit a copy's sender named wins over the copy's own git state; JSON-list record files;
the provenance line under rendered tables."""

import subprocess

from benchmarks import records


class _OtherCommit:
    stdout = "0000000"  # the copy's own repository, at the commit the session started from


def test_a_copy_takes_the_commit_its_sender_named(monkeypatch):
    monkeypatch.setattr(records.subprocess, "run", lambda *a, **k: _OtherCommit())
    monkeypatch.setenv("ONESHOT_FL_GIT_COMMIT", "f32327307a5c498bdfcf912520908749d22a349b")
    monkeypatch.setenv("ONESHOT_FL_GIT_DIRTY", "0")
    assert records.code_version() == "f323273"
    monkeypatch.setenv("ONESHOT_FL_GIT_DIRTY", "1")
    assert records.code_version() == "f323273-dirty"
    monkeypatch.delenv("ONESHOT_FL_GIT_DIRTY")  # unstated: not known to be clean
    assert records.code_version() == "f323273-dirty"


def test_without_git_or_a_named_commit_the_version_is_unknown(monkeypatch):
    def no_git(*args, **kwargs):
        raise subprocess.SubprocessError("no git")

    monkeypatch.setattr(records.subprocess, "run", no_git)
    monkeypatch.delenv("ONESHOT_FL_GIT_COMMIT", raising=False)
    assert records.code_version() == "unknown"


def test_a_json_list_record_file_keeps_every_run(tmp_path):
    """memory_format / launcher_cpu keep one JSON list per file: each run adds its entry after the earlier ones."""
    path = tmp_path / "bench.json"
    assert records.append_to_json_list(path, {"run": 1}) == [{"run": 1}]
    assert records.append_to_json_list(path, {"run": 2}, indent=2) == [{"run": 1}, {"run": 2}]
    assert path.read_text() == '[\n  {\n    "run": 1\n  },\n  {\n    "run": 2\n  }\n]\n'


def test_the_provenance_line_names_each_machine_and_code_version_once():
    a, b = {"cpus": 2}, {"cpus": 16}
    line = records.provenance_line([{"machine": b, "code_version": "f00"}, {"machine": a, "code_version": "abc"},
                                    {"machine": a, "code_version": "abc"}, {"machine": a}])
    assert line == 'Machines: {"cpus": 16}; {"cpus": 2}; code: ?, abc, f00.'
    assert records.provenance_line([]) == "Machines: none; code: none."


def test_a_record_names_the_cpu_model_from_cpuinfo(tmp_path, monkeypatch):
    """Fleets trained on CPUs of other kernels differ, so a record says which CPU it ran on."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13 64-Core Processor\n"
                       "processor\t: 1\nmodel name\t: AMD EPYC 7B13 64-Core Processor\n")
    assert records.cpu_model(cpuinfo) == "AMD EPYC 7B13 64-Core Processor"
    monkeypatch.setattr(records.platform, "processor", lambda: "")
    monkeypatch.setattr(records.platform, "machine", lambda: "aarch64")
    assert records.cpu_model(tmp_path / "missing") == "aarch64"  # no /proc/cpuinfo: what platform knows
    (tmp_path / "arm").write_text("processor\t: 0\nBogoMIPS\t: 50.00\n")  # an ARM cpuinfo has no model name
    assert records.cpu_model(tmp_path / "arm") == "aarch64"
    machine = records.machine()
    assert machine["cpu_capability"] == records.torch.backends.cpu.get_cpu_capability() and machine["cpu"]
