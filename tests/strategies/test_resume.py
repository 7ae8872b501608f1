"""A server killed during distillation resumes from its last checkpoint and ends where an
uninterrupted run ends (same seed, same uploads)."""

import numpy as np
import pytest
import torch

from oneshot_fl.config import from_run_config, merge_overrides
from oneshot_fl.models.registry import build
from oneshot_fl.results import load_model
from oneshot_fl.uploads import decode_and_check, encode
from strategies import build_strategy

OVERRIDES = {"method": "dense", "preset": "smoke", "num-clients": 3, "distill.epochs": 6,
             "distill.eval-every": 2, "save-uploads": False}


class Crash(RuntimeError):
    pass


def _uploads(first_node_id=1):
    rng = np.random.default_rng(0)
    torch.manual_seed(0)  # identical uploads on every call: the checkpoint fingerprint covers them
    uploads = []
    for k in range(3):
        model = build("cnn2", (1, 28, 28), 10, seed=k).train()
        with torch.no_grad():
            model(torch.rand(16, 1, 28, 28))
        counts = rng.integers(1, 50, size=10)
        uploads.append(decode_and_check(encode("classifier", "cnn2", model.state_dict(), counts, k, {}),
                                        first_node_id + k, 10, (1, 28, 28)))
    return uploads


def _serve(run_dir, crash_at=None, first_node_id=1):
    strategy = build_strategy(from_run_config(merge_overrides(OVERRIDES)), run_dir=run_dir)
    if crash_at is not None:
        def before_epoch(epoch):
            if epoch == crash_at:
                raise Crash(f"killed at epoch {epoch}")
        strategy.before_epoch = before_epoch
    strategy.serve(_uploads(first_node_id))
    return strategy


def test_resume_after_a_crash_ends_like_an_uninterrupted_run(tmp_path, mnist_dir):
    reference = _serve(tmp_path / "reference")
    with pytest.raises(Crash):
        _serve(tmp_path / "resumed", crash_at=5)
    assert (tmp_path / "resumed" / "checkpoints" / "distill.pt").is_file()  # saved at epoch 4
    assert not (tmp_path / "resumed" / "result.json").exists()  # no half result
    resumed = _serve(tmp_path / "resumed", first_node_id=101)  # a new simulation: the same uploads from new node ids
    import json

    assert json.loads((tmp_path / "resumed" / "result.json").read_text())["global"]["resumed_from_epoch"] == 4
    assert resumed.evaluation.accuracy == reference.evaluation.accuracy
    model_a, _ = load_model(tmp_path / "reference" / "global_model.pt")
    model_b, _ = load_model(tmp_path / "resumed" / "global_model.pt")
    for (ka, a), (kb, b) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        assert ka == kb and torch.equal(a, b), ka


def test_a_checkpoint_of_another_configuration_is_ignored(tmp_path, mnist_dir):
    with pytest.raises(Crash):
        _serve(tmp_path / "run", crash_at=5)
    OVERRIDES_B = {**OVERRIDES, "dense.lambda-adv": 0.0}
    strategy = build_strategy(from_run_config(merge_overrides(OVERRIDES_B)), run_dir=tmp_path / "run")
    strategy.serve(_uploads())
    import json

    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["global"]["resumed_from_epoch"] == 0
    assert [h["epoch"] for h in result["history"]] == list(range(1, 7))
