"""Layers point one way and no import closes a loop: the core (oneshot_fl) < strategies < the application
(server_app, client_app, launcher), and no cycle among modules. The graph is read from the source with ast:
every `import` and `from ... import` of every module, inside functions too (an import inside a function is
still a dependency; keeping it there only delays it)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

PACKAGES = ("oneshot_fl", "strategies", "server_app", "client_app", "launcher")
# the project's packages each package may import: each layer the ones below it, the application's three
# packages not each other (the Flower apps are shipped without launcher/; launcher builds strategies itself)
ALLOWED = {
    "oneshot_fl": {"oneshot_fl"},
    "strategies": {"oneshot_fl", "strategies"},
    "server_app": {"oneshot_fl", "strategies", "server_app"},
    "client_app": {"oneshot_fl", "strategies", "client_app"},
    "launcher": {"oneshot_fl", "strategies", "launcher"},
}
# core modules that import Flower: their job is Flower records (oneshot_fl/__init__.py names them)
CORE_FLOWER_MODULES = {"oneshot_fl.uploads"}


def modules(root: Path, packages=PACKAGES) -> dict[str, Path]:
    """Dotted module name -> source file of every module of `packages` under `root`."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(module: str, path: Path, known: set[str]) -> list[str]:
    """Every module name `module` imports, absolute: `from p import x` names p.x when that is a module of
    `known`, else p; relative imports are resolved against the module's package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            names.extend(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names)
    return names


def import_graph(root: Path, packages=PACKAGES) -> dict[str, set[str]]:
    """module -> the project's modules it imports (an import of a.b.c counts as one of its module a.b.c, or of the
    longest prefix that is a module: `import pkg.sub` where sub is a function of pkg counts as pkg)."""
    files = modules(root, packages)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        targets = set()
        for name in imported_names(module, path, set(files)):
            parts = name.split(".")
            while parts and ".".join(parts) not in files:
                parts.pop()
            if parts and ".".join(parts) != module:
                targets.add(".".join(parts))
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles: every strongly connected component of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, imported module) for every import of a package the module's package may not import (ALLOWED)."""
    return sorted((module, target) for module, targets in graph.items() for target in targets
                  if target.split(".")[0] not in ALLOWED[module.split(".")[0]])


def test_no_import_cycle_among_the_projects_modules():
    graph = import_graph(ROOT)
    assert len(graph) > 90 and "launcher.launch" in graph["launcher.cli"]  # the whole project, read
    assert cycles(graph) == []


def test_each_layer_imports_only_the_layers_below_it():
    graph = import_graph(ROOT)
    # the graph holds imports inside functions: the CLI imports the method registry only when it lists methods
    assert "strategies" in graph["launcher.cli"] and "oneshot_fl.models.registry" in graph["oneshot_fl.config"]
    assert upward_imports(graph) == []


def test_flower_is_imported_in_the_core_only_by_the_modules_named_for_it():
    files = modules(ROOT, ("oneshot_fl",))
    flower = {module for module, path in files.items()
              if any(name == "flwr" or name.startswith("flwr.") for name in imported_names(module, path, set(files)))}
    assert flower == CORE_FLOWER_MODULES
    docstring = ast.get_docstring(ast.parse((ROOT / "oneshot_fl" / "__init__.py").read_text()))
    assert all(f"`{module.rpartition('.')[2]}`" in docstring for module in flower)


def _package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checker_finds_a_cycle_closed_inside_a_function_and_every_upward_import(tmp_path):
    root = _package(tmp_path, {
        "oneshot_fl/__init__.py": "",
        "oneshot_fl/a.py": "from oneshot_fl import b\n",
        # the import that closes the loop sits in a function; `from . import c` is the submodule c, not the package
        "oneshot_fl/b.py": "def f():\n    from oneshot_fl.a import x\n    from . import c\n",
        "oneshot_fl/c.py": "import os\n\n\ndef g():\n    import strategies.m\n",
        "strategies/__init__.py": "from strategies.m import thing\n",
        "strategies/m.py": "from oneshot_fl.c import g\nimport launcher\n",
        "launcher/__init__.py": "",
        "launcher/cli.py": "from ..strategies import m\nimport server_app.app\n",
        "server_app/__init__.py": "",
        "server_app/app.py": "from oneshot_fl import a\n",
        "client_app/__init__.py": "",
    })
    graph = import_graph(root)
    assert graph["oneshot_fl.a"] == {"oneshot_fl.b"} and graph["oneshot_fl.b"] == {"oneshot_fl.a", "oneshot_fl.c"}
    assert graph["strategies"] == {"strategies.m"} and graph["launcher.cli"] == {"strategies.m", "server_app.app"}
    # c -> strategies.m -> c, and a <-> b
    assert cycles(graph) == [["oneshot_fl.a", "oneshot_fl.b"], ["oneshot_fl.c", "strategies.m"]]
    assert upward_imports(graph) == [("launcher.cli", "server_app.app"), ("oneshot_fl.c", "strategies.m"),
                                     ("strategies.m", "launcher")]
    (root / "oneshot_fl" / "b.py").write_text("import os\n")  # the loop opened: a imports b, b nothing back
    (root / "oneshot_fl" / "c.py").write_text("")
    assert cycles(import_graph(root)) == []
