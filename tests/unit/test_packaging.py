"""What `flwr run` ships (the FAB) and what pyproject.toml declares."""

from __future__ import annotations

import ast
import io
import os
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from tests.conftest import ROOT

APP_PACKAGES = ("oneshot_fl", "strategies", "server_app", "client_app")  # what the FAB ships
PACKAGES = (*APP_PACKAGES, "launcher")  # what the wheel installs: the apps and the run shell


def fab_names(app: Path = ROOT) -> list[str]:
    from flwr.cli.build import build_fab_from_disk

    with zipfile.ZipFile(io.BytesIO(build_fab_from_disk(app))) as fab:
        return fab.namelist()


def test_the_fab_holds_the_apps_code_and_nothing_else():
    names = fab_names()
    tops = {name.split("/")[0] for name in names}
    assert tops == {*APP_PACKAGES, "pyproject.toml", "README.md", "LICENSE", ".info"}, tops
    modules = {p.relative_to(ROOT).as_posix() for package in APP_PACKAGES for p in (ROOT / package).rglob("*.py")
               if "__pycache__" not in p.parts}
    assert modules <= set(names), modules - set(names)  # every module of the apps is in it
    assert not [n for n in names if n.endswith((".pyc", ".jsonl", ".pt", ".npz"))]


def test_flwr_build_writes_the_same_fab(tmp_path):
    flwr = Path(sys.executable).parent / "flwr"
    env = {**os.environ, "FLWR_HOME": str(tmp_path / "home"), "FLWR_DISABLE_UPDATE_CHECK": "1",
           "FLWR_TELEMETRY_ENABLED": "0"}
    done = subprocess.run([str(flwr), "build", "--app", str(ROOT)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    (fab,) = tmp_path.glob("*.fab")
    with zipfile.ZipFile(fab) as archive:
        assert sorted(archive.namelist()) == sorted(fab_names())


def _imported_top_modules() -> set[str]:
    mods = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    mods.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    mods.add(node.module.split(".")[0])
    return mods


def test_every_third_party_import_of_the_packages_is_a_declared_dependency():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = {dep.split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip().lower()
                for dep in project["dependencies"]}
    import_names = {"flwr": "flwr", "flwr_datasets": "flwr-datasets", "torch": "torch",
                    "torchvision": "torchvision", "numpy": "numpy", "scipy": "scipy", "matplotlib": "matplotlib",
                    "ot": "pot", "datasets": "datasets", "PIL": "pillow", "psutil": "psutil", "yaml": "pyyaml",
                    "cryptography": "cryptography", "pathspec": "pathspec", "opacus": "opacus"}
    third_party = _imported_top_modules() - set(sys.stdlib_module_names) - set(PACKAGES)
    unknown = third_party - set(import_names)
    assert not unknown, f"imports without a known distribution: {unknown}"
    undeclared = {import_names[m] for m in third_party} - declared
    assert not undeclared, f"imported but not declared in [project].dependencies: {undeclared}"
    assert "torch==2.14.1" in project["dependencies"] and "torchvision==0.29.1" in project["dependencies"]


def fab_files(app: Path) -> dict[str, bytes]:
    from flwr.cli.build import build_fab_from_disk

    with zipfile.ZipFile(io.BytesIO(build_fab_from_disk(app))) as fab:
        return {name: fab.read(name) for name in fab.namelist()}


def test_the_app_copy_the_launcher_submits_bundles_to_the_same_fab(tmp_path):
    from launcher.launch import stage_app

    staged = fab_files(stage_app(ROOT, tmp_path))
    assert staged == fab_files(ROOT)
    assert not any((tmp_path / d).exists() for d in (".venv", ".git", "benchmarks/runs"))


def test_validating_a_config_imports_no_heavy_optional_libraries():
    """The launcher validates every method's parameters before starting Flower; torchvision (which
    imports torch._dynamo), POT / scipy.stats and pyplot cost seconds of CPU and are imported only
    where a model, OT fusion, FedHydra's report or a plot needs them."""
    code = ("import sys; from launcher.launch import check_run_config; check_run_config({}); "
            "print(sorted(m for m in ('torchvision', 'ot', 'scipy.stats', 'matplotlib.pyplot') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_wheel_installs_the_apps_and_the_run_shell_and_the_commands_start_there():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"] == list(PACKAGES)
    assert pyproject["project"]["scripts"] == {"oneshot-fl": "launcher.cli:main",
                                               "oneshot-fl-deploy": "launcher.deploy.cli:main"}
