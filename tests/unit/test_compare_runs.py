"""benchmarks.compare_runs: identity is decided by accuracies and U alone; wall seconds are reported beside."""

import json

from benchmarks import compare_runs


def _run(folder, accuracy, u, seconds, commit):
    folder.mkdir()
    result = {"global": {"accuracy_final": accuracy, "ensemble_accuracy": 0.9, "mean_ensemble_accuracy": 0.8},
              "timings": {"stratification": seconds / 10, "distillation": seconds, "evaluation": 1.0,
                          "server_fuse": seconds + seconds / 10 + 1.0},
              "provenance": {"git": {"commit": commit, "dirty": False}}}
    (folder / "result.json").write_text(json.dumps(result))
    (folder / "stratification.json").write_text(json.dumps({"u": u, "u_r": u, "u_c": u}))
    return folder


def test_a_faster_run_of_the_same_numbers_is_identical(tmp_path):
    a = _run(tmp_path / "nchw", 0.75, [[0.5, 0.5]], 300.0, "aaa")
    b = _run(tmp_path / "cl", 0.75, [[0.5, 0.5]], 200.0, "bbb")
    lines, same = compare_runs.compare(a, b)
    assert same
    assert "| seconds: distillation (ratio nchw / cl) | 300.0 | 200.0 | 1.50x |" in lines
    assert "| seconds: server_fuse (ratio nchw / cl) | 331.0 | 221.0 | 1.50x |" in lines
    assert "| code | aaa | bbb | |" in lines


def test_another_u_or_accuracy_differs(tmp_path):
    a = _run(tmp_path / "a", 0.75, [[0.5, 0.5]], 300.0, "aaa")
    b = _run(tmp_path / "b", 0.75, [[0.4, 0.6]], 300.0, "aaa")
    lines, same = compare_runs.compare(a, b)
    assert not same and "| stratification.json u | | | 0.1 |" in lines
    c = _run(tmp_path / "c", 0.76, [[0.5, 0.5]], 300.0, "aaa")
    assert not compare_runs.compare(a, c)[1]
