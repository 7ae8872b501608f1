"""benchmarks/ is commands on shared modules: no module there imports a table command (the fleets module,
records, render and the other shared modules are what commands share), and a table's variant labels reach its runs."""

import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TABLE_COMMANDS = {"paper_table", "clients_table", "dp_table", "hetero_table", "fedmho_table", "multiround_table",
                  "robustness", "ablation", "scale", "launcher_cpu", "compose_check", "mutation"}


def benchmark_imports(path: Path) -> set[str]:
    """The benchmarks.<module> names a source file imports, wherever in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "benchmarks":
                names |= {alias.name for alias in node.names}
            elif node.module.startswith("benchmarks."):
                names.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            names |= {alias.name.split(".")[1] for alias in node.names if alias.name.startswith("benchmarks.")}
    return names


def test_the_import_scan_sees_every_import_form(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("from benchmarks.fleets import Fleet\nimport benchmarks.records\n"
                      "def f():\n    from benchmarks import paper_table, render\n")
    assert benchmark_imports(source) == {"fleets", "records", "paper_table", "render"}


def test_every_table_command_exists_and_none_imports_another():
    modules = {p.stem: p for p in (ROOT / "benchmarks").glob("*.py")}
    assert TABLE_COMMANDS <= set(modules)
    offenders = {name: sorted((benchmark_imports(path) & TABLE_COMMANDS) - {name})
                 for name, path in modules.items()}
    assert {name: found for name, found in offenders.items() if found} == {}


def test_experiments_import_no_table_command_and_the_answered_probes_are_gone():
    experiments = {p.stem: p for p in (ROOT / "experiments").glob("*.py") if p.stem != "__init__"}
    assert {"hetero_diag", "teacher_sharpness", "gpu_cells", "gpu_stratify", "memory_format"} <= set(experiments)
    assert {name: sorted(benchmark_imports(path) & TABLE_COMMANDS) for name, path in experiments.items()
            if benchmark_imports(path) & TABLE_COMMANDS} == {}
    probes = {"hetero_diag", "ms_growth", "teacher_sharpness", "fedmho_causes", "dp_recipe", "gpu_cells",
              "gpu_stratify", "memory_format"}
    assert not probes & {p.stem for p in (ROOT / "benchmarks").glob("*.py")}


def test_a_multiround_variant_runs_its_method_with_its_settings_and_is_recorded_under_its_label(monkeypatch,
                                                                                                tmp_path):
    from benchmarks import multiround_table, records

    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(multiround_table, "BENCH_DIR", tmp_path)
    monkeypatch.setattr(multiround_table, "render", lambda: None)
    ran = []

    class Run:
        ok = True

    def fake_simulation(overrides, stream=True):
        ran.append(overrides)
        for r in (1, 2):
            folder = Path(overrides["output-dir"]) / overrides["run-name"] / f"round-{r}"
            folder.mkdir(parents=True)
            folder.joinpath("result.json").write_text(json.dumps({
                "method": overrides["method"], "dataset": "mnist", "partition": "niid-bench", "alpha": 0.1,
                "num_clients": 5, "seed": 0, "preset": "cpu", "round": r, "num_rounds": 2,
                "global": {"accuracy": 0.25 * r, "accuracy_final": 0.25 * r}, "clients": [],
                "timings": {"local_sum": 1.0, "server_fuse": 1.0}}))
        return Run()

    monkeypatch.setattr(multiround_table, "run_simulation", fake_simulation)
    args = ["--dataset", "mnist", "--cell", "0.1", "--rounds", "2", "--methods", "fedavg", "fedlmd-tf"]
    assert multiround_table.main(args) == 0
    assert [(o["method"], o.get("local.loss"), o["run-name"]) for o in ran] == [
        ("fedavg", None, "mnist-0.1-s0-fedavg-T2"), ("fedavg", "fedlmd-tf", "mnist-0.1-s0-fedlmd-tf-T2")]
    written = records.load_records("multiround")
    assert [(r.get("label"), r["round"], r["accuracy_final"]) for r in written] == [
        (None, 1, 0.25), (None, 2, 0.5), ("fedlmd-tf", 1, 0.25), ("fedlmd-tf", 2, 0.5)]
    ran.clear()
    assert multiround_table.main(args) == 0 and ran == []  # both have their records: nothing runs again


def test_every_project_module_the_code_imports_exists():
    """Imports inside functions run only when that path runs: a module removed from the project must not leave one
    behind (reference_runs' random-filter replay once imported a probe that had gone)."""
    import importlib.util

    project = ("benchmarks", "experiments", "oneshot_fl", "strategies", "client_app", "server_app")
    missing = {}
    for path in [p for top in project for p in (ROOT / top).rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else
                     [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            for name in names:
                if name.split(".")[0] in project and importlib.util.find_spec(name) is None:
                    missing.setdefault(path.name, []).append(name)
    assert missing == {}
