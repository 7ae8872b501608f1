"""The client-number report: accuracy per K and method, server time as a ratio to the smallest K
on the same seeds."""

import pytest

from benchmarks import clients_table

MACHINE = {"cpus": 2, "processor": "x86_64", "gpu": None}


def _record(k, method, seed, accuracy, server, stages=None):
    return {"table": f"clients-k{k}", "method": method, "dataset": "fmnist", "partition": "niid-bench",
            "alpha": 0.5, "cell": "0.5", "num_clients": k, "seed": seed, "preset": "cpu", "accuracy_final": accuracy,
            "wall_s": {"server_total": server, **(stages or {})}, "machine": MACHINE, "code_version": "abc1234",
            "recorded_at": f"2026-01-01T00:00:{seed:02d}"}


@pytest.fixture
def records(monkeypatch):
    by_table = {
        "clients-k5": [_record(5, "fedhydra", 0, 0.80, 100.0, {"stratification": 20.0, "distillation": 80.0}),
                       _record(5, "fedhydra", 1, 0.90, 120.0, {"stratification": 30.0, "distillation": 90.0}),
                       _record(5, "dense", 0, 0.70, 50.0)],
        "clients-k10": [_record(10, "fedhydra", 0, 0.75, 330.0, {"stratification": 110.0, "distillation": 220.0}),
                        _record(10, "fmnist-other-cell", 0, 0.1, 1.0) | {"cell": "0.1", "method": "dense"}],
    }
    monkeypatch.setattr(clients_table, "load_records", lambda table: by_table.get(table, []))


@pytest.fixture(autouse=True)
def no_tuned_cells(monkeypatch, tmp_path):
    """No cell marked †: these tests pin the numbers (tests/unit/test_cells.py pins the marks)."""
    from benchmarks import cells

    (tmp_path / "tuned.toml").write_text("")
    monkeypatch.setattr(cells, "TUNED_FILE", tmp_path / "tuned.toml")


def test_report_gives_mean_accuracy_and_time_ratio_to_the_smallest_k(records, tmp_path):
    text = clients_table.render([5, 10], out=tmp_path / "clients.md").read_text()
    lines = text.splitlines()
    accuracy_rows = [line for line in lines if line.startswith(("| 5 |", "| 10 |"))]
    # accuracy table: fedhydra at K=5 is (80 + 90) / 2 = 85 +- 5 over 2 seeds; dense ran K=5 only
    # best: fedhydra's lead over dense has no standard error where dense ran one seed
    assert accuracy_rows[0] == "| 5 | 70.00 ± 0.00 (1) | 85.00 ± 5.00 (2) | – (n < 2) |"
    assert accuracy_rows[1] == "| 10 | not run | 75.00 ± 0.00 (1) | – |"  # the 0.1 cell's record is not this table's
    # time table: fedhydra 110 s at K=5 (mean of 100 and 120); K=10 ran seed 0 alone, so its 330 s is compared
    # with K=5's seed 0 (100 s) -> 3.30x, not with the two-seed mean
    assert accuracy_rows[2] == "| 5 | 50.0 (1.00x) | 110.0 (1.00x) |"
    assert accuracy_rows[3] == "| 10 | not run | 330.0 (3.30x) |"
    assert "compared with K = 5's seed 0" in text
    # stage table: stratification (20 + 30) / 2 = 25, distillation 85, share 25 / 110
    assert accuracy_rows[4] == "| 5 | 25.0 | 85.0 | 23% |"
    assert accuracy_rows[5] == "| 10 | 110.0 | 220.0 | 33% |"


def test_large_fleets_run_only_their_seeds():
    assert clients_table.seeds_for(20, [0, 1, 2], 50, [0]) == [0, 1, 2]
    assert clients_table.seeds_for(50, [0, 1, 2], 50, [0]) == [0]


def test_client_numbers_must_increase():
    with pytest.raises(SystemExit):
        clients_table.main(["--ks", "10", "5", "--render-only"])


def test_the_report_shows_every_recorded_k_whichever_a_run_named(records, tmp_path, monkeypatch):
    for name in ("clients-k10.jsonl", "clients-k5.jsonl", "clients-k100.jsonl", "clients.md", "clients-kx.jsonl"):
        (tmp_path / name).write_text("")
    assert clients_table.recorded_ks(tmp_path) == [5, 10, 100]
    monkeypatch.setattr(clients_table, "RESULTS_DIR", tmp_path)
    assert clients_table.main(["--ks", "10", "--render-only"]) == 0
    rows = [line for line in (tmp_path / "clients.md").read_text().splitlines() if line.startswith("| 10 |")]
    assert rows[1] == "| 10 | not run | 330.0 (3.30x) |"  # still a ratio to K = 5, though this run named 10 only
