"""`oneshot-fl` command line.

  oneshot-fl run    [-c "k=v ..."] [--num-supernodes N] [--cpus-per-client X]   simulation via flwr run
  oneshot-fl replay UPLOADS_DIR -c "method='dense' ..."                          a server method on saved uploads
  oneshot-fl partition -c "dataset='mnist' alpha=0.1 ..." [--out DIR]            preview a partition
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from oneshot_fl.config import ConfigError


def _summary(result: dict) -> str:
    g = result["global"]
    lines = [f"{result['method']} on {result['dataset']} ({result['partition']} alpha={result['alpha']}, "
             f"{result['num_clients']} clients, seed {result['seed']}, preset {result['preset']})",
             f"  global accuracy {g['accuracy']:.4f} (best epoch {g.get('accuracy_best', g['accuracy']):.4f})"]
    if g.get("ensemble_accuracy") is not None:
        lines.append(f"  teacher ensemble accuracy {g['ensemble_accuracy']:.4f}")
    locs = [c["local_accuracy"] for c in result["clients"] if c["local_accuracy"] is not None]
    if locs:
        lines.append(f"  client accuracies {', '.join(f'{a:.3f}' for a in locs)}")
    t = result["timings"]
    lines.append(f"  time: local max {t['local_max']:.1f}s, server {t['server_fuse']:.1f}s")
    per_role = result["upload_bytes"].get("per_role") or {}
    for role, sizes in per_role.items():
        lines.append(f"  upload ({role}, {sizes['clients']} clients): {max(sizes['received_bytes'])} bytes at most, "
                     f"{sizes['max_ratio_to_raw_plus_counts']:.4f}x raw parameter + label-count bytes at most")
    return "\n".join(lines)


def cmd_run(args) -> int:
    from oneshot_fl.launch import parse_overrides, run_simulation

    run = run_simulation(parse_overrides(args.run_config), num_supernodes=args.num_supernodes,
                         cpus_per_client=args.cpus_per_client, gpus_per_client=args.gpus_per_client,
                         timeout=args.timeout, stream=not args.quiet)
    if not run.ok:
        print(f"[oneshot-fl] run {run.run_id} ended with status {run.status}: {run.status_details}", file=sys.stderr)
        if args.quiet:
            print(run.log_text[-5000:], file=sys.stderr)
        return 1
    print(f"[oneshot-fl] run {run.run_id} completed in {run.seconds:.0f}s; results in {run.run_dir}")
    print(_summary(run.result()))
    return 0


def cmd_replay(args) -> int:
    from oneshot_fl.replay import expected_failure, replay

    try:
        result = replay(Path(args.uploads), args.run_config, run_dir=Path(args.out) if args.out else None)
    except Exception as exc:
        line = expected_failure(exc)
        if line is None or args.debug:
            raise
        print(f"oneshot-fl replay: {line}", file=sys.stderr)
        return 1
    print(_summary(result))
    return 0


def cmd_partition(args) -> int:
    from oneshot_fl.data.preview import preview_partition

    print(preview_partition(args.run_config, Path(args.out)))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oneshot-fl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the app in Flower's simulation engine (checks the run's status)")
    run.add_argument("-c", "--run-config", action="append", default=[],
                     help="run-config overrides, as for flwr run: \"k=v k2='s'\" or a TOML file; repeatable")
    run.add_argument("--num-supernodes", type=int, default=None, help="default: num-clients")
    run.add_argument("--cpus-per-client", type=float, default=1.0,
                     help="Ray CPU share per ClientApp (concurrent clients = cores / this)")
    run.add_argument("--gpus-per-client", type=float, default=0.0)
    run.add_argument("--timeout", type=float, default=None, help="stop the run after this many seconds")
    run.add_argument("--quiet", action="store_true", help="do not stream the run's log")
    run.set_defaults(func=cmd_run)
    rep = sub.add_parser("replay", help="run a server method on an uploads archive (no client training)")
    rep.add_argument("uploads", help="an uploads folder (<run folder>/uploads)")
    rep.add_argument("-c", "--run-config", action="append", default=[],
                     help="overrides on top of the archived run's config, e.g. \"method='dense'\"")
    rep.add_argument("--out", default=None, help="run folder to write (default: a new one)")
    rep.add_argument("--debug", action="store_true", help="show the traceback of expected failures too")
    rep.set_defaults(func=cmd_replay)
    part = sub.add_parser("partition", help="compute a partition and write its label table and plot")
    part.add_argument("-c", "--run-config", action="append", default=[])
    part.add_argument("--out", default="partition-preview")
    part.set_defaults(func=cmd_partition)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError) as exc:
        print(f"oneshot-fl: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
