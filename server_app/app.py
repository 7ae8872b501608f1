"""ServerApp: run config -> run folder (held while the run writes) -> strategy -> one train round (or T rounds)
-> global model -> run folder."""

from __future__ import annotations

import shlex
from typing import Any, Mapping

from flwr.app import ArrayRecord, ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from oneshot_fl import provenance
from oneshot_fl.config import default_run_config, from_run_config, run_config_items
from oneshot_fl.devices import set_threads
from oneshot_fl.logs import setup_logging
from oneshot_fl.run_folder import serving
from server_app.fleet import check_simulated_fleet
from strategies import build_strategy

app = ServerApp()


def plain_run_command(run_config: Mapping[str, Any]) -> str:
    """The `flwr run` command a run without a launcher was given, as far as the ServerApp can tell: its run-config
    values that differ from the app's defaults (the command line itself never reaches the ServerApp)."""
    defaults = default_run_config()
    changed = {key: value for key, value in run_config.items() if key not in defaults or defaults[key] != value}
    return "flwr run ." + (f" --run-config {shlex.quote(' '.join(run_config_items(changed)))}" if changed else "")


@app.main()
def main(grid: Grid, context: Context) -> None:
    log = setup_logging()
    cfg = from_run_config(context.run_config)  # bad config fails here, before any message is sent
    # the server computes (fusion, distillation) after the clients have returned: all cores unless told
    # otherwise (`threads` is pinned per concurrent client by the launcher)
    set_threads(cfg.server_threads)
    check_simulated_fleet(grid, cfg.num_clients)  # a simulation of the wrong size fails now, not in 600 s
    plain = plain_run_command(context.run_config)
    # no other run writes this folder while this one does; a refused run has written nothing
    with serving(cfg, context.run_id, plain) as (run_dir, launcher):
        if launcher.get("command"):
            provenance.set_command(launcher["command"], "launcher")
        else:
            provenance.set_command(plain, "run config (no launcher: the values that differ from the app's defaults)")
        strategy = build_strategy(cfg, run_dir)
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
