"""What a table cell may claim (benchmarks.cells), through every renderer: a row whose methods ran on different
uploads is refused in one line naming the fingerprints, a cell used to choose a setting carries † and says what it
chose, and `best` names a winner only beyond the pooled standard error."""

import json

import pytest

from benchmarks import cells
from benchmarks.cells import best, uploads_refusal
from benchmarks.records import RESULTS_DIR

TUNED = '''
[[cell]]
table = "t"
dataset = "mnist"
cell = "0.1"
chose = "the generator width 16"
on = "seed 0"
records = "t.jsonl"
commit = "abc1234"
'''


def _rec(method, seed, acc, fp=None, label=None, dataset="mnist", cell="0.1"):
    r = {"table": "t", "method": method, "dataset": dataset, "partition": "niid-bench", "alpha": float(cell),
         "cell": cell, "num_clients": 5, "seed": seed, "preset": "cpu", "accuracy_final": acc,
         "ensemble_accuracy": None, "client_accuracy": [], "client_archs": [], "wall_s": {"total": 1.0},
         "machine": {"cpus": 2, "processor": "x86_64", "gpu": None}, "code_version": "abc1234",
         "recorded_at": f"2026-01-01T00:00:0{seed}"}
    if fp:
        r["uploads_fp"] = fp
    if label:
        r["label"] = label
    return r


@pytest.fixture
def tuned(monkeypatch, tmp_path):
    path = tmp_path / "tuned.toml"
    path.write_text(TUNED)
    monkeypatch.setattr(cells, "TUNED_FILE", path)
    return path


def test_best_is_a_tie_within_the_pooled_standard_error():
    # means 0.85 and 0.75, sample variances 0.005 each: SE = sqrt(0.005 / 2 + 0.005 / 2) = 0.0707 < 0.10
    assert best({"a": [0.8, 0.9], "b": [0.7, 0.8]}) == "a"
    # means 0.85 and 0.80: 0.05 < 0.0707
    assert best({"a": [0.8, 0.9], "b": [0.75, 0.85]}) == "a ≈ b"
    assert best({"a": [0.8, 0.9], "b": [0.5]}) == "– (n < 2)" and best({"a": [0.8]}) == "–"


def test_a_row_on_one_fingerprint_per_seed_passes_and_a_mixed_one_is_refused_naming_them():
    same = [_rec("fedavg", 0, 0.5, "f0"), _rec("dense", 0, 0.6, "f0"), _rec("fedavg", 1, 0.5, "f1"),
            _rec("dense", 1, 0.6, "f1")]
    assert uploads_refusal("t mnist 0.1", same) is None  # seeds differ, methods of a seed agree
    mixed = same + [_rec("fedhydra", 1, 0.7, "f9", label="fedhydra-paper")]
    assert uploads_refusal("t mnist 0.1", mixed) == (
        "refused: t mnist 0.1 seed 1: its methods ran on different uploads (dense, fedavg: f1; fedhydra-paper: f9)")
    # a method on a fleet of its own by design, and records written before the fingerprint, are not compared
    assert uploads_refusal("t mnist 0.1", mixed, exempt=("fedhydra-paper",)) is None
    assert uploads_refusal("t mnist 0.1", same + [_rec("fedhydra", 1, 0.7)]) is None


def test_render_table_refuses_a_mixed_row_shows_best_and_marks_a_tuned_cell(tuned):
    from benchmarks.render import render_table

    records = [_rec("fedavg", s, 0.5 + 0.01 * s, f"f{s}") for s in (0, 1)]
    records += [_rec("dense", s, 0.8 + 0.01 * s, f"f{s}") for s in (0, 1)]
    records += [_rec("dense", 0, 0.6, "g0", cell="0.5"), _rec("fedavg", 0, 0.4, "h0", cell="0.5")]
    text = render_table("t", records)
    table = text.split("\n\n")[2]  # the accuracy table (the wall-time table's rows start alike)
    rows = {line.split(" | ")[1]: line for line in table.splitlines() if line.startswith("| mnist |")}
    assert rows["0.1 †"].endswith("| 50.50 ± 0.50 (2) | 80.50 ± 0.50 (2) | dense |")
    assert rows["0.5"] == ("| mnist | 0.5 | 5 | refused: t mnist 0.5 K=5 seed 0: its methods ran on different "
                           "uploads (dense: g0; fedavg: h0) |")
    assert "† mnist 0.1: chose the generator width 16; on seed 0; records: t.jsonl; commit abc1234." in text


def test_the_readme_blocks_and_the_fedmho_report_refuse_mixed_rows_but_not_a_fleet_of_its_own(tuned, monkeypatch,
                                                                                              tmp_path):
    from benchmarks import fedmho_table, readme

    row = readme.row_cells("paper_table mnist 0.1", [_rec("fedavg", 0, 0.5, "f0"), _rec("dense", 0, 0.6, "f1")],
                           ("fedavg", "dense"))
    assert row == ["refused: paper_table mnist 0.1 seed 0: its methods ran on different uploads "
                   "(fedavg: f0; dense: f1)"]
    assert readme.row_cells("x", [_rec("fedavg", 0, 0.5, "f0"), _rec("fedmho-md", 0, 0.6, "f1")],
                            ("fedavg", "fedmho-md"), exempt=("fedmho-md",)) == [
        "50.00±0.00 (1)", "60.00±0.00 (1)", "– (n < 2)"]
    fedmho = [{**_rec(m, 0, acc, fp), "alpha": 0.5, "cell": "0.5", "upload_per_role": {}}
              for m, acc, fp in (("fedmho", 0.7, "mixed"), ("fedavg", 0.5, "mixed"), ("fedcvae", 0.6, "decoders"))]
    monkeypatch.setattr(fedmho_table, "load_records", lambda table: fedmho)
    text = fedmho_table.render_fedmho("fedmho_table", out=tmp_path / "f.md").read_text()
    assert "refused" not in text  # FedCVAE's all-decoder fleet is its own by design
    monkeypatch.setattr(fedmho_table, "load_records", lambda table: fedmho + [
        {**_rec("dense", 0, 0.6, "other"), "alpha": 0.5, "cell": "0.5", "upload_per_role": {}}])
    text = fedmho_table.render_fedmho("fedmho_table", out=tmp_path / "f.md").read_text()
    assert ("| mnist | 0.5 | refused: fedmho_table mnist 0.5 seed 0: its methods ran on different uploads "
            "(fedavg, fedmho: mixed; dense: other) |") in text


def test_the_tuned_cells_file_names_for_each_cell_what_it_chose_and_where_the_evidence_is():
    entries = cells.tuned_cells(cells.TUNED_FILE)
    assert ("paper_table", "fmnist", "0.5") in entries
    for (table, _, cell), entry in entries.items():
        assert (RESULTS_DIR / f"{table}.jsonl").is_file(), table  # a records file the renderers read
        assert all([entry.chose, entry.on, entry.records, entry.commit]), entry
        assert cell == "2c/c" or float(cell) > 0
    assert cells.dagger("paper_table", "fmnist", "0.5") == " †" and cells.dagger("paper_table", "mnist", "0.5") == ""


def test_a_tuned_cell_in_a_records_file_that_does_not_hold_it_marks_nothing(tuned):
    assert cells.tuned_notes("t", {("mnist", "0.5")}) == []
    assert cells.tuned_notes(("u", "t"), {("mnist", "0.1")}) == [
        "† mnist 0.1: chose the generator width 16; on seed 0; records: t.jsonl; commit abc1234."]
    assert json.loads(json.dumps(cells.tuned_cells()[("t", "mnist", "0.1")].__dict__))["commit"] == "abc1234"
