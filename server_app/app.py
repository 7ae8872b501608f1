"""ServerApp: run config -> strategy -> one train round (or T rounds) -> global model -> run folder."""

from __future__ import annotations

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from oneshot_fl.config import from_run_config
from oneshot_fl.devices import set_threads
from oneshot_fl.logs import setup_logging
from server_app.fleet import check_simulated_fleet
from strategies import build_strategy

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    log = setup_logging()
    cfg = from_run_config(context.run_config)  # bad config fails here, before any message is sent
    # the server computes (fusion, distillation) after the clients have returned: all cores unless told
    # otherwise (`threads` is pinned per concurrent client by the launcher)
    set_threads(cfg.server_threads)
    check_simulated_fleet(grid, cfg.num_clients)  # a simulation of the wrong size fails now, not in 600 s
    strategy = build_strategy(cfg)
    log.info("run folder: %s", strategy.ctx.run_dir)
    strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord(),  # round 1: clients start from their own seeded init
        num_rounds=cfg.rounds,  # 1 = one-shot; T > 1: the global model goes back each round
        timeout=cfg.round_timeout,
        train_config=ConfigRecord({"seed": cfg.seed}),
        evaluate_fn=strategy.central_evaluate,
    )
    if strategy.evaluation is None:
        raise RuntimeError("the round ended without a global model")
    log.info("done: global accuracy %.4f, results in %s", strategy.evaluation.accuracy, strategy.run_root)
