"""Method registry: one strategy module per method, all on strategies.base.OneShotStrategy."""

from __future__ import annotations

import difflib
from pathlib import Path

from oneshot_fl.config import ConfigError, RunConfig
from strategies.base import OneShotStrategy
from strategies.context import make_context
from strategies.coboosting import CoBoosting
from strategies.dense import Dense
from strategies.fedavg import FedAvg
from strategies.fedcvae import FedCVAE
from strategies.feddf import FedDF
from strategies.fedhydra import FedHydra
from strategies.fedmho import FedMHO, FedMHOMD, FedMHOSD
from strategies.ot_fusion import OTFusion

STRATEGIES: dict[str, type[OneShotStrategy]] = {
    cls.name: cls for cls in (FedAvg, OTFusion, FedDF, Dense, CoBoosting, FedHydra,
                              FedMHO, FedMHOMD, FedMHOSD, FedCVAE)
}


def strategy_class(name: str) -> type[OneShotStrategy]:
    if name not in STRATEGIES:
        close = difflib.get_close_matches(name, list(STRATEGIES), n=2, cutoff=0.6)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        raise ConfigError(f"method={name!r} is not a known method{hint}; choose one of: {', '.join(STRATEGIES)}")
    return STRATEGIES[name]


def check_method_params(cfg: RunConfig) -> None:
    """Parse every method's section, not only the chosen one's: a typo'd or out-of-range value in
    another section (kept for a later replay) should fail now, not when that method runs."""
    strategy_class(cfg.method)
    for cls in STRATEGIES.values():
        cls.parse_params(cfg.flat)


def build_strategy(cfg: RunConfig, run_dir: Path | None = None, cls: type[OneShotStrategy] | None = None
                   ) -> OneShotStrategy:
    """Validate the method and its parameters first, then set up the run folder and test set. `cls` replaces the
    method's strategy class (a subclass of it, as a benchmark's variant)."""
    check_method_params(cfg)  # bad method parameters fail before any data is loaded
    method = strategy_class(cfg.method)
    if cls is not None and not issubclass(cls, method):
        raise TypeError(f"{cls.__name__} is not a {method.__name__}")
    return (cls or method)(cfg, make_context(cfg, run_dir), methods={name: c.roles for name, c in STRATEGIES.items()})
