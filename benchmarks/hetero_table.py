"""Heterogeneous-fleet table (FedHydra Table 3 shape): clients of different architectures, one server model.

Measures final test accuracy of FedDF, DENSE, Co-Boosting and FedHydra (FedAvg and OT: "not applicable", they
cannot fuse mixed architectures), each method's teacher and every client's own accuracy, per cell and seed. The fleet
and its budget come from a fleet file: benchmarks/conf/cifar10-hetero-cpu.toml (default: CIFAR-10, clients GoogLeNet
/ ResNet-18 / cnn2 / cnn3-bn / LeNet, server ResNet-18, a 2-core budget) or grey-hetero-cpu.toml (28px grey fleet
LeNet / cnn2 / cnn3-bn / ResNet-8 / VGG-9/4, server ResNet-8, the cpu preset; run with --datasets mnist fmnist).
Per cell and seed the clients are trained once by --train-method's simulation (its row), then every other method
replays the same uploads (benchmarks.fleets).

Cost on the 2-core development machine, one torch thread per process (medians of the records): grey fleet ~16 min
of client training per cell, then ~8 min of server for FedHydra, DENSE or FedDF and ~25 min for Co-Boosting;
CIFAR-10 fleet ~40 min of client training, then 30-40 min of server for FedHydra, DENSE or FedDF and 1.3-1.8 h for
Co-Boosting.

  python -m benchmarks.hetero_table --cells 0.5 0.1 --seeds 0 1 2 --table hetero_cifar10 \
      --methods fedhydra dense feddf coboosting --train-method fedhydra \
      --client-set threads=1 --set server-threads=1 --set threads=1
  python -m benchmarks.hetero_table --conf benchmarks/conf/grey-hetero-cpu.toml --table hetero_grey \
      --datasets mnist fmnist --cells 0.5 0.1 --seeds 0 1 2 --methods fedhydra dense feddf coboosting \
      --train-method fedhydra --client-set threads=1 --set server-threads=1
Finished records are skipped (--force retrains the clients; --redo-replays replays again on the kept uploads);
--jobs N runs N replays at once, each in a fresh process, while the next fleet's clients train.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from benchmarks.fleets import (BENCH_DIR, Fleet, add_concurrency_arguments, check_fleets, concurrency, parse_sets,
                               run_fleets, split_fleet)
from benchmarks.render import render
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
    add_concurrency_arguments(parser)
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
    failed = run_fleets(fleets, args.methods, preset, server_sets, force=args.force, on_record=render,
                        redo_replays=args.redo_replays, **concurrency(args))
    render()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
