"""Benchmark tables: "n/a" with its reason, "not run" for missing cells (never a blank), one row per
round in multi-round tables, one column per client model for heterogeneous fleets."""

import json

import pytest
from pathlib import Path

from benchmarks.records import not_applicable_record
from benchmarks.render import render_table

MACHINE = {"cpus": 2, "processor": "x86_64", "gpu": None}


def _record(method, accuracy, seed=0, cell="0.5", round_=1, rounds=1, archs=("cnn2", "cnn2"), dataset="mnist",
            clients=(0.4, 0.6)):
    return {"table": "t", "method": method, "dataset": dataset, "partition": "niid-bench", "alpha": float(cell),
            "num_clients": 2, "seed": seed, "preset": "smoke", "cell": cell, "accuracy_final": accuracy,
            "accuracy_best": accuracy, "ensemble_accuracy": None, "client_accuracy": list(clients),
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


def test_best_client_is_the_best_of_each_seed_then_averaged_over_seeds():
    archs = ("cnn2", "lenet")
    records = [_record("dense", 0.5, seed=0, archs=archs, clients=(0.7, 0.5)),
               _record("dense", 0.6, seed=1, archs=archs, clients=(0.2, 0.9))]
    text = render_table("t", records)
    head = [c.strip() for c in next(ln for ln in text.splitlines() if ln.startswith("| dataset")).split("|")]
    row = [c.strip() for c in next(ln for ln in text.splitlines() if ln.startswith("| mnist | 0.5 |")).split("|")]
    cols = dict(zip(head, row))
    assert cols["best client"] == "80.00 ± 10.00 (2)"  # max(70, 50) = 70 and max(20, 90) = 90
    assert cols["client p0 (cnn2)"] == "45.00 ± 25.00 (2)"  # the per-position columns stay as they were


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
    """A tiny uploads archive: one tensor file per client (partition ids 0, 1, ...), the given node ids."""
    import torch

    path.mkdir(parents=True, exist_ok=True)
    entries = []
    for partition, node in enumerate(node_ids):
        torch.save({"w": torch.full((2,), float(partition))}, path / f"node-{node}.pt")
        entries.append({"file": f"node-{node}.pt", "node_id": node, "partition_id": partition, "role": "classifier",
                        "arch": "cnn2", "label_counts": [1, 1], "num_examples": 2, "metrics": {}})
    (path / "manifest.json").write_text(json.dumps({"context": {"run_config": {}}, "uploads": entries}))
    return path


def _fake_replays(monkeypatch, tmp_path, results):
    """The fleets module with records in tmp_path and replays answered from `results` (label -> result or exception)."""
    import benchmarks.fleets as fleets
    import benchmarks.records as records

    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(fleets, "BENCH_DIR", tmp_path)
    ran = []

    def fake_replay(uploads, method, sets, run_dir):
        label = Path(run_dir).name.removeprefix("mnist-0.5-s0-")  # runs/<table>/<cell>-<label>
        ran.append(label)
        outcome = results[label]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome
    monkeypatch.setattr(fleets, "replay_in_worker", fake_replay)
    monkeypatch.setattr(fleets, "record_from_result",
                        lambda table, result, sets_, extra: {**_record(result["method"], result["global"]["accuracy"]),
                                                             "preset": "smoke", "overrides_key":
                                                             records.overrides_key(sets_), **extra})
    return fleets, ran


def test_replay_skips_only_the_records_of_the_same_label_on_the_same_uploads(tmp_path, monkeypatch):
    """A record relabelled as a variant (an older default kept for comparison) does not count as the
    method's own record, nor does one on another training run's uploads: the method is replayed again."""
    from benchmarks.records import load_records, overrides_key

    fleets, ran = _fake_replays(monkeypatch, tmp_path, {"fedhydra": {"method": "fedhydra",
                                                                          "global": {"accuracy": 0.5}}})
    uploads = _archive(tmp_path / "a" / "uploads")
    sets = {"preset": "smoke"}
    old = {**_record("fedhydra", 0.3), "preset": "smoke", "overrides_key": overrides_key(sets), "label": "fedhydra-old",
           "uploads_id": fleets.uploads_id(uploads)}
    (tmp_path / "t.jsonl").write_text(json.dumps(old) + "\n")
    fleets.replay_methods("t", uploads, ["fedhydra"], "fedavg", "mnist", "0.5", 0, "smoke", {}, {}, False)
    assert ran == ["fedhydra"]
    fleets.replay_methods("t", uploads, ["fedhydra"], "fedavg", "mnist", "0.5", 0, "smoke", {}, {}, False)
    assert ran == ["fedhydra"]  # now its own record exists, on these uploads
    assert load_records("t")[-1]["uploads_id"] == fleets.uploads_id(uploads)
    retrained = _archive(tmp_path / "b" / "uploads", node_ids=(3, 4))  # the same cell trained again
    assert fleets.uploads_id(retrained) != fleets.uploads_id(uploads)
    fleets.replay_methods("t", retrained, ["fedhydra"], "fedavg", "mnist", "0.5", 0, "smoke", {}, {}, False)
    assert ran == ["fedhydra", "fedhydra"]  # a record on other uploads is not a same-upload comparison


def _training_record(tmp_path, uploads, fleets, settings: dict) -> None:
    """The record train_clients writes for the run that trained `uploads` (its method: fedavg)."""
    overrides = {"method": "fedavg", "dataset": "mnist", "num-clients": 2, "seed": 0, "preset": "smoke",
                 "partition": "niid-bench", "alpha": 0.5, **settings}
    with (tmp_path / "t.jsonl").open("a") as f:
        f.write(json.dumps({**_record("fedavg", 0.4), "overrides": overrides,
                            "uploads_id": fleets.uploads_id(uploads)}) + "\n")


def test_the_training_method_is_replayed_when_its_row_is_at_other_server_settings(tmp_path, monkeypatch):
    fleets, _ = _fake_replays(monkeypatch, tmp_path, {})
    uploads = _archive(tmp_path / "a" / "uploads")
    client = {"local.epochs": 2, "client-models": "cnn2,lenet"}

    def planned(server_sets):
        return [job.label for job in fleets.plan_replays("t", uploads, ["fedavg", "dense"], "fedavg", "mnist",
                                                              "0.5", 0, "smoke", client, server_sets, False)]

    assert planned({"distill.epochs": 8}) == ["fedavg", "dense"]  # no training record at all
    _training_record(tmp_path, uploads, fleets, {**client, "distill.epochs": 8})
    assert planned({"distill.epochs": 8}) == ["dense"]  # its row came from the training run
    assert planned({"distill.epochs": 8, "local.epochs": 5}) == ["dense"]  # client settings are the archive's
    assert planned({"distill.epochs": 4}) == ["fedavg", "dense"]  # a new server budget: served again
    assert planned({}) == ["fedavg", "dense"]
    other = _archive(tmp_path / "b" / "uploads", node_ids=(3, 4))
    assert [job.label for job in fleets.plan_replays("t", other, ["fedavg"], "fedavg", "mnist", "0.5", 0, "smoke",
                                                          client, {"distill.epochs": 8}, False)] == ["fedavg"]


def test_replay_runner_records_each_result_and_survives_a_failed_replay(tmp_path, monkeypatch):
    from benchmarks.records import load_records

    fleets, ran = _fake_replays(monkeypatch, tmp_path, {
        "dense": RuntimeError("out of memory"),
        "ot": {"not_applicable": "ot cannot fuse a heterogeneous fleet", "code_version": "abc1234-dirty",
               "flat": {"dataset": "mnist", "partition": "niid-bench", "alpha": 0.5, "num-clients": 2, "seed": 0,
                        "preset": "smoke"}},
        "fedhydra-paper": {"method": "fedhydra", "global": {"accuracy": 0.25}}})
    uploads = _archive(tmp_path / "a" / "uploads")
    _training_record(tmp_path, uploads, fleets, {"threads": 1})
    jobs = fleets.plan_replays("t", uploads, ["fedavg", "dense", "ot", "fedhydra-paper"], "fedavg", "mnist",
                                    "0.5", 0, "smoke", {"threads": 1}, {}, False)
    assert [job.label for job in jobs] == ["dense", "ot", "fedhydra-paper"]  # fedavg trained the clients
    assert [job.run_dir.name for job in jobs] == ["mnist-0.5-s0-dense", "mnist-0.5-s0-ot",
                                                  "mnist-0.5-s0-fedhydra-paper"]
    tagged = fleets.plan_replays("t", uploads, ["dense"], "fedavg", "mnist", "0.5", 0, "smoke", {"threads": 1},
                                      {}, False, folder_tag="ab12cd34")
    assert [job.run_dir.name for job in tagged] == ["mnist-0.5-s0-dense-ab12cd34"]
    assert jobs[2].method == "fedhydra" and jobs[2].sets == {"fedhydra.mode": "paper", "preset": "smoke"}
    assert jobs[2].overrides == {"threads": 1, "fedhydra.mode": "paper", "preset": "smoke"}
    rendered = []
    runner = fleets.ReplayRunner(0, on_record=lambda: rendered.append(1))  # inline: the fakes apply
    for job in jobs:
        runner.submit(job)
    runner.close()
    assert ran == ["dense", "ot", "fedhydra-paper"] and runner.failed == 1 and len(rendered) == 2
    by_method = {r["method"]: r for r in load_records("t")}
    assert set(by_method) == {"fedavg", "ot", "fedhydra"}  # the training run's row; the failed dense wrote nothing
    assert by_method["ot"]["status"] == "not-applicable" and by_method["ot"]["reason"].startswith("ot cannot")
    assert by_method["ot"]["code_version"] == "abc1234-dirty"  # the code the replay ran, not the tree now
    assert by_method["fedhydra"]["label"] == "fedhydra-paper" and by_method["fedhydra"]["accuracy_final"] == 0.25
    assert {r["uploads_id"] for r in by_method.values()} == {fleets.uploads_id(uploads)}


def test_robustness_refuses_uploads_trained_at_another_preset(tmp_path, monkeypatch):
    import argparse

    from benchmarks import fleets, robustness

    monkeypatch.setattr(fleets, "BENCH_DIR", tmp_path)
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
    ran_elsewhere = {**result, "provenance": {"git": {"commit": "e8365680f151", "dirty": False}}}
    assert record_from_result("t", ran_elsewhere, {}, None)["code_version"] == "e836568"
    ran_dirty = {**result, "provenance": {"git": {"commit": "e8365680f151", "dirty": True}}}
    assert record_from_result("t", ran_dirty, {}, None)["code_version"] == "e836568-dirty"
    assert record["wall_s"] == {"local": 2.0, "evaluation": 1.0, "server_total": 4.0, "total": 6.0}


@pytest.mark.parametrize("change, message", [
    ({"cells": ["0.5", "0.7x"]}, "cell '0.7x'"),
    ({"datasets": ["mnist", "svhn2"]}, "dataset='svhn2'"),
    ({"methods": ["fedavg", "fedhydraa"]}, "method='fedhydraa' is not a known method"),
    ({"seeds": [0, -1]}, r"seeds \[-1\]"),
    ({"server_sets": {"fedhydra.mode": "x"}}, "fedhydra.mode='x' is not allowed"),
    ({"server_sets": {"fedhydra.peer-check": "off"}}, r"fedhydra\.peer-check: retired.*docs/decisions\.md"),
    ({"client_sets": {"local.epochs": -3}}, "local.epochs=-3 is out of range"),
])
def test_the_paper_grid_is_checked_before_any_run(change, message):
    from benchmarks.fleets import check_grid
    from oneshot_fl.config import ConfigError

    grid = {"datasets": ["mnist"], "cells": ["0.5", "2c/c"], "seeds": [0, 1], "methods": ["fedavg", "fedhydra-paper"],
            "num_clients": 5, "preset": "cpu", "client_sets": {"threads": 1}, "server_sets": {"threads": 1}}
    check_grid(**grid)  # the grid as given is fine
    with pytest.raises(ConfigError, match=message):
        check_grid(**{**grid, **change})


def test_every_named_variant_is_a_valid_run_and_has_its_place_in_the_tables():
    """The retired FedHydra variants went with their keys: what is left must pass the run-config check."""
    from benchmarks.records import VARIANTS, resolve_variant
    from benchmarks.render import METHOD_ORDER
    from launcher.launch import check_run_config

    assert VARIANTS["fedhydra-paper"] == ("fedhydra", {"fedhydra.mode": "paper"})
    for label in VARIANTS:
        method, sets = resolve_variant(label)
        check_run_config({"method": method, **sets})
        assert label in METHOD_ORDER
    retired = {"fedhydra-probs", "fedhydra-capped", "fedhydra-roundtrip", "fedhydra-discredit",
               "fedhydra-recognition", "fedhydra-suspects", "fedhydra-noexpel"}
    assert not retired & set(VARIANTS) and not retired & set(METHOD_ORDER)
    assert resolve_variant("fedhydra-capped") == ("fedhydra-capped", {})  # no longer a variant


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


def test_a_run_folder_under_a_symlinked_runs_folder_is_named_relative_to_the_checkout(tmp_path, monkeypatch):
    from benchmarks import records

    checkout, elsewhere = tmp_path / "checkout", tmp_path / "elsewhere"
    (elsewhere / "runs" / "cell").mkdir(parents=True)
    (checkout / "benchmarks").mkdir(parents=True)
    (checkout / "benchmarks" / "runs").symlink_to(elsewhere / "runs")
    monkeypatch.setattr(records, "REPO_ROOT", checkout)
    assert records.repo_relative(checkout / "benchmarks" / "runs" / "cell") == "benchmarks/runs/cell"
    assert records.repo_relative(elsewhere / "runs" / "cell") is None


def test_run_fleets_trains_each_fleet_by_its_method_and_replays_only_its_methods(monkeypatch, tmp_path):
    import benchmarks.fleets as fleets

    trained, planned = [], []

    def fake_train(table, dataset, cell, seed, num_clients, preset, client_sets, force, method="fedavg",
                   server_sets=None):
        trained.append((table, num_clients, method, server_sets))
        return tmp_path / table

    def fake_plan(table, uploads, methods, trained_by, *rest):
        planned.append((table, methods, trained_by))
        return []

    monkeypatch.setattr(fleets, "train_clients", fake_train)
    monkeypatch.setattr(fleets, "plan_replays", fake_plan)
    grid = [fleets.Fleet("a", "mnist", "0.5", 0, 5, {}),
            fleets.Fleet("b", "mnist", "0.5", 0, 10, {}, trained_by="fedmho-md", methods=("fedmho-md",))]
    server = {"server-threads": 1}
    assert fleets.run_fleets(grid, ["fedavg", "dense"], "cpu", server, jobs=1, force=False) == 0
    # the training run's server gets the settings every replay gets
    assert trained == [("a", 5, "fedavg", server), ("b", 10, "fedmho-md", server)]
    assert planned == [("a", ["fedavg", "dense"], "fedavg"), ("b", ["fedmho-md"], "fedmho-md")]


def test_the_run_that_trains_the_clients_gets_the_server_settings_too(monkeypatch, tmp_path):
    import benchmarks.fleets as fleets

    seen = {}

    class Stop(Exception):
        pass

    def fake_simulation(overrides, stream=True):
        seen.update(overrides)
        raise Stop

    monkeypatch.setattr(fleets, "BENCH_DIR", tmp_path)
    monkeypatch.setattr(fleets, "run_simulation", fake_simulation)
    with pytest.raises(Stop):
        fleets.train_clients("t", "mnist", "0.5", 0, 5, "cpu", {"threads": 1}, False, method="dense",
                                  server_sets={"server-threads": 1, "distill.epochs": 3})
    assert (seen["method"], seen["threads"], seen["server-threads"], seen["distill.epochs"]) == ("dense", 1, 1, 3)


def test_kept_uploads_of_other_client_settings_are_refused_not_served(monkeypatch, tmp_path):
    import benchmarks.fleets as fleets

    monkeypatch.setattr(fleets, "BENCH_DIR", tmp_path)
    monkeypatch.setattr(fleets, "run_simulation", lambda *a, **k: pytest.fail("trained again"))
    run_dir = tmp_path / "runs" / "t" / "mnist-0.5-s0"
    (run_dir / "uploads").mkdir(parents=True)
    (run_dir / "uploads" / "manifest.json").write_text("{}")
    (run_dir / "client_sets.json").write_text(json.dumps({"local.dp.epochs": 10, "local.dp.epsilon": 8.0}))
    same = {"local.dp.epsilon": 8.0, "local.dp.epochs": 10}  # key order does not matter
    assert fleets.train_clients("t", "mnist", "0.5", 0, 5, "cpu", same, False) == run_dir / "uploads"
    with pytest.raises(RuntimeError, match="keeps uploads trained with .*local.dp.epochs.: 10"):
        fleets.train_clients("t", "mnist", "0.5", 0, 5, "cpu", {**same, "local.dp.epochs": 20}, False)


def test_a_fleet_whose_methods_all_have_records_is_not_trained_again(monkeypatch, tmp_path):
    import benchmarks.fleets as fleets
    from benchmarks import records

    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path)
    trained = []
    monkeypatch.setattr(fleets, "train_clients", lambda table, *a, **k: trained.append(a[2]) or tmp_path)
    monkeypatch.setattr(fleets, "plan_replays", lambda *a: [])
    _, _, key = fleets.replay_key("dense", "mnist", "0.5", 0, "cpu", {}, {"threads": 1})
    records.append_record({**key, "table": "t", "uploads_id": "old-training", "accuracy_final": 0.5})
    grid = [fleets.Fleet("t", "mnist", "0.5", seed, 5, {}) for seed in (0, 1)]
    assert fleets.run_fleets(grid, ["dense"], "cpu", {"threads": 1}, jobs=1, force=False) == 0
    assert trained == [1]  # seed 0's dense has its record; seed 1 has none
    trained.clear()
    assert fleets.run_fleets(grid, ["dense"], "cpu", {"threads": 2}, jobs=1, force=False) == 0
    assert trained == [0, 1]  # other server settings: no record yet
    trained.clear()
    assert fleets.run_fleets(grid[:1], ["fedavg", "dense"], "cpu", {"threads": 1}, jobs=1, force=False) == 0
    assert trained == [0]  # the FedAvg row comes from training, and it has none
    trained.clear()
    assert fleets.run_fleets(grid[:1], ["dense"], "cpu", {"threads": 1}, jobs=1, force=True) == 0
    assert trained == [0]


def test_hetero_table_replays_get_the_fleet_files_server_settings(monkeypatch, tmp_path):
    import benchmarks.hetero_table as hetero_table

    conf = tmp_path / "fleet.toml"
    conf.write_text('dataset = "mnist"\nnum-clients = 5\nclient-models = "lenet,cnn2,cnn2,cnn2,lenet"\n'
                    'server-model = "cnn2"\npreset = "cpu"\n[local]\nepochs = 2\n[distill]\nepochs = 8\n')
    runs = []
    monkeypatch.setattr(hetero_table, "run_fleets",
                        lambda fleets, methods, preset, server, jobs, force, on_record, redo_replays:
                        runs.append((fleets, methods, preset, server, jobs, force, redo_replays)) or 0)
    monkeypatch.setattr(hetero_table, "render", lambda: None)
    assert hetero_table.main(["--conf", str(conf), "--cells", "0.5", "0.1", "--seeds", "0", "1", "--methods",
                              "dense", "--train-method", "fedhydra", "--set", "server-threads=1", "--jobs", "2"]) == 0
    (fleets, methods, preset, server, jobs, force, redo_replays), = runs
    assert methods == ["dense"] and preset == "cpu" and jobs == 2 and not force and not redo_replays
    assert [(f.dataset, f.cell, f.seed, f.trained_by) for f in fleets] == [
        ("mnist", "0.5", 0, "fedhydra"), ("mnist", "0.5", 1, "fedhydra"),
        ("mnist", "0.1", 0, "fedhydra"), ("mnist", "0.1", 1, "fedhydra")]
    # the training run and every replay are told the file's distillation budget and server model; the clients'
    # settings stay client-side (a replay takes them from the uploads archive)
    assert server == {"server-model": "cnn2", "distill.epochs": 8, "server-threads": 1}
    assert all(f.client_sets == {"client-models": "lenet,cnn2,cnn2,cnn2,lenet", "local.epochs": 2} for f in fleets)


def test_hetero_table_redo_replays_reaches_run_fleets(monkeypatch, tmp_path):
    import benchmarks.hetero_table as hetero_table

    conf = tmp_path / "fleet.toml"
    conf.write_text('dataset = "mnist"\nnum-clients = 5\nclient-models = "lenet,cnn2,cnn2,cnn2,lenet"\n'
                    'server-model = "cnn2"\n')
    runs = []
    monkeypatch.setattr(hetero_table, "run_fleets", lambda *args, **kwargs: runs.append((args, kwargs)) or 0)
    monkeypatch.setattr(hetero_table, "render", lambda: None)
    assert hetero_table.main(["--conf", str(conf), "--cells", "0.5", "--seeds", "0", "--methods", "dense",
                              "--redo-replays"]) == 0
    (args, kwargs), = runs
    assert kwargs["redo_replays"] is True and kwargs["force"] is False  # the replays again, the clients not


def test_hetero_table_fails_when_a_replay_failed(monkeypatch, tmp_path):
    import benchmarks.hetero_table as hetero_table

    conf = tmp_path / "fleet.toml"
    conf.write_text('dataset = "mnist"\nnum-clients = 5\nclient-models = "lenet,cnn2,cnn2,cnn2,lenet"\n'
                    'server-model = "cnn2"\n')
    monkeypatch.setattr(hetero_table, "run_fleets", lambda *args, **kwargs: 1)
    monkeypatch.setattr(hetero_table, "render", lambda: None)
    assert hetero_table.main(["--conf", str(conf), "--cells", "0.5", "--seeds", "0", "--methods", "dense"]) == 1


def test_methods_on_fleets_whose_clients_score_differently_are_flagged_per_seed():
    archs = ("cnn2", "lenet")
    same = [_record(m, 0.5, archs=archs, clients=(0.4, 0.6)) for m in ("dense", "feddf")]
    assert "‡" not in render_table("t", same)  # a fleet trained again with the same client scores is the same fleet
    other = _record("coboosting", 0.3, archs=archs, clients=(0.4, 0.5))
    lines = [ln for ln in render_table("t", same + [other]).splitlines() if ln.startswith("‡")]
    assert lines == ["‡ mnist 0.5 seed 0: these methods ran on 2 different fleets (feddf, dense: clients 40.0, 60.0; "
                     "coboosting: clients 40.0, 50.0); the client columns show one of them."]
    assert "‡" not in render_table("t", same + [_record("coboosting", 0.3, seed=1, archs=archs, clients=(0.4, 0.5))])
    decoder = _record("fedmho", 0.3, archs=archs, clients=(0.4, None))  # a decoder client has no score to differ
    assert "‡" not in render_table("t", same + [decoder])


def test_replays_hand_their_server_settings_to_replay_as_given(monkeypatch, tmp_path):
    """The fleets' and fedmho_table's replays write the settings as --run-config items: each value
    (string, int, float, bool) reaches the replay's config as it was, beside the method."""
    from benchmarks import fedmho_table, fleets
    from launcher.launch import parse_overrides

    seen = []

    def fake_replay(uploads, args, run_dir):
        seen.append(parse_overrides(args))
        return {"global": {"accuracy": 0.5}}

    monkeypatch.setattr(fleets, "replay", fake_replay)
    monkeypatch.setattr(fedmho_table, "replay", fake_replay)
    monkeypatch.setattr(fleets, "code_version", lambda: "v")
    sets = {"server-model": "resnet18", "distill.epochs": 3, "distill.lr-student": 5e-05, "distill.keep-best": True}
    fleets.replay_in_worker(str(tmp_path), "dense", sets, str(tmp_path / "a"))
    fedmho_table.replay_method("t", tmp_path, tmp_path / "b", "fedmho", sets, classifier_only=False)
    assert seen == [{"method": "dense", **sets}, {"method": "fedmho", **sets}]


def test_a_record_keeps_the_start_of_a_teacher_scored_again_after_distillation():
    from benchmarks.records import record_from_result

    result = {"method": "fedhydra", "dataset": "mnist", "partition": "niid-bench", "alpha": 0.1, "num_clients": 1,
              "seed": 100, "preset": "cpu",
              "global": {"accuracy_final": 0.85, "ensemble_accuracy": 0.92, "ensemble_accuracy_start": 0.81},
              "timings": {"local_sum": 2.0, "local_max": 2.0, "server_fuse": 3.0, "total": 5.0},
              "clients": [{"local_accuracy": 0.4, "arch": "cnn2", "received_bytes": 10, "raw_bytes": 8}],
              "code_version": "abc1234"}
    record = record_from_result("t", result, {}, None)
    assert (record["ensemble_accuracy"], record["ensemble_accuracy_start"]) == (0.92, 0.81)
    del result["global"]["ensemble_accuracy_start"]  # a teacher that does not adapt is scored once
    assert record_from_result("t", result, {}, None)["ensemble_accuracy_start"] is None
