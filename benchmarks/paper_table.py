"""Paper table (FedHydra Tables 1-2 shape): every server method on the same client uploads, per dataset, cell and seed.

Measures final test accuracy, the teachers' accuracy and wall seconds per phase of FedAvg, OT, FedDF, DENSE,
Co-Boosting and FedHydra (`fedhydra-paper`: the published recipe) on 5 clients per cell (NIID-Bench Dirichlet alpha
or 2c/c). Each cell's clients are trained once by the FedAvg simulation (its row), the other methods replay its
uploads (benchmarks.fleets). Records: results/<table>.jsonl (default paper_table); tables: `python -m
benchmarks.render` (results/README.md) and the README's generated block.

Cost on the 2-core development machine, `cpu` preset (medians of results/paper_table.jsonl): an MNIST or FMNIST
cell's five clients train in ~5 min of CPU in all; a replay's server takes ~5 min (DENSE, FedHydra), ~4 min (FedDF),
~10 min (Co-Boosting), seconds (FedAvg, OT). CIFAR-10 at the cpu preset (the release names it: --client-set
local.epochs=10, 30 distillation epochs of 20 generator and 50 KD steps): ~50 min of clients, ~15 min of server per
replay (DENSE, FedHydra; results/cifar10_budget.md).

  python -m benchmarks.paper_table --datasets mnist fmnist --cells 0.5 0.3 0.1 0.01 2c/c \
      --seeds 0 1 2 --methods fedavg ot feddf dense coboosting fedhydra-paper fedhydra --jobs 2
Finished records are skipped, so an interrupted table continues where it stopped (--force redoes them,
--redo-replays replays again on the kept uploads). A method that cannot run on a fleet gets a "not applicable"
record with the reason.
"""

from __future__ import annotations

import argparse
import logging
import sys

from benchmarks.fleets import Fleet, add_fleet_arguments, check_fleets, concurrency, parse_sets, run_fleets
from benchmarks.render import render
from oneshot_fl.config import ConfigError
from oneshot_fl.logs import setup_logging


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--table", default="paper_table")
    parser.add_argument("--datasets", nargs="+", default=["mnist", "fmnist"])
    parser.add_argument("--cells", nargs="+", default=["0.5", "0.3", "0.1", "0.01", "2c/c"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--num-clients", type=int, default=5)
    add_fleet_arguments(parser, ["fedavg", "ot", "feddf", "dense", "coboosting", "fedhydra-paper", "fedhydra"])
    args = parser.parse_args(argv)
    try:
        client_sets, server_sets = parse_sets(args.client_set), parse_sets(args.set)
        fleets = [Fleet(args.table, dataset, cell, seed, args.num_clients, client_sets)
                  for dataset in args.datasets for cell in args.cells for seed in args.seeds]
        check_fleets(fleets, args.methods, args.preset, server_sets)
    except ConfigError as exc:
        parser.error(str(exc))
    setup_logging()
    logging.getLogger("oneshot_fl.bench").setLevel(logging.INFO)
    failed = run_fleets(fleets, args.methods, args.preset, server_sets, force=args.force, on_record=render,
                        redo_replays=args.redo_replays, **concurrency(args))
    render()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
