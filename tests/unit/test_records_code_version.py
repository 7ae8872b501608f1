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
