"""Benchmark tables: "n/a" with its reason, "not run" for missing cells (never a blank), one row per
round in multi-round tables, one column per client model for heterogeneous fleets."""

import json

import pytest
from pathlib import Path

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


def test_a_dataset_run_on_less_than_the_preset_names_its_budget_under_the_table():
    cifar = [_record("fedavg", 0.3, dataset="cifar10"), _record("dense", 0.35, dataset="cifar10")]
    cifar[0]["overrides"] = {"local.epochs": 3, "threads": 1, "seed": 0}
    cifar[1]["overrides"] = {"distill.epochs": 10, "distill.kd-steps": 20, "fedhydra.mode": "paper"}
    mnist = _record("dense", 0.9)
    mnist["overrides"] = {"threads": 1}
    text = render_table("t", cifar + [mnist])
    budget = [line for line in text.splitlines() if line.startswith("Budget set on the command line")]
    assert budget == ["Budget set on the command line (over the preset), cifar10: "
                      "distill.epochs=10, distill.kd-steps=20, local.epochs=3."]


def test_multi_round_records_get_one_row_per_round():
    records = [_record("fedavg", 0.3 + 0.1 * r, round_=r, rounds=3) for r in (1, 2, 3)]
    text = render_table("multiround", records)
    rows = [line for line in text.splitlines() if line.startswith("| mnist | 0.5 | 2 |")]
    assert [row.split(" | ")[3] for row in rows[:3]] == ["1", "2", "3"]
    assert "40.00" in rows[0] and "60.00" in rows[2]


def _archive(path, node_ids=(1, 2)):
    path.mkdir(parents=True, exist_ok=True)
    (path / "manifest.json").write_text(json.dumps({"context": {}, "uploads": [{"node_id": n} for n in node_ids]}))
    return path


def _fake_replays(monkeypatch, tmp_path, results):
    """paper_table with records in tmp_path and replays answered from `results` (label -> result or exception)."""
    import benchmarks.paper_table as paper_table
    import benchmarks.records as records

    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(paper_table, "BENCH_DIR", tmp_path)
    ran = []

    def fake_replay(uploads, method, sets, run_dir):
        label = Path(run_dir).name.removeprefix("mnist-0.5-s0-")  # runs/<table>/<cell>-<label>
        ran.append(label)
        outcome = results[label]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
    monkeypatch.setattr(paper_table, "replay_in_worker", fake_replay)
    monkeypatch.setattr(paper_table, "record_from_result",
                        lambda table, result, sets_, extra: {**_record(result["method"], result["global"]["accuracy"]),
                                                             "preset": "smoke", "overrides_key":
                                                             records.overrides_key(sets_), **extra})
    return paper_table, ran


def test_replay_skips_only_the_records_of_the_same_label_on_the_same_uploads(tmp_path, monkeypatch):
    """A record relabelled as a variant (an older default kept for comparison) does not count as the
    method's own record, nor does one on another training run's uploads: the method is replayed again."""
    from benchmarks.records import load_records, overrides_key

    paper_table, ran = _fake_replays(monkeypatch, tmp_path, {"fedhydra": {"method": "fedhydra",
                                                                          "global": {"accuracy": 0.5}}})
    uploads = _archive(tmp_path / "a" / "uploads")
    sets = {"preset": "smoke"}
    old = {**_record("fedhydra", 0.3), "preset": "smoke", "overrides_key": overrides_key(sets), "label": "fedhydra-old",
           "uploads_id": paper_table.uploads_id(uploads)}
    (tmp_path / "t.jsonl").write_text(json.dumps(old) + "\n")
    paper_table.replay_methods("t", uploads, ["fedhydra"], "fedavg", "mnist", "0.5", 0, "smoke", {}, {}, False)
    assert ran == ["fedhydra"]
    paper_table.replay_methods("t", uploads, ["fedhydra"], "fedavg", "mnist", "0.5", 0, "smoke", {}, {}, False)
    assert ran == ["fedhydra"]  # now its own record exists, on these uploads
    assert load_records("t")[-1]["uploads_id"] == paper_table.uploads_id(uploads)
    retrained = _archive(tmp_path / "b" / "uploads", node_ids=(3, 4))  # the same cell trained again
    assert paper_table.uploads_id(retrained) != paper_table.uploads_id(uploads)
    paper_table.replay_methods("t", retrained, ["fedhydra"], "fedavg", "mnist", "0.5", 0, "smoke", {}, {}, False)
    assert ran == ["fedhydra", "fedhydra"]  # a record on other uploads is not a same-upload comparison


def test_replay_runner_records_each_result_and_survives_a_failed_replay(tmp_path, monkeypatch):
    from benchmarks.records import load_records

    paper_table, ran = _fake_replays(monkeypatch, tmp_path, {
        "dense": RuntimeError("out of memory"),
        "ot": {"not_applicable": "ot cannot fuse a heterogeneous fleet", "code_version": "abc1234-dirty",
               "flat": {"dataset": "mnist", "partition": "niid-bench", "alpha": 0.5, "num-clients": 2, "seed": 0,
                        "preset": "smoke"}},
        "fedhydra-paper": {"method": "fedhydra", "global": {"accuracy": 0.25}}})
    uploads = _archive(tmp_path / "a" / "uploads")
    jobs = paper_table.plan_replays("t", uploads, ["fedavg", "dense", "ot", "fedhydra-paper"], "fedavg", "mnist",
                                    "0.5", 0, "smoke", {"threads": 1}, {}, False)
    assert [job.label for job in jobs] == ["dense", "ot", "fedhydra-paper"]  # fedavg trained the clients
    assert jobs[2].method == "fedhydra" and jobs[2].sets == {"fedhydra.mode": "paper", "preset": "smoke"}
    assert jobs[2].overrides == {"threads": 1, "fedhydra.mode": "paper", "preset": "smoke"}
    rendered = []
    runner = paper_table.ReplayRunner(0, on_record=lambda: rendered.append(1))  # inline: the fakes apply
    for job in jobs:
        runner.submit(job)
    runner.close()
    assert ran == ["dense", "ot", "fedhydra-paper"] and runner.failed == 1 and len(rendered) == 2
    by_method = {r["method"]: r for r in load_records("t")}
    assert set(by_method) == {"ot", "fedhydra"}  # the failed dense replay wrote nothing
    assert by_method["ot"]["status"] == "not-applicable" and by_method["ot"]["reason"].startswith("ot cannot")
    assert by_method["ot"]["code_version"] == "abc1234-dirty"  # the code the replay ran, not the tree now
    assert by_method["fedhydra"]["label"] == "fedhydra-paper" and by_method["fedhydra"]["accuracy_final"] == 0.25
    assert {r["uploads_id"] for r in by_method.values()} == {paper_table.uploads_id(uploads)}


def test_teacher_probe_parses_checks_and_renders_the_latest_accuracy_per_archive_and_check(tmp_path, monkeypatch):
    from benchmarks import records, teacher_probe

    assert teacher_probe.parse_check("off") is None
    assert teacher_probe.parse_check("rounds=2,judges=3") == {"rounds": 2, "judges": 3}
    assert teacher_probe.parse_check("min_evidence=0.5") == {"min_evidence": 0.5}
    assert teacher_probe.parse_check("judges=2,evidence_from=ms") == {"judges": 2, "evidence_from": "ms"}
    assert teacher_probe.parse_check("roundtrip") == {"check": "roundtrip"}
    assert teacher_probe.parse_check("roundtrip,power=1.5") == {"check": "roundtrip", "power": 1.5}
    assert teacher_probe.parse_check("recognise,power=1,floor=0.05") == {"check": "recognise", "power": 1,
                                                                           "floor": 0.05}
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
    # SA spaces other than capped (the default when records had no space) get columns of their own
    for space, acc in (("capped", 0.5), ("calibrated", 0.625)):
        records.append_record({"table": "teacher_probe", "archive": "runs/b-s101/uploads", "check": "judges=2",
                               "space": space, "teacher_accuracy": acc, "sets": []})
    table = teacher_probe.render().read_text().splitlines()
    assert "| archive | off | judges=2 | judges=2 calibrated |" in table
    assert "| b-s101 | - | 50.00 | 62.50 |" in table


def test_expel_audit_table_names_the_clients_left_out_latest_per_archive(tmp_path, monkeypatch):
    from benchmarks import expel_audit, records

    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(expel_audit, "RESULTS_DIR", tmp_path)
    base = {"table": "expel_audit", "sets": ["threads=1"], "clients": [0, 1, 2]}
    records.append_record({**base, "archive": "runs/a-s0/uploads", "expelled": [1],
                           "rejected_share": [0.1, 0.9, 0.0], "claim_recognition": [0.3, 0.01, 0.2]})
    records.append_record({**base, "archive": "runs/a-s0/uploads", "expelled": [],  # a later decision wins
                           "rejected_share": [0.1, 0.5, 0.0], "claim_recognition": [0.3, 0.25, 0.2]})
    records.append_record({**base, "archive": "runs/b-s0/uploads", "expelled": [0, 2],
                           "rejected_share": [0.7, 0.0, 0.61], "claim_recognition": [0.0, 0.4, 0.05]})
    records.append_record({**base, "archive": "runs/c-s0/uploads", "sets": ["fedhydra.peer-expel=0"],
                           "expelled": None})
    table = expel_audit.render().read_text().splitlines()
    assert "| a-s0 | threads=1 | none | 0.10 0.50 0.00 | 0.30 0.25 0.20 |" in table
    assert "| b-s0 | threads=1 | p0, p2 | 0.70 0.00 0.61 | 0.00 0.40 0.05 |" in table
    assert "| c-s0 | fedhydra.peer-expel=0 | expel off | - | - |" in table
    assert sum(line.startswith("| a-s0") for line in table) == 1


def test_teacher_probe_oracle_reads_the_uploaded_counts_in_the_fleets_client_order(tmp_path, monkeypatch):
    import oneshot_fl.archive as archive
    from benchmarks import teacher_probe

    assert teacher_probe.parse_check("oracle,power=0.5") == {"check": "oracle", "power": 0.5}
    manifest = {"uploads": [{"partition_id": 0, "label_counts": [3, 1]}, {"partition_id": 4, "label_counts": [0, 2]}]}
    monkeypatch.setattr(archive, "load_manifest", lambda uploads: manifest)
    assert teacher_probe.label_counts_of(tmp_path, [4, 0]).tolist() == [[0, 3], [2, 1]]  # (class, client)
    # a flipped client's class-j data fires its logit j+1: its counts roll with its rows, the others' stay
    manifest["uploads"][0]["label_counts"] = [3, 1, 0]
    manifest["uploads"][1]["label_counts"] = [0, 2, 5]
    assert teacher_probe.parse_check("oracle,behaves=1") == {"check": "oracle", "behaves": 1}
    assert teacher_probe.label_counts_of(tmp_path, [4, 0], flipped=0).tolist() == [[0, 0], [2, 3], [5, 1]]
    assert teacher_probe.label_counts_of(tmp_path, [4, 0], flipped=7).tolist() == [[0, 3], [2, 1], [5, 0]]



def test_teacher_probe_records_u_r_to_four_decimals():
    import torch

    from benchmarks import teacher_probe

    assert teacher_probe.rounded(torch.tensor([[0.123456, 2.25e-05], [1.0, 0.5]])) == [[0.1235, 0.0], [1.0, 0.5]]


def test_robustness_refuses_uploads_trained_at_another_preset(tmp_path, monkeypatch):
    import argparse

    from benchmarks import paper_table, robustness

    monkeypatch.setattr(paper_table, "BENCH_DIR", tmp_path)
    uploads = tmp_path / "runs" / "paper_scale" / "mnist-0.5-s0" / "uploads"
    uploads.mkdir(parents=True)
    (uploads / "manifest.json").write_text(json.dumps({"context": {"run_config": {"preset": "cpu"}}, "uploads": []}))
    args = argparse.Namespace(client_set=[], set=[], datasets=["mnist"], cells=["0.5"], seeds=[0], num_clients=5,
                              preset="paper", uploads_from="paper_scale", variants=["minus"], victim=0,
                              methods=["fedhydra"], table="robustness_paper", force=False)
    with pytest.raises(SystemExit, match="trained with preset 'cpu', not 'paper': pass --uploads-from"):
        robustness.plan(args, {}, {})


def test_robustness_bar_pairs_each_variant_with_minus_on_the_same_uploads_and_bolds_a_loss_over_2_points():
    from benchmarks.robustness import bar_lines

    def rec(variant, acc, uploads="u0", seed=0, label=None):
        return {"method": "fedhydra", "label": label, "dataset": "mnist", "cell": "0.5", "seed": seed, "victim": 0,
                "uploads_id": uploads, "variant": variant, "accuracy_final": acc}

    records = [rec("minus", 0.90), rec("flip", 0.875), rec("random", 0.885), rec("scale10", 0.93),
               rec("shuffled", 0.8795),
               rec("minus", 0.80, uploads="u1", seed=1), rec("flip", 0.70, uploads="u2", seed=1),  # other uploads
               rec("minus", 0.50, uploads=None, seed=2), rec("flip", 0.10, uploads=None, seed=2),  # no fingerprint
               rec("minus", 0.60, label="fedhydra-paper"), rec("flip", 0.59, label="fedhydra-paper")]
    lines = bar_lines(records, ["fedhydra", "fedhydra-paper"])
    rows = [line for line in lines if line.startswith("| mnist")]
    assert rows == ["| mnist | 0.5 | 0 | p0 | fedhydra | 90.00 | **-2.50** | -1.50 | +3.00 | **-2.05** |",
                    "| mnist | 0.5 | 0 | p0 | fedhydra-paper | 60.00 | -1.00 | - | - | - |",
                    "| mnist | 0.5 | 1 | p0 | fedhydra | 80.00 | - | - | - | - |"]
    assert bar_lines([rec("flip", 0.5)], ["fedhydra"]) == []  # nothing to pair with


def test_a_record_names_the_code_its_replay_ran():
    from benchmarks.records import code_version, record_from_result

    result = {"method": "dense", "dataset": "mnist", "partition": "niid-bench", "alpha": 0.5, "num_clients": 1,
              "seed": 0, "preset": "smoke", "global": {"accuracy_final": 0.5},
              "timings": {"local_sum": 2.0, "local_max": 2.0, "server_fuse": 3.0, "evaluation": 1.0, "total": 6.0},
              "clients": [{"local_accuracy": 0.4, "arch": "cnn2", "received_bytes": 10, "raw_bytes": 8}]}
    assert record_from_result("t", {**result, "code_version": "abc1234"}, {}, None)["code_version"] == "abc1234"
    record = record_from_result("t", result, {}, None)  # run in this process: the tree's version
    assert record["code_version"] == code_version()
    assert record["wall_s"] == {"local": 2.0, "evaluation": 1.0, "server_total": 4.0, "total": 6.0}


def test_teacher_probe_scores_each_space_on_the_same_fleet(monkeypatch, tmp_path):
    """Client 0 owns class 0 and answers everything 5 logits louder than client 1, the owner of class 1:
    capped SA (no client louder in spread) follows the offset and calls every input 0, calibrated SA
    follows each client's relative confidence and gets all three inputs right."""
    import torch

    from benchmarks import teacher_probe

    u = torch.eye(2)  # (c, m): class j belongs to client j
    logits = torch.tensor([[[9.0, 0.0], [6.0, 0.0], [6.5, 0.0]],   # client 0: strongest on input 0
                           [[0.0, 1.0], [0.0, 4.0], [0.0, 3.0]]])  # client 1: strongest on input 1
    fleet = {"u": u, "u_r": u, "u_c": u, "agree": torch.ones(2, 2, 2), "scales": torch.ones(2), "space": "calibrated",
             "route": "class", "min_evidence": 0.25, "test_logits": logits, "test_labels": torch.tensor([0, 1, 1]),
             "clients": [0, 1]}
    monkeypatch.setattr(teacher_probe, "fleet_outputs", lambda uploads, sets, cache: fleet)
    rows = teacher_probe.probe(tmp_path / "uploads", ["off"], [], tmp_path, ["capped", "calibrated"])
    assert [(r["space"], r["check"]) for r in rows] == [("capped", "off"), ("calibrated", "off")]
    # capped: class 0 scores 9 / 6 / 6.5 against 1 / 4 / 3 -> (0, 0, 0): 1 of 3 right
    # calibrated: client 0's tops 9, 6, 6.5 -> (+1.14, -0.72, -0.41); client 1's 1, 4, 3 -> (-1.09, +0.87, +0.22)
    assert rows[0]["teacher_accuracy"] == pytest.approx(1 / 3) and rows[1]["teacher_accuracy"] == 1.0
    assert teacher_probe.probe(tmp_path / "uploads", ["off"], [], tmp_path)[0]["space"] == "calibrated"  # the run's


@pytest.mark.parametrize("change, message", [
    ({"cells": ["0.5", "0.7x"]}, "cell '0.7x'"),
    ({"datasets": ["mnist", "svhn2"]}, "dataset='svhn2'"),
    ({"methods": ["fedavg", "fedhydraa"]}, "method='fedhydraa' is not a known method"),
    ({"seeds": [0, -1]}, r"seeds \[-1\]"),
    ({"server_sets": {"fedhydra.peer-check": "x"}}, "fedhydra.peer-check='x' is not allowed"),
    ({"client_sets": {"local.epochs": -3}}, "local.epochs=-3 is out of range"),
])
def test_the_paper_grid_is_checked_before_any_run(change, message):
    from benchmarks.paper_table import check_grid
    from oneshot_fl.config import ConfigError

    grid = {"datasets": ["mnist"], "cells": ["0.5", "2c/c"], "seeds": [0, 1], "methods": ["fedavg", "fedhydra-paper"],
            "num_clients": 5, "preset": "cpu", "client_sets": {"threads": 1}, "server_sets": {"threads": 1}}
    check_grid(**grid)  # the grid as given is fine
    with pytest.raises(ConfigError, match=message):
        check_grid(**{**grid, **change})


def test_teacher_probe_output_prior_is_each_judges_mean_answer_on_the_other_clients_images():
    import torch

    from benchmarks import teacher_probe

    assert teacher_probe.parse_check("prior,power=0.5") == {"check": "prior", "power": 0.5}
    d = torch.zeros(3, 3, 2, 2)  # (judge, maker, class of the maker's run, answer)
    d[0, 1] = torch.tensor([[0.9, 0.1], [0.7, 0.3]])
    d[0, 2] = torch.tensor([[0.5, 0.5], [0.3, 0.7]])
    d[0, 0] = torch.tensor([[0.0, 1.0], [0.0, 1.0]])  # its own images do not count
    d[1, 0] = d[1, 2] = torch.tensor([[0.2, 0.8], [0.2, 0.8]])
    d[2, 0], d[2, 1] = torch.tensor([[1.0, 0.0], [1.0, 0.0]]), torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    prior = teacher_probe.output_prior(d)  # (class, client)
    assert prior.shape == (2, 3)
    assert torch.allclose(prior[:, 0], torch.tensor([0.6, 0.4]))  # (0.9 + 0.7 + 0.5 + 0.3) / 4
    assert torch.allclose(prior[:, 1], torch.tensor([0.2, 0.8]))
    assert torch.allclose(prior[:, 2], torch.tensor([0.5, 0.5]))


def test_a_torn_record_line_loses_only_that_record(tmp_path, monkeypatch, caplog):
    """A benchmark killed while appending leaves half a line without its newline: the next record starts on a
    line of its own, and loading skips the torn one (named) instead of failing every benchmark command."""
    from benchmarks import records

    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path)
    records.append_record({"table": "t", "seed": 0})
    with open(tmp_path / "t.jsonl", "a") as fh:
        fh.write('{"table": "t", "se')  # torn
    records.append_record({"table": "t", "seed": 2})
    (tmp_path / "u.jsonl").write_text('[1, 2]\n{"table": "u"}\n')  # JSON, but not a record
    with caplog.at_level("WARNING"):
        assert [r["seed"] for r in records.load_records("t")] == [0, 2]
        assert records.load_records("u") == [{"table": "u"}]
    assert "t.jsonl:2 is not a JSON record" in caplog.text and "u.jsonl:1" in caplog.text
    assert (tmp_path / "t.jsonl").read_text().splitlines()[2] == '{"seed": 2, "table": "t"}'
