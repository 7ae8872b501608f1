"""The README's results blocks are what the committed records render (benchmarks.readme): a hand-edited number fails
the check, FedHydra's cells show records of the current default only, and `best` names a winner only beyond the
pooled standard error."""

import shutil

import pytest

from benchmarks import readme


def test_every_generated_block_of_the_readme_is_what_the_committed_records_render():
    text = readme.README.read_text()
    blocks = readme.BLOCK.findall(text)
    assert {"paper", "hetero", "clients", "dp"} <= {name for _, name, _, _ in blocks}
    rendered, changed = readme.render_readme(text)
    assert changed == [] and rendered == text
    for _, name, body, _ in blocks:  # each block ends with its provenance line
        assert body.rstrip("\n").splitlines()[-1].startswith(readme.PROVENANCE), name


def test_a_hand_edited_number_in_a_copy_of_the_readme_fails_the_check(tmp_path, capsys):
    copy = tmp_path / "README.md"
    shutil.copy(readme.README, copy)
    assert readme.main(["--check", "--file", str(copy)]) == 0
    text = copy.read_text()
    paper = readme.BLOCK.search(text)
    cell = next(line for line in paper.group("body").splitlines() if line.startswith("| mnist | 0.3 |"))
    number = cell.split(" | ")[2]  # FedAvg's cell, e.g. "40.47±6.05 (3)"
    edited = cell.replace(number, "41" + number[2:], 1)
    assert edited != cell
    copy.write_text(text.replace(cell, edited))
    assert readme.main(["--check", "--file", str(copy)]) == 1
    assert "generated block(s) paper differ" in capsys.readouterr().err
    assert readme.main(["--file", str(copy)]) == 0  # rewriting puts the records' number back
    assert copy.read_text() == text


def test_an_unknown_block_name_is_an_error_not_a_stale_block():
    with pytest.raises(KeyError, match="README block 'papr'"):
        readme.render_readme("<!-- begin: table papr -->\nold\n<!-- end: table papr -->\n")


def test_best_names_a_winner_only_beyond_the_pooled_standard_error():
    # means 0.85 and 0.55; sample variances 0.005 each: SE = sqrt(0.005 / 2 + 0.005 / 2) = 0.0707 < 0.30
    assert readme.best({"a": [0.8, 0.9], "b": [0.5, 0.6], "c": []}) == "a"
    # means 0.85 and 0.80: 0.05 < 0.0707
    assert readme.best({"b": [0.75, 0.85], "a": [0.8, 0.9]}) == "a ≈ b"
    assert readme.best({"a": [0.8, 0.9], "b": [0.5]}) == "– (n < 2)"
    assert readme.best({"a": [0.8, 0.9], "b": []}) == "–"
    assert readme.stat([0.8, 0.9]) == "85.00±5.00 (2)" and readme.stat([]) == "not run"


def test_the_paper_block_shows_fedhydra_only_from_records_of_the_current_default(monkeypatch):
    def rec(method, cell, seed, acc, version, at="1"):
        return {"table": "paper_table", "method": method, "dataset": "mnist", "partition": "niid-bench",
                "alpha": float(cell), "cell": cell, "seed": seed, "accuracy_final": acc, "code_version": version,
                "recorded_at": at, "preset": "cpu", "num_clients": 5, "machine": {"cpus": 2, "processor": "x86_64"},
                "wall_s": {"local": 3600.0, "server_total": 1800.0}, "uploads_id": f"u{cell}{seed}"}

    rows = [rec("fedavg", "0.1", 0, 0.40, "old"), rec("fedhydra", "0.1", 0, 0.80, "old"),
            rec("fedhydra", "0.1", 0, 0.90, "new"), rec("fedhydra", "0.1", 1, 0.70, "new"),
            rec("fedhydra", "0.1", 1, 0.60, "new", at="0"),  # an older record of the same seed: the later counts
            rec("fedhydra", "0.5", 0, 0.95, "old"), rec("fedhydra", "0.3", 0, 0.93, "new-dirty")]
    monkeypatch.setattr(readme, "load_records", lambda table: rows)
    monkeypatch.setattr(readme, "is_current_default", lambda version: version == "new")
    block = readme.paper_block()
    cells = {tuple(c.removesuffix(" †") for c in line.split(" | ")[:2]): line.split(" | ")
             for line in block.splitlines() if line.startswith("| ")}
    fedhydra = readme.PAPER_METHODS.index("fedhydra") + 2
    assert cells[("| mnist", "0.1")][fedhydra] == "80.00±10.00 (2)"  # (0.90 + 0.70) / 2; old and dirty left out
    assert cells[("| mnist", "0.5")][fedhydra] == "not run" and cells[("| mnist", "0.3")][fedhydra] == "not run"
    assert cells[("| mnist", "0.1")][2] == "40.00±0.00 (1)"  # other methods: any code version
    provenance = block.splitlines()[-1]
    # fedavg's and the two current fedhydra records: one fleet per seed (its clients once), three servers
    assert provenance.startswith(readme.PROVENANCE) and "code new (2), old (1), 0 of 3 records" in provenance
    assert provenance.endswith("wall time 2.0 h clients + 1.5 h server.")
