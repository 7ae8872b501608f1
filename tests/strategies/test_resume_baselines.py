"""Co-Boosting (ensemble weights kept beside the checkpoint) and FedDF (held-out split and early-
stopping state inside it) resume from a crash and end exactly where an uninterrupted run ends."""

import json

import pytest
import torch

from oneshot_fl.config import from_run_config, merge_overrides
from oneshot_fl.results import load_model
from strategies import build_strategy
from tests.strategies.test_resume import Crash, _uploads

SMALL = {"preset": "smoke", "num-clients": 3, "distill.epochs": 4, "distill.eval-every": 2,
         "distill.generator-steps": 3, "distill.kd-steps": 3, "save-uploads": False}


def _serve(run_dir, method, crash_at=None):
    strategy = build_strategy(from_run_config(merge_overrides({"method": method, **SMALL})), run_dir=run_dir)
    if crash_at is not None:
        original = strategy.before_epoch

        def before_epoch(epoch):
            if epoch == crash_at:
                raise Crash(f"killed at epoch {epoch}")
            original(epoch)
        strategy.before_epoch = before_epoch
    strategy.serve(_uploads())
    return strategy


@pytest.mark.parametrize("method", ["coboosting", "feddf"])
def test_resumed_run_equals_the_uninterrupted_one(method, tmp_path, mnist_dir):
    _serve(tmp_path / "reference", method)
    with pytest.raises(Crash):
        _serve(tmp_path / "resumed", method, crash_at=3)
    _serve(tmp_path / "resumed", method)
    a = json.loads((tmp_path / "reference" / "result.json").read_text())["global"]
    b = json.loads((tmp_path / "resumed" / "result.json").read_text())["global"]
    assert b["resumed_from_epoch"] == 2 and a["accuracy"] == b["accuracy"]
    if method == "coboosting":
        assert a["client_weights"] == b["client_weights"]
    model_a, _ = load_model(tmp_path / "reference" / "global_model.pt")
    model_b, _ = load_model(tmp_path / "resumed" / "global_model.pt")
    for (ka, ta), (kb, tb) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        assert ka == kb and torch.equal(ta, tb), ka
