"""Mutation testing of chosen modules with mutmut 3, driven by the fast unit tests that cover them.

    pip install 'mutmut>=3.8,<4'
    python benchmarks/mutation.py                                   # the default target modules
    python benchmarks/mutation.py --modules oneshot_fl/engine/losses.py oneshot_fl/engine/distill.py
    python benchmarks/mutation.py --modules ... --rerun-survivors   # after adding tests: survivors only

The checkout (tracked and untracked-but-not-ignored files) is copied to a scratch folder
(--workdir, default /tmp/oneshot-fl-mutation, replaced on every run but --rerun-survivors), a
[tool.mutmut] section naming only the chosen modules and their unit-test files (TESTS below, or
--tests) is added to the copy's pyproject.toml, and `mutmut run` runs there with one worker
(--max-children 1) and a per-mutant CPU-time limit of 2 x --timeout-multiplier x (the covering
tests' clean time + --timeout-constant) seconds. Nothing is written into the checkout except
the report:
  benchmarks/results/mutation.json  {"module": {"killed": k, "survived": s, "total": t, ...}}
                                    merged with the modules already there (one module's rerun
                                    does not drop the others)
  benchmarks/results/mutation.md    the table, and the surviving mutants: those listed in
                                    EQUIVALENT below are marked as judged equivalent.
`killed` counts mutants a test failed on, timeouts included (a mutant that hangs the tests is
detected); `total` is every mutant generated in the module; `no_tests` are mutants in functions no
selected test calls.
Cost: one run of the covering tests per mutant (81 to 628 mutants per module in results/mutation.json), one
worker; the report keeps no wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# module -> the fast unit-test files that exercise it (no Flower processes, no data sets)
TESTS = {
    "oneshot_fl/engine/losses.py": ["tests/unit/test_losses.py", "tests/unit/test_engine.py",
                                    "tests/unit/test_decoder_engine.py", "tests/unit/test_fedhydra_strategy.py"],
    "oneshot_fl/engine/distill.py": ["tests/unit/test_distill.py", "tests/unit/test_engine.py",
                                     "tests/unit/test_coboosting.py", "tests/unit/test_feddf.py"],
    "oneshot_fl/engine/stratify.py": ["tests/unit/test_stratification.py", "tests/unit/test_engine.py",
                                      "tests/unit/test_fedhydra_robust.py"],
    "oneshot_fl/engine/teachers.py": ["tests/unit/test_engine.py", "tests/unit/test_stratification.py",
                                      "tests/unit/test_fedhydra_robust.py"],
    "oneshot_fl/uploads.py": ["tests/unit/test_uploads.py", "tests/unit/test_hostile_uploads.py",
                              "tests/unit/test_upload_fields.py"],
    "oneshot_fl/engine/trust.py": ["tests/unit/test_fedhydra_robust.py", "tests/unit/test_fedhydra_strategy.py",
                                   "tests/unit/test_expel_boundary.py"],
    "oneshot_fl/engine/synthesizer.py": ["tests/unit/test_synthesizer.py", "tests/unit/test_fedhydra_strategy.py"],
    "strategies/fedhydra.py": ["tests/unit/test_fedhydra_strategy.py", "tests/unit/test_fedhydra_robust.py",
                               "tests/unit/test_stratification.py", "tests/unit/test_engine.py"],
    "strategies/fedhydra_report.py": ["tests/unit/test_fedhydra_strategy.py", "tests/unit/test_fedhydra_robust.py",
                                      "tests/unit/test_fedhydra_report_actions.py"],
    "oneshot_fl/engine/hooks.py": ["tests/unit/test_losses.py", "tests/unit/test_bn_hooks.py",
                                   "tests/unit/test_engine.py"],
}
DEFAULT_MODULES = list(TESTS)

# Survivors judged equivalent (no test can tell them apart from the original), by mutmut's
# mutant name, with the reason. Reviewed by hand; see benchmarks/results/mutation.md.
_D = "oneshot_fl.engine.distill."
_CPU = ("the CPU is the only device in the unit tests (and the student's); moving to None/the default is a no-op "
        "there (not on a GPU machine)")
_LOAD = ("the checkpoints the unit tests write hold only tensors, dicts, lists, numbers and strings, which "
         "torch.load reads the same with weights_only True, False or the default (not checked for every "
         "synthesizer's state)")
EQUIVALENT: dict[str, str] = {
    _D + "xǁCheckpointǁload__mutmut_4": _CPU,  # map_location=None
    _D + "xǁCheckpointǁload__mutmut_7": _CPU,  # no map_location
    _D + "xǁCheckpointǁload__mutmut_5": _LOAD,  # weights_only=None
    _D + "xǁCheckpointǁload__mutmut_8": _LOAD,  # weights_only left out
    _D + "xǁCheckpointǁload__mutmut_11": _LOAD,  # weights_only=True
    _D + "x_distill__mutmut_3": _CPU,  # device = None
    _D + "x_distill__mutmut_85": _CPU,  # images.to(None)
    _D + "x_distill__mutmut_86": _CPU,  # teacher_logits.to(None)
    _D + "x_distill__mutmut_111": "zero_grad(set_to_none=None/False): every student parameter gets a gradient "
                                  "each step, so zeroed and unset gradients give the same update",
    _D + "x_distill__mutmut_112": "as x_distill__mutmut_111 (set_to_none=False)",
    _D + "x_distill__mutmut_149": "stop = None instead of False: both falsy, only tested for truth",
}
_F = "strategies.fedhydra."
_FR = "strategies.fedhydra_report."
_F64 = "astype(None) is numpy's default dtype, float64: the same array"
EQUIVALENT.update({
    _FR + "x_owners_per_class__mutmut_3": _F64,
    _FR + "x_tracking__mutmut_2": _F64,
    _F + "xǁFedHydraǁgenerator_loss__mutmut_6": "ce=1.0 left out: GeneratorLoss's ce defaults to 1.0",
    _FR + "x_tracking__mutmut_29": "np.mean of no defined correlation is nan too (with a RuntimeWarning)",
    _FR + "x_tracking__mutmut_34": "float('NAN') is float('nan'): Python reads the name case-insensitively",
})
_U = "oneshot_fl.uploads."
_FLOATS = ("every architecture has float tensors of non-zero size (an upload's shapes must equal its "
           "architecture's), so the empty-tensor branch is never taken")
_NO_PICKLE = "object dtypes are refused from the .npy header first, so np.load never consults allow_pickle"
_INT64 = "the counts are Python ints checked to lie in [0, int64 max]: numpy makes them int64 on 64-bit platforms"
EQUIVALENT.update({
    _U + "x__check_values__mutmut_8": _FLOATS, _U + "x__check_values__mutmut_10": _FLOATS,
    _U + "x_encode__mutmut_17": _FLOATS, _U + "x_encode__mutmut_19": _FLOATS, _U + "x_encode__mutmut_20": _FLOATS,
    _U + "x__packed_vectors__mutmut_25": "break instead of continue: only the last pass (buffers) can take it, "
                                         "as no architecture lacks float tensors",
    _U + "x__packed_vectors__mutmut_20": "the dtype of an empty vector no tensor is sliced from is never read",
    _U + "x__packed_vectors__mutmut_22": "as x__packed_vectors__mutmut_20",
    _U + "x__npy__mutmut_36": _NO_PICKLE, _U + "x__npy__mutmut_38": _NO_PICKLE, _U + "x__npy__mutmut_40": _NO_PICKLE,
    _U + "x__label_counts__mutmut_34": "no numpy dtype kind is 'X': the same membership test",
    _U + "x__label_counts__mutmut_67": _INT64, _U + "x__label_counts__mutmut_69": _INT64,
})
_T = "oneshot_fl.engine.teachers."
_S = "oneshot_fl.engine.stratify."
_EINSUM = "einsum subscripts upper-cased: the same contraction"
_META = ("the stacked group's / vmapped MS's base module only gives the structure for functional_call, which "
         "replaces every parameter and buffer: which model it is copied from (same architecture) and whether it "
         "is moved to 'meta' (memory only) do not change a result")
_GRAD = "zero_grad(set_to_none=None/False): every generator parameter gets a gradient each step"
EQUIVALENT.update({
    _T + "xǁ_LoopGroupǁto__mutmut_2": _CPU, _T + "xǁ_StackedGroupǁto__mutmut_2": _CPU,
    _T + "xǁ_StackedGroupǁto__mutmut_4": _CPU, _T + "xǁClientEnsembleǁto__mutmut_2": _CPU,
    _T + "xǁClientEnsembleǁto__mutmut_4": _CPU, _T + "xǁWeightedLogitsǁ__call____mutmut_2": _CPU,
    _T + "xǁStratifiedAggregationǁ__call____mutmut_2": _CPU, _T + "xǁStratifiedAggregationǁ__call____mutmut_3": _CPU,
    _T + "xǁStratifiedAggregationǁ__call____mutmut_18": _CPU,
    _T + "xǁWeightedLogitsǁ__call____mutmut_11": _EINSUM, _T + "xǁStratifiedAggregationǁ__call____mutmut_31": _EINSUM,
    _T + "xǁStratifiedAggregationǁ__call____mutmut_55": _EINSUM,
    _T + "xǁ_StackedGroupǁ__init____mutmut_2": _META, _T + "xǁ_StackedGroupǁ__init____mutmut_6": _META,
    _T + "xǁ_StackedGroupǁ__call____mutmut_28": "hook.loss = '' instead of None: both only drop the vmapped "
                                                 "intermediate; the next call overwrites it before any read",
    _S + "x_stratify__mutmut_1": "clients_per_call default 1 instead of 0 (all): the same runs in more calls; "
                                 "the chunked test pins that chunks equal one call",
    _S + "x_stratify__mutmut_30": _CPU, _S + "x_stratify__mutmut_51": _CPU, _S + "x_stratify__mutmut_53": _CPU,
    _S + "x_stratify__mutmut_38": _META, _S + "x_stratify__mutmut_42": _META,
    _S + "x_stratify__mutmut_142": "stop_loss >= 0 instead of > 0: with stop_loss 0 the CE (>= 0) is never < 0",
    _S + "x_stratify__mutmut_153": _GRAD, _S + "x_stratify__mutmut_154": _GRAD,
})

_G = "oneshot_fl.engine.synthesizer."
EQUIVALENT.update({
    _G + "xǁGeneratorSynthesizerǁ__init____mutmut_13": _CPU, _G + "xǁGeneratorSynthesizerǁsynthesize__mutmut_8": _CPU,
    _G + "xǁGeneratorSynthesizerǁsynthesize__mutmut_16": _CPU,
    _G + "xǁGeneratorSynthesizerǁ_ce__mutmut_10": "hardness >= 0 instead of > 0: (1 - p_y) ** 0 = 1 weights nothing",
    _G + "xǁGeneratorSynthesizerǁsynthesize__mutmut_30": "float('INF') is float('inf'): read case-insensitively",
    _G + "xǁGeneratorSynthesizerǁsynthesize__mutmut_90": _GRAD,
    _G + "xǁGeneratorSynthesizerǁsynthesize__mutmut_91": _GRAD,
})

_H = "oneshot_fl.engine.hooks."
_NORM = "torch.norm's default p is the 2-norm for a vector (the channel means and variances are vectors)"
EQUIVALENT.update({
    _H + "xǁBNStatsHookǁ__init____mutmut_1": "nothing reads a hook's `module` (the hook is handed its module)",
    _H + "xǁBNStatsHookǁ_hook__mutmut_25": _NORM, _H + "xǁBNStatsHookǁ_hook__mutmut_27": _NORM,
    _H + "xǁBNStatsHookǁ_hook__mutmut_31": _NORM, _H + "xǁBNStatsHookǁ_hook__mutmut_33": _NORM,
})

KILLED = {"killed", "timeout", "caught by type check", "segfault"}


def mutmut_status(code):
    from mutmut.stats import status_by_exit_code

    return status_by_exit_code[code]


def copy_checkout(dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def configure(work: Path, modules: list[str], tests: list[str], timeout_multiplier: float,
              timeout_constant: float) -> None:
    def toml_list(items):
        return "[" + ", ".join(json.dumps(i) for i in items) + "]"

    packages = sorted({m.split("/")[0] for m in modules})
    other = [p for p in ("oneshot_fl", "strategies", "client_app", "server_app", "benchmarks")
             if p not in packages and (work / p).exists()]
    section = f"""

[tool.mutmut]
source_paths = {toml_list(packages)}
only_mutate = {toml_list(modules)}
also_copy = {toml_list(other)}
pytest_add_cli_args = ["-p", "no:cacheprovider", "-p", "no:randomly", "-q", "-o", "addopts="]
pytest_add_cli_args_test_selection = {toml_list(tests)}
timeout_multiplier = {timeout_multiplier}
timeout_constant = {timeout_constant}
process_isolation = "forkserver"
use_git_change_detection = false
"""
    pyproject = work / "pyproject.toml"
    pyproject.write_text(pyproject.read_text() + section)


def collect(work: Path, modules: list[str]) -> tuple[dict, dict[str, list[str]]]:
    summary, survivors = {}, {}
    for module in modules:
        meta = work / "mutants" / (module + ".meta")
        codes = json.loads(meta.read_text())["exit_code_by_key"] if meta.is_file() else {}
        statuses = {name: mutmut_status(code) for name, code in codes.items()}
        counts = Counter(statuses.values())
        killed = sum(n for status, n in counts.items() if status in KILLED)
        summary[module] = {"killed": killed, "survived": counts.get("survived", 0), "total": len(statuses),
                           "no_tests": counts.get("no tests", 0),
                           "other": {s: n for s, n in counts.items() if s not in KILLED | {"survived", "no tests"}}}
        survivors[module] = sorted(n for n, s in statuses.items() if s in ("survived", "no tests"))
    return summary, survivors


def diff(work: Path, name: str, env: dict) -> str:
    out = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=work, env=env, capture_output=True,
                         text=True).stdout
    lines = [ln for ln in out.splitlines() if ln.startswith(("+", "-")) and not ln.startswith(("+++", "---"))]
    return " / ".join(ln.strip() for ln in lines)[:240]


def write_report(summary: dict, survivors: dict[str, list[str]], diffs: dict[str, str], args) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    json_path = RESULTS / "mutation.json"
    merged = json.loads(json_path.read_text()) if json_path.is_file() else {}
    for module in summary:  # each module keeps its own last run's survivors, listed below for every module
        summary[module]["survivors"] = [{"mutant": name, "diff": diffs.get(name, "")}
                                        for name in survivors.get(module, [])]
    merged.update(summary)
    json_path.write_text(json.dumps(merged, indent=2, sort_keys=True) + "\n")
    lines = ["# Mutation testing", "",
             f"mutmut 3, `python benchmarks/mutation.py --modules ...`; last run "
             f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} on {', '.join(args.modules)}.", "",
             "| module | killed | survived | no tests | total | killed % |", "|---|---|---|---|---|---|"]
    for module, s in sorted(merged.items()):
        pct = 100.0 * s["killed"] / s["total"] if s["total"] else 0.0
        lines.append(f"| `{module}` | {s['killed']} | {s['survived']} | {s.get('no_tests', 0)} | {s['total']} "
                     f"| {pct:.1f} |")
    not_run = [m for m in DEFAULT_MODULES if m not in merged]
    if not_run:
        lines += ["", f"Not run yet: {', '.join(f'`{m}`' for m in not_run)}."]
    lines += ["", "## Survivors (each module's last run; mutants in functions no selected test calls included)", ""]
    for module, s in sorted(merged.items()):
        listed = s.get("survivors", [])
        equivalent = sum(1 for entry in listed if entry["mutant"] in EQUIVALENT)
        lines += [f"### `{module}`: {len(listed)} ({equivalent} judged equivalent)", ""]
        for entry in listed:
            name = entry["mutant"]
            verdict = f"equivalent: {EQUIVALENT[name]}" if name in EQUIVALENT else "NOT judged equivalent"
            lines.append(f"- `{name}` ({verdict}): `{entry['diff']}`")
        lines.append("")
    (RESULTS / "mutation.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modules", nargs="+", default=DEFAULT_MODULES, help="files to mutate, repo-relative")
    parser.add_argument("--tests", nargs="*", default=None,
                        help="test files to run (default: the union of TESTS for the modules)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/oneshot-fl-mutation"))
    parser.add_argument("--rerun-survivors", action="store_true",
                        help="keep the last run's results in --workdir; refresh its tests from the checkout and "
                             "rerun only the mutants that survived (after adding tests for them)")
    parser.add_argument("--max-children", type=int, default=1, help="parallel mutant workers (default 1)")
    parser.add_argument("--timeout-multiplier", type=float, default=3.0,
                        help="per-mutant CPU-time limit: 2 x multiplier x (the covering tests' clean time + constant)")
    parser.add_argument("--timeout-constant", type=float, default=10.0,
                        help="seconds added to the tests' time before multiplying (a worker re-runs pytest's "
                             "collection: a few CPU seconds even for a 0.05 s test)")
    args = parser.parse_args(argv)
    unknown = [m for m in args.modules if not (ROOT / m).is_file()]
    if unknown:
        parser.error(f"no such module(s): {unknown}")
    tests = args.tests or sorted({t for m in args.modules for t in TESTS.get(m, []) if (ROOT / t).is_file()})
    if not tests:
        parser.error("no test files for these modules: pass --tests")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": ""}
    names: list[str] = []
    if args.rerun_survivors:
        if not (args.workdir / "mutants").is_dir():
            parser.error(f"--rerun-survivors: no previous run in {args.workdir}")
        names = [n for ns in collect(args.workdir, args.modules)[1].values() for n in ns]
        for dest in (args.workdir / "tests", args.workdir / "mutants" / "tests"):
            shutil.rmtree(dest, ignore_errors=True)
            shutil.copytree(ROOT / "tests", dest, ignore=shutil.ignore_patterns("__pycache__"))
        (args.workdir / "mutants" / "mutmut-stats.json").unlink(missing_ok=True)  # map the new tests too
        print(f"rerunning {len(names)} survivors with the checkout's current tests", flush=True)
    else:
        copy_checkout(args.workdir)
        configure(args.workdir, args.modules, tests, args.timeout_multiplier, args.timeout_constant)
        print(f"mutating {args.modules} with {tests} in {args.workdir}", flush=True)
    run = subprocess.run([sys.executable, "-m", "mutmut", "run", "--max-children", str(args.max_children), *names],
                         cwd=args.workdir, env=env)
    summary, survivors = collect(args.workdir, args.modules)
    if not any(s["total"] for s in summary.values()):
        print(f"mutmut produced no results (exit {run.returncode})", file=sys.stderr)
        return 1
    diffs = {name: diff(args.workdir, name, env) for names in survivors.values() for name in names}
    write_report(summary, survivors, diffs, args)
    for module, s in summary.items():
        print(f"{module}: killed {s['killed']} survived {s['survived']} no-tests {s['no_tests']} total {s['total']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
