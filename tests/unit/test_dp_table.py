"""The DP report: accuracy per epsilon and method on one cell, and client training time with and without DP."""

import pytest

from benchmarks import dp_table

MACHINE = {"cpus": 2, "processor": "x86_64", "gpu": None}
# epsilon 8 at the preset's budgets: fedavg, fedhydra, fedmho-md, best (no standard error with one seed), client s
EPSILON_8 = "| mnist | 0.5 | 8 | 10 | 30 | 55.00 ± 5.00 (2) | 70.00 ± 0.00 (1) | 65.00 ± 0.00 (1) | – (n < 2) | 25.0 |"


def _record(epsilon, method, seed, accuracy, local=None):
    return {"table": dp_table.table_name(epsilon), "method": method, "dataset": "mnist", "partition": "niid-bench",
            "alpha": 0.5, "cell": "0.5", "num_clients": 5, "seed": seed, "preset": "cpu", "accuracy_final": accuracy,
            "wall_s": {"local": local} if local is not None else {}, "machine": MACHINE, "code_version": "abc1234",
            "recorded_at": f"2026-01-01T00:00:{seed:02d}"}


@pytest.fixture
def records(monkeypatch):
    by_table = {
        "dp-eps8": [_record(8, "fedavg", 0, 0.50, local=100.0), _record(8, "fedavg", 1, 0.60, local=150.0),
                    _record(8, "fedhydra", 0, 0.70)],
        "dp-eps0": [_record(0, "fedavg", 0, 0.80, local=25.0), _record(0, "fedhydra", 0, 0.90)],
        "dp-eps8-mixed": [{**_record(8, "fedmho-md", 0, 0.65), "table": "dp-eps8-mixed", "num_clients": 10}],
    }
    monkeypatch.setattr(dp_table, "load_records", lambda table: by_table.get(table, []))


def test_report_rows_per_epsilon_with_client_time(records, tmp_path):
    lines = dp_table.render([8.0, 0.0], out=tmp_path / "dp.md").read_text().splitlines()
    rows = [line for line in lines if line.startswith("| mnist |")]
    # epsilon 8: fedavg (50 + 60) / 2 = 55 +- 5; client time (100 + 150) / 2 runs / 5 clients = 25.0 s per client;
    # fedmho-md from its own mixed fleet's records
    # (these records name no client epochs: from before local.dp.epochs, the clients trained the preset's 10)
    assert rows[0] == EPSILON_8
    # no DP: 25 s over 5 clients = 5.0 s per client
    assert rows[1] == ("| mnist | 0.5 | no DP | 10 | 30 | 80.00 ± 0.00 (1) | 90.00 ± 0.00 (1) | not run | – (n < 2) "
                       "| 5.0 |")


def test_a_distillation_budget_run_on_some_fleets_gets_rows_of_its_own(records, tmp_path, monkeypatch):
    longer = {"overrides": {"distill.epochs": 60}, "recorded_at": "2026-01-02T00:00:00"}
    extra = {"dp-eps8": [{**_record(8, "fedhydra", 0, 0.76), **longer},
                         {**_record(8, "fedavg", 0, 0.50), **longer}],  # a replay: no client training
             "dp-eps0": [{**_record(0, "fedhydra", 0, 0.92), **longer}]}
    loaded = dp_table.load_records
    monkeypatch.setattr(dp_table, "load_records", lambda table: loaded(table) + extra.get(table, []))
    rows = [line for line in dp_table.render([8.0, 0.0], out=tmp_path / "dp.md").read_text().splitlines()
            if line.startswith("| mnist |")]
    # the preset's rows keep their means (the later 60-epoch FedHydra record does not replace 70.00); the
    # 60-epoch rows follow, with the fleet's client time (25.0 s per client from the two trainings at epsilon 8)
    assert rows[0] == EPSILON_8
    assert rows[2] == "| mnist | 0.5 | 8 | 10 | 60 | 50.00 ± 0.00 (1) | 76.00 ± 0.00 (1) | not run | – (n < 2) | 25.0 |"
    assert rows[3] == "| mnist | 0.5 | no DP | 10 | 60 | not run | 92.00 ± 0.00 (1) | not run | – | 5.0 |"
    assert dp_table.distill_epochs({"preset": "smoke"}) == 4


def test_the_report_shows_every_recorded_epsilon_whichever_subset_a_run_named(records, tmp_path, monkeypatch):
    for name in ("dp-eps8.jsonl", "dp-eps0-mixed.jsonl", "dp-eps1.jsonl", "dp-eps0.5.jsonl", "dp.md", "dp-eps.jsonl"):
        (tmp_path / name).write_text("")
    assert dp_table.recorded_epsilons(tmp_path) == [0.5, 1.0, 8.0, 0.0]  # no DP last
    monkeypatch.setattr(dp_table, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(dp_table, "parse_sets", lambda sets: (_ for _ in ()).throw(AssertionError("no run")))
    assert dp_table.main(["--render-only", "--epsilons", "8"]) == 0
    labels = [line.split(" | ")[2] for line in (tmp_path / "dp.md").read_text().splitlines()
              if line.startswith("| mnist |")]
    assert labels == ["8", "no DP"]  # the records of epsilon 0 too, though this invocation named 8 only


def test_client_epochs_get_rows_of_their_own_with_their_own_client_time(records, tmp_path, monkeypatch):
    # DP fleets trained at local.dp.epochs=20 (seed 0: 400 s over 5 clients = 80 s each), and no-DP clients at
    # local.epochs=20; the 10-epoch rows keep their means and times
    twenty = {"overrides": {"local.dp.epsilon": 8.0, "local.dp.epochs": 20}, "recorded_at": "2026-01-03T00:00:00"}
    extra = {"dp-eps8": [{**_record(8, "fedavg", 0, 0.58, local=400.0), **twenty},
                         {**_record(8, "fedhydra", 0, 0.86), **twenty}],
             "dp-eps0": [{**_record(0, "fedhydra", 0, 0.91), "overrides": {"local.epochs": 20}}]}
    loaded = dp_table.load_records
    monkeypatch.setattr(dp_table, "load_records", lambda table: loaded(table) + extra.get(table, []))
    rows = [line for line in dp_table.render([8.0, 0.0], out=tmp_path / "dp.md").read_text().splitlines()
            if line.startswith("| mnist |")]
    assert rows[0] == EPSILON_8
    assert rows[2] == "| mnist | 0.5 | 8 | 20 | 30 | 58.00 ± 0.00 (1) | 86.00 ± 0.00 (1) | not run | – (n < 2) | 80.0 |"
    assert rows[3] == "| mnist | 0.5 | no DP | 20 | 30 | not run | 91.00 ± 0.00 (1) | not run | – | not run |"


def test_client_epochs_of_a_record():
    dp_record = {"preset": "cpu", "overrides": {"local.dp.epsilon": 8.0, "local.dp.epochs": 20, "local.epochs": 3}}
    assert dp_table.client_epochs(dp_record, 8.0) == 20  # a DP client trains local.dp.epochs, not local.epochs
    assert dp_table.client_epochs({"preset": "cpu", "overrides": {"local.dp.epsilon": 8.0}}, 8.0) == 10
    assert dp_table.client_epochs({"preset": "cpu", "overrides": {"local.epochs": 3}}, 0.0) == 3
    assert dp_table.client_epochs({"preset": "smoke"}, 0.0) == 1


def test_the_fleet_is_the_dp_variant_with_and_without_dp():
    # a DP fleet names the preset's DP-SGD passes (cpu 20, smoke 1) unless the client sets give them
    assert dp_table.client_sets_for(8.0, "cnn2-gn", {}) == {"model": "cnn2-gn", "local.dp.epsilon": 8.0,
                                                            "local.dp.epochs": 20}
    assert dp_table.client_sets_for(8.0, "cnn2-gn", {}, "smoke")["local.dp.epochs"] == 1
    assert dp_table.client_sets_for(8.0, "cnn2-gn", {"local.dp.epochs": 7})["local.dp.epochs"] == 7
    assert dp_table.client_sets_for(0.0, "cnn2-gn", {"threads": 1}) == {"model": "cnn2-gn", "local.dp.epsilon": 0.0,
                                                                        "threads": 1}
    assert dp_table.table_name(8.0) == "dp-eps8" and dp_table.table_name(0.0) == "dp-eps0"


def test_a_batchnorm_model_is_refused_before_any_run():
    with pytest.raises(SystemExit):
        dp_table.main(["--datasets", "mnist", "--seeds", "0", "--epsilons", "8", "--model", "cnn2",
                       "--methods", "fedavg"])


def test_fedmho_md_gets_a_mixed_fleet_of_its_own_beside_the_shared_classifier_fleet():
    fleets = dp_table.fleets_for(["mnist"], ["0.5"], [0], [8.0], ["fedavg", "fedhydra", "fedmho-md"], "cnn2-gn", 5, {})
    shared, mixed = fleets
    assert (shared.table, shared.num_clients, shared.trained_by, shared.methods) == \
        ("dp-eps8", 5, "fedavg", ("fedavg", "fedhydra"))
    assert (mixed.table, mixed.num_clients, mixed.trained_by, mixed.methods) == \
        ("dp-eps8-mixed", 10, "fedmho-md", ("fedmho-md",))
    assert mixed.client_sets == {"model": "cnn2-gn", "local.dp.epsilon": 8.0, "local.dp.epochs": 20,
                                 "fedmho.constrained-clients": 5}
    only_mixed = dp_table.fleets_for(["mnist"], ["0.5"], [0, 1], [0.0], ["fedmho-md"], "cnn2-gn", 5, {})
    assert [(f.table, f.seed) for f in only_mixed] == [("dp-eps0-mixed", 0), ("dp-eps0-mixed", 1)]
