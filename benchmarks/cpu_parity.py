"""The same CPU run before and after a change to the training code: client weights and server results to the bit.

  python -m benchmarks.cpu_parity run --work DIR/before      # at the old commit
  python -m benchmarks.cpu_parity run --work DIR/after       # at the new one
  python -m benchmarks.cpu_parity compare DIR/before DIR/after --out benchmarks/results/cpu_parity.md

`run` trains a small CIFAR-10 fleet through the ClientApp's own training function (BatchNorm clients of two
architectures, NIID-Bench 0.5, seed 0, the smoke preset with 2 local epochs) and replays DENSE and FedHydra on
its archive. `compare` puts the second run's clients beside the first's (every tensor of every upload, and the
training metrics) and replays the FIRST run's archive results of both legs beside each other: the server
methods of both legs then read the same uploads, so a server-side difference cannot hide behind a client-side one.
Exits 1 if anything differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

FLEET = {"dataset": "cifar10", "partition": "niid-bench", "alpha": 0.5, "seed": 0, "num-clients": 3,
         "client-models": "cnn3-bn,cnn3-bn,lenet", "server-model": "cnn3-bn", "preset": "smoke", "local.epochs": 2,
         "threads": 1, "server-threads": 1, "save-uploads": False}
METHODS = ("dense", "fedhydra")
TIMING = ("synthesis_s", "kd_s")  # wall seconds in the history: reported by compare_runs, never compared


def run(work: Path, archive: Path | None = None) -> None:
    """Train the fleet into `work`/uploads (unless there already) and replay each method on `archive` (default:
    that fleet) into `work`/runs/<method>[-on-<archive leg>]."""
    from benchmarks.inprocess_fleet import cached_uploads
    from oneshot_fl.config import from_run_config, merge_overrides
    from oneshot_fl.devices import set_threads
    from launcher.launch import run_config_items
    from oneshot_fl.logs import setup_logging
    from launcher.replay import replay

    setup_logging()
    set_threads(1)
    work = Path(work).resolve()
    cfg = from_run_config(merge_overrides(FLEET))
    archs = FLEET["client-models"].split(",")
    cached_uploads(work / "uploads", cfg, [(p, "classifier", archs[p]) for p in range(len(archs))])
    source = Path(archive).resolve() if archive else work / "uploads"
    suffix = "" if archive is None else f"-on-{source.parent.name}"
    for method in METHODS:
        run_dir = work / "runs" / f"{method}{suffix}"
        if not (run_dir / "result.json").is_file():
            replay(source, run_config_items({"method": method, "threads": 1, "server-threads": 1}), run_dir=run_dir)


def _upload_lines(a: Path, b: Path) -> tuple[list[str], bool]:
    from oneshot_fl.archive import load_uploads

    same = True
    lines = ["| client | tensors | max abs difference | training metrics equal |", "|---|---|---|---|"]
    ua, ub = (load_uploads(p / "uploads", 10, (3, 32, 32), ("classifier",)) for p in (a, b))
    for x, y in zip(ua, ub):
        diff = max(float((x.state[k].double() - y.state[k].double()).abs().max()) if x.state[k].numel() else 0.0
                   for k in x.state) if x.state.keys() == y.state.keys() else float("inf")
        metrics = {k: v for k, v in x.metrics.items() if k != "train-seconds"} == \
            {k: v for k, v in y.metrics.items() if k != "train-seconds"}
        same &= diff == 0.0 and metrics and len(ua) == len(ub)
        lines.append(f"| p{x.partition_id} {x.arch} | {len(x.state)} | {diff:g} | {metrics} |")
    return lines, same


def _history(result: dict) -> list[dict]:
    return [{k: v for k, v in h.items() if k not in TIMING} for h in result.get("history", [])]


def compare(a: Path, b: Path) -> tuple[list[str], bool]:
    from benchmarks.compare_runs import compare as compare_runs

    lines, same = _upload_lines(a, b)
    lines.append("")
    for method in METHODS:
        ra, rb = a / "runs" / method, b / "runs" / f"{method}-on-{a.name}"
        if not (rb / "result.json").is_file():
            rb = b / "runs" / method
        lines.append(f"### {method}: {ra.relative_to(a.parent)} and {rb.relative_to(b.parent)} (same uploads)")
        lines.append("")
        table, equal = compare_runs(ra, rb)
        histories = [_history(json.loads((r / "result.json").read_text())) for r in (ra, rb)]
        equal &= histories[0] == histories[1]
        lines += table + [f"| every distillation epoch's losses and accuracy (history, {len(histories[0])} "
                          f"epochs) | | | {'equal' if histories[0] == histories[1] else 'differ'} |", ""]
        same &= equal
    return lines, same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run")
    p_run.add_argument("--work", type=Path, required=True)
    p_run.add_argument("--archive", type=Path, help="replay this uploads archive too (e.g. the earlier leg's)")
    p_cmp = sub.add_parser("compare")
    p_cmp.add_argument("a", type=Path)
    p_cmp.add_argument("b", type=Path)
    p_cmp.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "run":
        run(args.work)
        if args.archive:
            run(args.work, args.archive)
        return 0
    lines, same = compare(args.a, args.b)
    from benchmarks.records import code_version, machine

    codes = [json.loads((p / "runs" / "dense" / "result.json").read_text())["provenance"]["git"] for p in (args.a,
                                                                                                         args.b)]
    text = "\n".join(["# CPU parity: the same fleet and replays before and after a change", "",
                      f"`python -m benchmarks.cpu_parity compare {args.a.name} {args.b.name}`; legs run by "
                      f"`python -m benchmarks.cpu_parity run` at {codes[0].get('commit', '?')[:7]} and "
                      f"{codes[1].get('commit', '?')[:7]} (compared at {code_version()}), one torch thread each, on "
                      f"{json.dumps({k: v for k, v in machine().items() if k != 'torch_threads'}, sort_keys=True)}. "
                      f"Fleet: {json.dumps(FLEET, sort_keys=True)}. The seconds are reported, never compared: the "
                      "legs ran at different times on a machine shared with other jobs.", "",
                      *lines, "Identical." if same else "They differ."]) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
