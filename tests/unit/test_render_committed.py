"""Every records file committed under benchmarks/results renders: a table with its own report is skipped by the
shared renderer, every other one has the fields it reads (a new benchmark's records once broke it)."""

from benchmarks import render


def test_the_committed_records_render(tmp_path):
    out = render.render(out=tmp_path / "README.md")
    text = out.read_text()
    assert text.startswith("# Benchmark results")
    assert "## ablation" not in text and "## hetero_diag" not in text  # their own reports
    assert "## fedhydra_teacher" not in text
