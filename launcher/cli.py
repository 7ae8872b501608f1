"""`oneshot-fl` command line.

  oneshot-fl run    [-c "k=v ..."] [--num-supernodes N] [--cpus-per-client X]   simulation via flwr run
  oneshot-fl replay UPLOADS_DIR -c "method='dense' ..."                          a server method on saved uploads
  oneshot-fl partition -c "dataset='mnist' alpha=0.1 ..." [--out DIR] [--force]  preview a partition
  oneshot-fl list keys|methods|presets|datasets|models|partitions                what the run config accepts
  oneshot-fl stop-superlink                                                      stop a plain `flwr run`'s SuperLink

String values in -c need quotes, as for flwr run: -c "method='dense' alpha=0.1".
Expected errors (bad config, failed run, missing data) end in one line, "oneshot-fl: error: ...",
and exit 1 (every subcommand), Ctrl-C in
exit 130, SIGTERM in exit 143 once the processes the command started are stopped, output piped into a reader
that stops early (`| head`) in a quiet exit 141, as SIGPIPE ends a Unix tool; --debug shows
the traceback. A subcommand imports the heavy parts it runs (anything that imports torch: replay, the
partition preview, the method and model registries) when it runs, so `list presets`, `--version` and
argument or config errors answer in about a second.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from importlib import metadata
from pathlib import Path

from oneshot_fl.config import PARTITIONS, default_run_config, run_config_key_lines
from oneshot_fl.errors import EXPECTED_ERRORS, ConfigError, error_line
from oneshot_fl.presets import PRESETS, preset_lines
from oneshot_fl.provenance import package_versions
from launcher.control_api import for_display
from launcher.launch import parse_overrides, run_simulation, stop_local_superlink
from launcher.shutdown import Terminated, quiet_when_output_closes, sigterm_unwinds, stdout_closed


def _summary(result: dict) -> str:
    g = result["global"]
    lines = [f"{result['method']} on {result['dataset']} ({result['partition']} alpha={result['alpha']}, "
             f"{result['num_clients']} clients, seed {result['seed']}, preset {result['preset']})",
             f"  global accuracy {g['accuracy']:.4f} (the final model)"]
    if g.get("ensemble_accuracy") is not None:  # the teacher the student distilled from, without labels
        lines.append(f"  teacher accuracy {g['ensemble_accuracy']:.4f} (the ensemble the student distilled from)")
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
    run = run_simulation(parse_overrides(args.run_config), num_supernodes=args.num_supernodes,
                         cpus_per_client=args.cpus_per_client, gpus_per_client=args.gpus_per_client,
                         timeout=args.timeout, stream=not args.quiet, force=args.force)
    if not run.ok:
        print(f"[oneshot-fl] run {run.run_id} ended with status {run.status}: {run.status_details}", file=sys.stderr)
        if args.quiet:  # the log's end, without colour codes unless stderr is a terminal
            print(for_display(run.log_text[-5000:], sys.stderr), file=sys.stderr)
        return 1
    print(f"[oneshot-fl] run {run.run_id} completed in {run.seconds:.0f}s; results in {run.run_dir}")
    print(_summary(run.result()))
    return 0


def cmd_replay(args) -> int:
    from launcher.replay import replay  # torch: see the module docstring

    # a failure is run_command's to report, as for every subcommand: "oneshot-fl: error: ..." (expected) or
    # "oneshot-fl: unexpected error: ..." (anything else), exit 1
    result = replay(Path(args.uploads), args.run_config, run_dir=Path(args.out) if args.out else None)
    print(_summary(result))
    return 0


def cmd_partition(args) -> int:
    from launcher.preview import preview_partition  # torch: see the module docstring

    print(preview_partition(args.run_config, Path(args.out), force=args.force))
    return 0


def cmd_stop_superlink(args) -> int:
    home = Path(args.flwr_home or os.environ.get("FLWR_HOME") or Path.home() / ".flwr").expanduser().resolve()
    pids = stop_local_superlink(home)
    if not pids:
        print(f"no local SuperLink of FLWR_HOME={home} is running")
        return 0
    print(f"stopped the local SuperLink of FLWR_HOME={home} (pid {', '.join(map(str, pids))}) and the processes "
          "it started")
    return 0


def cmd_list(args) -> int:
    if args.what == "presets":  # per preset: its description, then every key it sets with its value
        lines = [line for name in PRESETS for line in preset_lines(name, default=default_run_config()["preset"])]
    elif args.what == "keys":  # key = default  # help, from pyproject.toml's [tool.flwr.app.config]
        lines = run_config_key_lines()
    else:
        lines = list_lines(args.what)
    for line in lines:
        print(line)
    return 0


def list_lines(what: str) -> list[str]:
    """One line per entry of a registry: methods, datasets, models, partitions (presets: presets.preset_lines)."""
    # the registries import torch (see the module docstring): each list imports only its own
    if what == "methods":
        from strategies import STRATEGIES
        from strategies.papers import METHOD_PAPERS

        width = max(map(len, STRATEGIES))
        return [f"{name:<{width}}  {METHOD_PAPERS.get(name, ('', ''))[0]}  [uploads: {', '.join(cls.roles)}]"
                for name, cls in STRATEGIES.items()]
    if what == "datasets":
        from oneshot_fl.data.datasets import DATASETS

        return [f"{name:<8} {info.num_classes} classes, {info.channels}x{info.image_size}x{info.image_size}, "
                f"default model {info.default_model}" for name, info in DATASETS.items()]
    if what == "models":
        from oneshot_fl.models.cvae import CVAE_ARCHITECTURES
        from oneshot_fl.models.registry import ARCHITECTURES

        return [f"{name:<11} classifier" for name in ARCHITECTURES] + \
               [f"{name:<11} CVAE (cvae.arch)" for name in CVAE_ARCHITECTURES]
    if what == "partitions":
        return list(PARTITIONS)
    raise ConfigError(f"nothing to list called {what!r}; choose one of: {', '.join(LISTABLE)}")


LISTABLE = ("keys", "methods", "presets", "datasets", "models", "partitions")

RUN_EPILOG = """\
run config: -c "key=value ..." (TOML values: strings quoted, e.g. -c "method='dense' alpha=0.1"); every key
  with its default and meaning: oneshot-fl list keys. preset='smoke'|'cpu'|'paper' sets the sizes (default
  cpu; oneshot-fl list presets).
results: the run folder <output-dir>/<run-name> (output-dir "" = $ONESHOT_FL_OUTPUT_DIR, else ./runs;
  run-name "" = <method>-<dataset>-<partition>-k<clients>-s<seed>-<time>): result.json, global_model.pt,
  run.log, plots, and uploads/ (the clients' models: oneshot-fl replay runs another server method on them).
  A finished folder is never overwritten; a folder in use by another run is refused.
resume: Ctrl-C (or SIGTERM) leaves an unfinished run folder; the same command again continues it (its
  archived uploads are reused, no client trains again; its checkpoints resume). With run-name, another
  config in that folder is refused, naming the difference; --force starts it over (its files, checkpoints
  included, go).
"""


def version_line() -> str:
    try:
        own = metadata.version("oneshot-fl")
    except metadata.PackageNotFoundError:
        own = "unknown"
    libs = ", ".join(f"{k} {v}" for k, v in package_versions(("flwr", "torch")).items())
    return f"oneshot-fl {own} ({libs}, Python {sys.version.split()[0]})"


def expected_errors() -> tuple[type[BaseException], ...]:
    """Errors a user can cause and fix: one line, no traceback (oneshot_fl.errors)."""
    return EXPECTED_ERRORS


def bounded(lo: float, typ: type = float, *, inclusive: bool = True, hi: float | None = None):
    """argparse type: a finite number (typ=int: an integer) >= lo (> lo with inclusive=False) and <= hi.
    nan passes every comparison, so it is refused by name."""
    what = "an integer" if typ is int else "a finite number"
    bound = f"{'>=' if inclusive else '>'} {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")

    def parse(text: str):
        try:
            value = typ(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what} {bound}") from None
        if (not math.isfinite(value) or (value < lo if inclusive else value <= lo)
                or (hi is not None and value > hi)):
            raise argparse.ArgumentTypeError(f"{text!r}: expected {what} {bound}")
        return value
    return parse


def run_command(func, args) -> int:
    """Run a subcommand: expected errors -> one line, exit 1; Ctrl-C -> exit 130; SIGTERM -> exit 143,
    after the processes the command started are stopped; anything else -> one line naming --debug,
    exit 1. With --debug every error shows its traceback."""
    debug = getattr(args, "debug", False)
    try:
        with sigterm_unwinds():
            return func(args)
    except Terminated:
        print("oneshot-fl: terminated (SIGTERM); the processes it started were stopped", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("oneshot-fl: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if isinstance(exc, BrokenPipeError) and stdout_closed():
            raise  # the reader of the output has gone: main ends quietly (quiet_when_output_closes)
        if debug:
            traceback.print_exc()
        if isinstance(exc, expected_errors()):
            print(f"oneshot-fl: error: {error_line(exc)}", file=sys.stderr)
        else:
            print(f"oneshot-fl: unexpected error: {type(exc).__name__}: {error_line(exc)} "
                  "(--debug shows the traceback)", file=sys.stderr)
        return 1


@quiet_when_output_closes
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="oneshot-fl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version="%(prog)s", help="show versions and exit")
    parser.add_argument("--debug", action="store_true", help="show the Python traceback of an error")
    common = argparse.ArgumentParser(add_help=False)  # --debug is accepted after the subcommand too
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", parents=[common], epilog=RUN_EPILOG,
                         formatter_class=argparse.RawDescriptionHelpFormatter,
                         help="run the app in Flower's simulation engine (checks the run's status)")
    run.add_argument("-c", "--run-config", action="append", default=[],
                     help="run-config overrides, as for flwr run: \"k=v k2='s'\" or a TOML file; repeatable")
    run.add_argument("--num-supernodes", type=bounded(1, int), default=None, help="default: num-clients")
    run.add_argument("--cpus-per-client", type=bounded(0.0, inclusive=False), default=1.0,
                     help="Ray CPU share per ClientApp (concurrent clients = cores / this)")
    run.add_argument("--gpus-per-client", type=bounded(0.0), default=None,
                     help="Ray GPU share per ClientApp (0: clients on the CPU); default: where torch sees GPUs, "
                          "the share that puts every concurrent client on them (e.g. 0.2 for 5 clients, 1 GPU)")
    run.add_argument("--timeout", type=bounded(0.0, inclusive=False), default=None,
                     help="stop the run after this many seconds")
    run.add_argument("--quiet", action="store_true", help="do not stream the run's log")
    run.add_argument("--force", action="store_true",
                     help="start over: with run-name, the unfinished run in that folder is removed first (its "
                          "checkpoint among its files), whatever its config; without, a new folder is used instead "
                          "of continuing one. A finished folder stays refused")
    run.set_defaults(func=cmd_run)
    rep = sub.add_parser("replay", parents=[common],
                         help="run a server method on an uploads archive (no client training)")
    rep.add_argument("uploads", help="an uploads folder (<run folder>/uploads)")
    rep.add_argument("-c", "--run-config", action="append", default=[],
                     help="overrides on top of the archived run's config, e.g. \"method='dense'\"")
    rep.add_argument("--out", default=None, help="run folder to write (default: a new one)")
    rep.set_defaults(func=cmd_replay)
    part = sub.add_parser("partition", parents=[common], help="compute a partition and write its label table and plot")
    part.add_argument("-c", "--run-config", action="append", default=[],
                      help="the run config whose partition to compute, as for run: \"dataset='mnist' "
                           "partition='niid-bench' alpha=0.1 num-clients=10 seed=1\" (the keys that shape it: "
                           "dataset, partition, alpha, num-clients, min-partition-size, seed); repeatable")
    part.add_argument("--out", default="partition-preview",
                      help="folder for label_counts.md and .png; refused if it holds files, unless --force")
    part.add_argument("--force", action="store_true", help="write into a non-empty --out folder (replaces the "
                      "label table and plot there)")
    part.set_defaults(func=cmd_partition)
    lst = sub.add_parser("list", parents=[common],
                         help="list the run-config keys (default, meaning), methods, presets, datasets, models or "
                              "partitions")
    lst.add_argument("what", choices=LISTABLE)
    lst.set_defaults(func=cmd_list)
    stop = sub.add_parser("stop-superlink", parents=[common],
                          help="stop the local SuperLink a plain `flwr run` started (by PID; it keeps running after "
                               "the run), and the processes it started")
    stop.add_argument("--flwr-home", default=None, help="its FLWR_HOME (default: $FLWR_HOME, else ~/.flwr)")
    stop.set_defaults(func=cmd_stop_superlink)
    if argv is None:
        argv = sys.argv[1:]
    if "--version" in argv:  # computed only when asked (it reads package metadata)
        print(version_line())
        return 0
    args = parser.parse_args(argv)
    return run_command(args.func, args)


if __name__ == "__main__":
    raise SystemExit(main())
