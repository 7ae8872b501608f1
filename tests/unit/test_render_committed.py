"""Every records file committed under benchmarks/results renders: a table with its own report is skipped by the
shared renderer, every other one has the fields it reads (a new benchmark's records once broke it)."""

from benchmarks import render


def test_the_committed_records_render(tmp_path):
    out = render.render(out=tmp_path / "README.md")
    text = out.read_text()
    assert text.startswith("# Benchmark results")
    assert "## dp_recipe" not in text and "## fedmho_causes" not in text  # their own reports
