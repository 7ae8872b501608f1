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


def test_every_other_stratification_entry_and_the_epochs_count_and_a_run_without_one_compares_its_accuracies(
        tmp_path):
    a = _run(tmp_path / "a", 0.75, [[0.5, 0.5]], 300.0, "aaa")
    b = _run(tmp_path / "b", 0.75, [[0.5, 0.5]], 100.0, "bbb")
    for run, action, seconds in ((a, "nobody left out", 3.0), (b, "client 1 left out", 1.0)):
        strat = json.loads((run / "stratification.json").read_text())
        strat.update(server_action=action, seconds=seconds, peer_check={"trust": [[1.0]], "u_r": [[1.0]]})
        (run / "stratification.json").write_text(json.dumps(strat))
    lines, same = compare_runs.compare(a, b)
    assert not same
    assert "| stratification.json, every other entry | | | 3 in both, 1 differ: server_action |" in lines
    strat = json.loads((b / "stratification.json").read_text())
    del strat["peer_check"]["u_r"]
    strat["server_action"] = "nobody left out"
    (b / "stratification.json").write_text(json.dumps(strat))  # seconds differ: never compared
    lines, same = compare_runs.compare(a, b)
    expected = ("| stratification.json, every other entry | | | 2 in both, 0 differ; only in a: "
                "peer_check.u_r (1 value) |")
    assert not same and expected in lines
    # a method without stratification.json (DENSE, FedMHO): the accuracies and every evaluated epoch decide
    for run, last in ((tmp_path / "c", 0.5), (tmp_path / "d", 0.6)):
        run.mkdir()
        (run / "result.json").write_text(json.dumps({"global": {"accuracy_final": 0.6}, "history": [
            {"epoch": 1, "accuracy": 0.4}, {"epoch": 2, "accuracy": last}], "provenance": {"git": {}}}))
    lines, same = compare_runs.compare(tmp_path / "c", tmp_path / "d")
    assert not same and "| accuracy of every evaluated epoch (2 / 2 epochs) | | | 0.1 (differ) |" in lines
    assert not any("stratification.json" in line for line in lines)
    assert compare_runs.compare(tmp_path / "c", tmp_path / "c")[1]
