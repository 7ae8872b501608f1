"""Benchmark tables: "n/a" with its reason, "not run" for missing cells (never a blank), one row per
round in multi-round tables, one column per client model for heterogeneous fleets."""

import json

from benchmarks.records import not_applicable_record
from benchmarks.render import render_table

MACHINE = {"cpus": 2, "processor": "x86_64", "gpu": None}


def _record(method, accuracy, seed=0, cell="0.5", round_=1, rounds=1, archs=("cnn2", "cnn2"), dataset="mnist"):
    return {"table": "t", "method": method, "dataset": dataset, "partition": "niid-bench", "alpha": float(cell),
            "num_clients": 2, "seed": seed, "preset": "smoke", "cell": cell, "accuracy_final": accuracy,
            "accuracy_best": accuracy, "ensemble_accuracy": None, "client_accuracy": [0.4, 0.6],
            "client_archs": list(archs), "round": round_, "num_rounds": rounds, "wall_s": {"total": 1.0},
            "machine": MACHINE, "code_version": "x", "recorded_at": f"2026-01-01T00:00:0{seed}"}


def test_not_applicable_and_not_run_cells_are_stated():
    flat = {"dataset": "mnist", "partition": "niid-bench", "alpha": 0.5, "num-clients": 2, "seed": 0, "preset": "smoke"}
    na = not_applicable_record("t", "ot", flat, "ot cannot fuse a heterogeneous fleet", {}, {"cell": "0.5"})
    na.update(machine=MACHINE, client_archs=["cnn2", "lenet"])
    records = [_record("dense", 0.5, archs=("cnn2", "lenet")), _record("dense", 0.7, seed=1, archs=("cnn2", "lenet")),
               na, _record("feddf", 0.4, cell="0.1", archs=("cnn2", "lenet"))]
    text = render_table("t", records)
    head = next(line for line in text.splitlines() if line.startswith("| dataset"))
    assert "client p0 (cnn2)" in head and "client p1 (lenet)" in head
    row = next(line for line in text.splitlines() if line.startswith("| mnist | 0.5 |"))
    assert "60.00 ± 10.00 (2)" in row and "n/a [1]" in row and "not run" in row  # feddf never ran on 0.5
    assert "[1] not applicable: ot cannot fuse a heterogeneous fleet" in text
    assert "| |" not in text and "|  |" not in text


def test_multi_round_records_get_one_row_per_round():
    records = [_record("fedavg", 0.3 + 0.1 * r, round_=r, rounds=3) for r in (1, 2, 3)]
    text = render_table("multiround", records)
    rows = [line for line in text.splitlines() if line.startswith("| mnist | 0.5 | 2 |")]
    assert [row.split(" | ")[3] for row in rows[:3]] == ["1", "2", "3"]
    assert "40.00" in rows[0] and "60.00" in rows[2]


def test_replay_skips_only_the_records_of_the_same_label(tmp_path, monkeypatch):
    """A record relabelled as a variant (an older default kept for comparison) does not count as the
    method's own record: the paper table replays the method again; its own record is skipped."""
    import benchmarks.paper_table as paper_table
    import benchmarks.records as records
    from benchmarks.records import overrides_key

    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path)
    sets = {"preset": "smoke"}
    old = {**_record("fedhydra", 0.3), "preset": "smoke", "overrides_key": overrides_key(sets), "label": "fedhydra-old"}
    (tmp_path / "t.jsonl").write_text(json.dumps(old) + "\n")
    ran = []

    def fake_run(table, uploads, label, dataset, cell, seed, server_sets, force, method=None):
        ran.append(label)
        return {"global": {"accuracy": 0.5}}
    monkeypatch.setattr(paper_table, "run_method", fake_run)
    monkeypatch.setattr(paper_table, "record_from_result",
                        lambda table, result, sets_, extra: {**_record("fedhydra", 0.5), "preset": "smoke",
                                                             "overrides_key": overrides_key(sets_), **extra})
    paper_table.replay_methods("t", tmp_path, ["fedhydra"], "fedavg", "mnist", "0.5", 0, "smoke", {}, {}, False)
    assert ran == ["fedhydra"]
    paper_table.replay_methods("t", tmp_path, ["fedhydra"], "fedavg", "mnist", "0.5", 0, "smoke", {}, {}, False)
    assert ran == ["fedhydra"]  # now its own record exists


def test_teacher_probe_parses_checks_and_renders_the_latest_accuracy_per_archive_and_check(tmp_path, monkeypatch):
    from benchmarks import records, teacher_probe

    assert teacher_probe.parse_check("off") is None
    assert teacher_probe.parse_check("rounds=2,judges=3") == {"rounds": 2, "judges": 3}
    assert teacher_probe.parse_check("min_evidence=0.5") == {"min_evidence": 0.5}
    assert teacher_probe.parse_check("judges=2,evidence_from=ms") == {"judges": 2, "evidence_from": "ms"}
    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(teacher_probe, "RESULTS_DIR", tmp_path)
    for archive, check, acc in (("runs/a-s100/uploads", "off", 0.5), ("runs/a-s100/uploads", "judges=2", 0.25),
                                ("runs/a-s100/uploads", "off", 0.75), ("runs/b-s101/uploads", "judges=2", 0.125)):
        records.append_record({"table": "teacher_probe", "archive": archive, "check": check, "teacher_accuracy": acc,
                               "sets": []})
    table = teacher_probe.render().read_text().splitlines()
    assert "| archive | off | judges=2 |" in table
    assert "| a-s100 | 75.00 | 25.00 |" in table  # the later record of a check wins
    assert "| b-s101 | - | 12.50 |" in table


def test_robustness_refuses_uploads_trained_at_another_preset(tmp_path, monkeypatch):
    import argparse

    import pytest

    from benchmarks import paper_table, robustness

    monkeypatch.setattr(paper_table, "BENCH_DIR", tmp_path)
    uploads = tmp_path / "runs" / "paper_scale" / "mnist-0.5-s0" / "uploads"
    uploads.mkdir(parents=True)
    (uploads / "manifest.json").write_text(json.dumps({"context": {"run_config": {"preset": "cpu"}}, "uploads": []}))
    args = argparse.Namespace(client_set=[], set=[], datasets=["mnist"], cells=["0.5"], seeds=[0], num_clients=5,
                              preset="paper", uploads_from="paper_scale", variants=["minus"], victim=0,
                              methods=["fedhydra"], table="robustness_paper", force=False)
    with pytest.raises(SystemExit, match="trained with preset 'cpu', not 'paper': pass --uploads-from"):
        robustness.plan(args)
