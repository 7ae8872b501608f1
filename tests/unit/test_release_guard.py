"""The CI guard of the published numbers.

1. Every table of benchmarks/results/ that a renderer makes from records, and the README's generated blocks, is what
   the committed records render now: a number edited by hand, or records committed without their table, fails
   (shown on a copy below).
2. The tables the release manifest (benchmarks/results/RELEASE.toml) lists as released come from records of their
   release commit only: none of a dirty tree or of another code version, the commit an ancestor of HEAD, and no row
   refused for mixed uploads.

The manifest lists no table until the release run (`python -m benchmarks.release`) lands: today's records are mostly
from uncommitted trees (most of paper_table.jsonl and robustness.jsonl) and from many code versions, and would fail
check 2. Check 1 holds for every table now.
"""

import json
import shutil
import subprocess
from pathlib import Path

from benchmarks import ablation, clients_table, dp_table, fedmho_table, launcher_cpu, readme, release, render
from benchmarks import reference_runs, robustness, scale
from benchmarks.cells import REFUSED
from benchmarks.records import REPO_ROOT, RESULTS_DIR, load_records
from experiments import cifar_budget, hetero_diag

# results file -> renders it from the committed records into the given path
RENDERED = {
    "README.md": lambda out: render.render(out=out),
    "clients.md": lambda out: clients_table.render(out=out),
    "dp.md": lambda out: dp_table.render(out=out),
    "robustness.md": lambda out: robustness.render(out=out),
    "fedmho_table.md": lambda out: fedmho_table.render_fedmho("fedmho_table", out=out),
    "ablation.md": lambda out: ablation.render(out=out),
    "scale.md": lambda out: scale.render(out=out),
    "hetero_diag.md": lambda out: hetero_diag.render(out=out),
    "reference_runs.md": lambda out: reference_runs.render(out),
    "cifar10_budget.md": lambda out: cifar_budget.render(out),
    "launcher_cpu.md": lambda out: out.write_text(
        launcher_cpu.render(json.loads((RESULTS_DIR / "launcher_cpu.json").read_text()))),
}
# results/*.md that no renderer makes from the committed records: reports a run writes once (compose_check;
# mutation, which names its run's time; cost_model and cpu_parity, each a measurement of one run), earlier passes
# and one-off checks kept as they were, the probes' reports (experiments/)
NOT_RENDERED = {"compose_check.md", "mutation.md", "ablation_first_pass.md", "refactor_check.md", "gpu_cells.md",
                "gpu_stratify.md", "memory_format.md", "teacher_sharpness.md", "teacher_sharpness_cifar10_ms30.md",
                "teacher_sharpness_cifar10_s3.md", "fedhydra_teacher.md", "cost_model.md", "cpu_parity.md"}


def differences(results: Path, readme_file: Path, scratch: Path) -> list[str]:
    """The tables under `results` (and the README blocks of `readme_file`) that differ from what the records render."""
    scratch.mkdir(parents=True, exist_ok=True)
    found = []
    for name, make in RENDERED.items():
        out = scratch / name
        make(out)
        if out.read_text() != (results / name).read_text():
            found.append(f"benchmarks/results/{name}")
    _, changed = readme.render_readme(readme_file.read_text())
    return found + [f"README.md block {name}" for name in changed]


def is_ancestor(commit: str) -> bool:
    return subprocess.run(["git", "merge-base", "--is-ancestor", commit, "HEAD"], cwd=REPO_ROOT,
                          capture_output=True, timeout=30).returncode == 0


def release_problems(manifest: dict[str, dict], records_of=load_records, ancestor=is_ancestor) -> list[str]:
    """Every record of a released table that is not of its release commit, or a release commit not in HEAD's past."""
    problems = []
    for table, entry in sorted(manifest.items()):
        commit = entry["commit"]
        if commit.endswith("-dirty") or not ancestor(commit):
            problems.append(f"{table}: release commit {commit} is not a clean ancestor of HEAD")
        for name in entry["records"]:
            for r in records_of(name):
                version = r.get("code_version", "?")
                if version != commit:
                    why = "a dirty tree" if version.endswith("-dirty") else f"code {version}"
                    problems.append(f"{table}: {name}.jsonl has a record of {why} ({r.get('method')}, "
                                    f"{r.get('dataset')}, seed {r.get('seed')}), not of {commit}")
    return problems


def test_every_results_table_is_either_rendered_by_the_guard_or_named_as_a_report_no_renderer_makes():
    tables = {p.name for p in RESULTS_DIR.glob("*.md")}
    assert tables - set(RENDERED) - NOT_RENDERED == set()
    assert set(RENDERED) <= tables


def test_every_table_and_every_readme_block_is_what_the_committed_records_render(tmp_path):
    assert differences(RESULTS_DIR, readme.README, tmp_path / "rendered") == []


def test_a_hand_edited_number_in_a_copy_of_a_table_fails_the_guard(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS_DIR, results, ignore=shutil.ignore_patterns("*.jsonl", "archive"))
    clients = (results / "clients.md").read_text()
    row = next(line for line in clients.splitlines() if line.startswith("| 10 |"))
    edited = row.replace(row.split(" | ")[1], "99.99 ± 0.00 (3)", 1)
    assert edited != row
    (results / "clients.md").write_text(clients.replace(row, edited))
    assert differences(results, readme.README, tmp_path / "rendered") == ["benchmarks/results/clients.md"]


def test_the_release_manifest_lists_no_table_until_the_release_run_lands_and_its_tables_pass():
    manifest = release.read_manifest()
    assert release_problems(manifest) == []
    rendered = [readme.README.read_text()] + [(RESULTS_DIR / name).read_text() for name in RENDERED]
    for table, entry in manifest.items():
        assert set(entry) >= {"commit", "records", "provenance"}, table
        assert entry["provenance"].startswith(readme.PROVENANCE), table
        for name in entry["records"]:  # a released table refuses no row for mixed uploads
            assert not any(f"{REFUSED} {name} " in text for text in rendered), name


def test_the_release_check_names_a_dirty_record_another_code_version_and_a_commit_outside_head():
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                          text=True).stdout.strip()
    good = {"method": "dense", "dataset": "mnist", "seed": 0, "code_version": head}
    files = {"paper_table": [good, {**good, "seed": 1, "code_version": f"{head}-dirty"}],
             "clients-k5": [{**good, "code_version": "0000000"}]}
    manifest = {"paper_table": {"commit": head, "records": ["paper_table"]},
                "clients": {"commit": head, "records": ["clients-k5"]}}
    problems = release_problems(manifest, records_of=lambda name: files[name])
    assert problems == [f"clients: clients-k5.jsonl has a record of code 0000000 (dense, mnist, seed 0), not of {head}",
                        f"paper_table: paper_table.jsonl has a record of a dirty tree (dense, mnist, seed 1), not of "
                        f"{head}"]
    files["paper_table"].pop()
    files["clients-k5"] = [good]
    assert release_problems(manifest, records_of=lambda name: files[name]) == []
    outside = {"t": {"commit": "0123abc", "records": []}}  # no such commit in this history
    assert release_problems(outside) == ["t: release commit 0123abc is not a clean ancestor of HEAD"]
