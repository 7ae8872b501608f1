"""What the user docs show exists in the code as it is: every `python -m` module, every command line of
`oneshot-fl`, `python -m benchmarks.*` / `experiments.*` / `launcher.deploy` (parsed by the command's own argparse
parser, which is stopped before the command runs; options in [brackets] must be options of that command), every
run-config key named in backticks or in a `-c "..."` string, and every source file named by its path.

A renamed module, subcommand, option or key, or a moved file, fails here with the doc and the line that names it.
Long runs are not started: the parsers are stopped once they have read the arguments."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from oneshot_fl.config import default_run_config, parse_overrides
from tests.unit.test_docs import ROOT, user_docs

FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.DOTALL)
SPAN = re.compile(r"`([^`\n]+(?:\n[^`\n]+)*)`")  # inline code, possibly wrapped over lines
COMMAND = re.compile(r"(?:^|[\s;(])(?:\.venv/bin/)?(?:python3? -m ([\w.]+)|(oneshot-fl(?:-deploy)?))((?:\s.*)?)$")
SECTIONS = ("local", "distill", "fedhydra", "dense", "fedmho", "fedcvae", "fedavg", "ot", "feddf", "coboosting",
            "cvae", "eval", "gpu")
KEY = re.compile(rf"^((?:{'|'.join(SECTIONS)})\.[a-z0-9.-]*[a-z0-9])(?:=.*)?$")
FILE_NAME = re.compile(r"\.(?:md|py|toml|json|jsonl|png|pt|sh)$")  # `dense.md`, `ot.py`: files, not keys
SOURCE = re.compile(r"^(?:oneshot_fl|strategies|launcher|server_app|client_app|benchmarks|experiments|scripts|tests|"
                    r"docs|deploy)/[\w./-]+\.(?:py|md|toml|sh)$")
# what a command writes: it may not be there yet
GENERATED = ("benchmarks/results/", "benchmarks/runs/", "deploy/work/", "deploy/secrets/", "deploy/state/")


def code_lines(text: str) -> list[str]:
    """Every line of code the text shows: fenced blocks (line continuations joined, comments dropped) and inline
    spans (a span wrapped over lines joined into one)."""
    lines = []
    for block in FENCE.findall(text):
        for line in block.replace("\\\n", " ").splitlines():
            lines.append(line.split("  #", 1)[0].strip())
    for span in SPAN.findall(FENCE.sub("", text)):
        lines.append(" ".join(span.split()))
    return [line for line in lines if line]


class Parsed(Exception):
    """Raised in place of running a command, once its parser has read the arguments."""

    def __init__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace):
        super().__init__("parsed")
        self.parser, self.namespace = parser, namespace


@pytest.fixture
def stop_after_parsing(monkeypatch):
    """argparse stops every command once its top-level parser has read the arguments (subparsers included)."""
    parse_args, parse_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    depth = {"n": 0, "in_parse_args": False}

    def patched_parse_args(self, args=None, namespace=None):
        depth["in_parse_args"] = True
        try:
            namespace = parse_args(self, args, namespace)
        finally:
            depth["in_parse_args"] = False
        raise Parsed(self, namespace)

    def patched_parse_known(self, args=None, namespace=None):
        depth["n"] += 1
        try:
            result = parse_known(self, args, namespace)
        finally:
            depth["n"] -= 1
        if depth["n"] == 0 and not depth["in_parse_args"]:
            raise Parsed(self, result[0])
        return result

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", patched_parse_args)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_known_args", patched_parse_known)


def entry_point(module: str):
    """The `main(argv)` a documented command runs, or None where the module has none that parses an argv with
    argparse (then only its existence is checked)."""
    if module == "oneshot-fl":
        module = "launcher.cli"
    elif module in ("oneshot-fl-deploy", "launcher.deploy"):
        module = "launcher.deploy.cli"
    spec = importlib.util.find_spec(module)
    source = Path(spec.origin).read_text() if spec and spec.origin and spec.origin.endswith(".py") else ""
    if "argparse" not in source or not re.search(r"def main\(argv", source):
        return None
    return importlib.import_module(module).main


def options_of(parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> set[str]:
    """The option strings of the parser and of the subcommand the namespace chose."""
    options = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                if name in vars(namespace).values():
                    options |= set(sub._option_string_actions)
    return options


def parse_problem(program: str, args: str) -> str | None:
    """None when `program args` (a documented command line) parses and its bracketed options exist, else why not.
    Placeholders: <...> is one word, [optional parts] are left out of the parse, A|B takes A."""
    args = re.sub(r"<[^>]*>", "X", args)
    optional = re.findall(r"\[([^\]]*)\]", args)
    required = re.sub(r"\[[^\]]*\]", " ", args).replace("...", " ")
    try:
        argv = shlex.split(required)
    except ValueError as exc:
        return f"cannot split: {exc}"
    main = entry_point(program)
    if main is None:
        return None if importlib.util.find_spec(program) else f"no module {program}"
    if len(argv) <= 1 and not optional:  # the program or a subcommand named in prose: its help must answer
        argv = [*argv, "--help"]
    try:
        code = main(argv)
    except Parsed as parsed:
        known = options_of(parsed.parser, parsed.namespace)
        unknown = sorted({flag for part in optional for flag in re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", part)}
                         - known)
        return f"unknown option(s) {unknown}" if unknown else None
    except SystemExit as exc:
        return None if exc.code == 0 and argv[-1:] == ["--help"] else f"argparse refused it (exit {exc.code})"
    return None if code == 0 else f"exit {code}"


def documented_commands() -> list[tuple[str, str, str]]:
    """(doc, program, arguments) of every command line the user docs show."""
    found = []
    for doc in user_docs():
        for line in code_lines(doc.read_text()):
            match = COMMAND.search(line)
            if not match or "<" in (match.group(1) or ""):  # python -m benchmarks.<command>: a pattern
                continue
            args = match.group(3).strip()
            positional = next((word for word in args.split() if not word.startswith("-")), "")
            if not positional.startswith("<"):  # `oneshot-fl --debug <subcommand> ...`: any subcommand
                found.append((str(doc.relative_to(ROOT)), match.group(1) or match.group(2), args))
    return found


def run_config_strings(args: str) -> list[str]:
    """The -c / --run-config values of a command line (TOML files as paths from the repository root)."""
    try:
        words = shlex.split(re.sub(r"\[[^\]]*\]", " ", args))
    except ValueError:
        return []
    values = [words[i + 1] for i, word in enumerate(words[:-1]) if word in ("-c", "--run-config")]
    return [str(ROOT / value) if value.endswith(".toml") else value for value in values]


def unknown_keys(strings: list[str]) -> list[str]:
    keys = set(default_run_config())
    return sorted({key for item in strings for key in parse_overrides([item]) if key not in keys})


def named_keys(text: str) -> list[str]:
    """Run-config keys named in backticks (`distill.pool`, `fedhydra.mode='paper'`); `distill.*` is a section."""
    return [match.group(1) for span in SPAN.findall(text) for match in [KEY.match(span.strip())]
            if match and not FILE_NAME.search(match.group(1))]


def named_sources(text: str) -> list[str]:
    return [span for span in SPAN.findall(text) if SOURCE.match(span) and not span.startswith(GENERATED)]


# --- the checks, each first shown to catch a planted drift -------------------------------------------------------

def test_a_planted_drift_is_caught_by_each_check(stop_after_parsing):
    assert parse_problem("benchmarks.not_a_command", "") == "no module benchmarks.not_a_command"
    assert parse_problem("oneshot-fl", "lst keys").startswith("argparse refused it")
    assert parse_problem("oneshot-fl", "list keys") is None
    assert parse_problem("benchmarks.cost_model", "--fleetz hetero").startswith("argparse refused it")
    assert parse_problem("oneshot-fl", "replay") is None  # a subcommand named in prose: it exists
    assert parse_problem("oneshot-fl", "rerun").startswith("argparse refused it")
    assert parse_problem("benchmarks.cost_model", "[--fleets hetero] [--json-out FILE]") is None
    assert parse_problem("benchmarks.cost_model", "[--fleet hetero]") == "unknown option(s) ['--fleet']"
    assert parse_problem("launcher.deploy", "run -c \"method='fedavg'\" [--force]") is None
    assert parse_problem("launcher.deploy", "up [--force]") == "unknown option(s) ['--force']"
    assert unknown_keys(["method='dense' distill.pol='paper'"]) == ["distill.pol"]
    assert named_keys("`distill.pool`, `gpu.bf16=false`, `distill.*`, `dense.md`, `ot.py`, `oneshot_fl.config`") == [
        "distill.pool", "gpu.bf16"]
    assert named_sources("`oneshot_fl/data/preview.py`, `benchmarks/results/mine.jsonl`, `runs/x.py`") == [
        "oneshot_fl/data/preview.py"]


def test_the_docs_show_commands_at_all():
    programs = {program for _, program, _ in documented_commands()}
    assert {"oneshot-fl", "launcher.deploy", "benchmarks.paper_table", "benchmarks.cost_model",
            "experiments.gpu_cells"} <= programs


def test_every_documented_command_parses(stop_after_parsing):
    problems = [f"{doc}: {program} {args}: {problem}" for doc, program, args in documented_commands()
                if (problem := parse_problem(program, args))]
    assert problems == []


def test_every_run_config_key_the_docs_name_exists():
    problems = []
    for doc in user_docs():
        text = doc.read_text()
        unknown = set(named_keys(text)) - set(default_run_config())
        unknown |= set(unknown_keys([s for line in code_lines(text) if COMMAND.search(line)
                                     for s in run_config_strings(COMMAND.search(line).group(3) or "")]))
        problems += [f"{doc.relative_to(ROOT)}: {key}" for key in sorted(unknown)]
    assert problems == []


def test_every_source_file_the_docs_name_exists():
    missing = [f"{doc.relative_to(ROOT)}: {path}" for doc in user_docs() for path in named_sources(doc.read_text())
               if not (ROOT / path).exists()]
    assert missing == []
