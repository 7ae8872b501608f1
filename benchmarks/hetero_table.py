"""Heterogeneous-fleet table (FedHydra NEWER Table 3 shape): per-node architectures, one server model.

The fleet and its CPU budget come from an override file (default benchmarks/conf/cifar10-hetero-cpu.toml:
CIFAR-10, clients GoogLeNet / ResNet-18 / CNN / CNN / LeNet, server ResNet-18; grey-hetero-cpu.toml: the
28px grey fleet LeNet / CNN / CNN / ResNet-8 / VGG-9, server ResNet-8, run with --datasets mnist fmnist).
Per cell and seed the clients are trained once through the real simulation by --train-method (a data-free
method; its result is recorded from that run), then every other method replays the same uploads. FedAvg and OT cannot
fuse mixed architectures and are recorded as "not applicable" with the reason.

  python -m benchmarks.hetero_table --cells 0.5 0.3 0.1 0.01 --seeds 0 1 2 \\
      --methods fedavg ot feddf dense coboosting fedhydra
Finished records are skipped (--force redoes them, training the clients again; --redo-replays redoes the replays
on the uploads already kept); --jobs N runs N replays at once, each in a fresh process, while
the next fleet's clients train. Tables: python -m benchmarks.render.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from benchmarks.paper_table import BENCH_DIR, Fleet, check_fleets, parse_sets, run_fleets, split_fleet
from launcher.cli import bounded
from oneshot_fl.config import ConfigError
from oneshot_fl.logs import setup_logging

DEFAULT_CONF = BENCH_DIR / "conf" / "cifar10-hetero-cpu.toml"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", default="hetero_cifar10")
    parser.add_argument("--conf", type=Path, default=DEFAULT_CONF, help="run-config override file of the fleet")
    parser.add_argument("--datasets", nargs="+", help="datasets to run the fleet on (default: the file's dataset)")
    parser.add_argument("--cells", nargs="+", default=["0.5", "0.3", "0.1", "0.01"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=["fedavg", "ot", "feddf", "dense", "coboosting", "fedhydra"])
    parser.add_argument("--train-method", default="dense", help="data-free method whose run trains the clients")
    parser.add_argument("--client-set", action="append", default=[], help="more client-side overrides")
    parser.add_argument("--set", action="append", default=[], help="server-side overrides for every method")
    parser.add_argument("--jobs", type=bounded(1, int), default=1,
                        help="replays run at once, each in a fresh process, while the next fleet's clients train")
    parser.add_argument("--force", action="store_true", help="redo runs that already have a record")
    parser.add_argument("--redo-replays", action="store_true",
                        help="redo the replays that have a record, on the uploads already kept (no retraining): "
                             "a fleet trained again on another machine may be another fleet, so its other methods "
                             "replay its own uploads")
    args = parser.parse_args(argv)
    try:
        fleet = {**parse_sets([str(args.conf)]), **parse_sets(args.client_set)}
        dataset, num_clients, preset = fleet.pop("dataset"), fleet.pop("num-clients"), fleet.pop("preset", "cpu")
        # the file's server settings (distillation budget, server model, method knobs) reach the training run and
        # every replay alike; a replay takes the client-side ones from the uploads archive
        client_sets, server_sets = split_fleet(fleet, parse_sets(args.set))
        fleets = [Fleet(args.table, ds, cell, seed, num_clients, client_sets, trained_by=args.train_method)
                  for ds in args.datasets or [dataset] for cell in args.cells for seed in args.seeds]
        check_fleets(fleets, [args.train_method, *args.methods], preset, server_sets)
    except (ConfigError, OSError) as exc:
        parser.error(str(exc))
    except KeyError as exc:
        parser.error(f"{args.conf}: the fleet file must set {exc}")
    setup_logging()
    logging.getLogger("oneshot_fl.bench").setLevel(logging.INFO)
    from benchmarks.render import render

    failed = run_fleets(fleets, args.methods, preset, server_sets, args.jobs, args.force, on_record=render,
                        redo_replays=args.redo_replays)
    render()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
