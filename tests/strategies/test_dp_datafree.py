"""Issue 37: the data-free methods on differentially private uploads (GroupNorm teachers, no BN statistics).
Each one runs to a global model and says in one log line that its BN-statistics prior is off and why."""

from __future__ import annotations

import json

import numpy as np
import pytest

from oneshot_fl.config import DPConfig, from_run_config, merge_overrides
from oneshot_fl.local import dp
from oneshot_fl.models.registry import build
from oneshot_fl.uploads import encode
from strategies import build_strategy
from tests.conftest import reply_message

TINY = {"preset": "smoke", "model": "cnn2-gn", "local.dp.epsilon": 8.0, "num-clients": 2, "eval.test-samples": 100,
        "distill.epochs": 1, "distill.generator-steps": 1, "distill.kd-steps": 1, "distill.synth-batch": 4,
        "distill.pool-max-batches": 1, "distill.nz": 8, "distill.ngf": 4, "fedhydra.ms-steps": 1}


@pytest.mark.parametrize("method", ["dense", "coboosting", "fedhydra"])
def test_each_data_free_method_runs_on_dp_uploads_with_its_bn_prior_off(method, tmp_path, mnist_dir, log_text):
    strategy = build_strategy(from_run_config(merge_overrides({**TINY, "method": method})), run_dir=tmp_path / "run")
    claim = dp.plan(100, 10, 1, DPConfig(epsilon=8.0)).to_meta()
    strategy._sent = [1, 2]
    replies = [reply_message(encode("classifier", "cnn2-gn", build("cnn2-gn", (1, 28, 28), 10, seed=k).state_dict(),
                                    np.array([10] * 10), k, {"local-test-accuracy": 0.5}, extra=claim), k + 1)
               for k in range(2)]
    strategy.aggregate_train(1, replies)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert len(result["clients"]) == 2 and result["rejected"] == []
    assert result["privacy"]["worst_epsilon"] == pytest.approx(claim["dp-epsilon"])
    records = list({id(r): r for r in log_text.records}.values())  # heard at the root and at "oneshot_fl"
    notes = [r.getMessage() for r in records if "BN-statistics prior off" in r.getMessage()]
    assert len(notes) == 1, notes
    assert notes[0].startswith(f"{method}: BN-statistics prior off: the 2 differentially private uploads")
    assert "carry no BN statistics" in notes[0]
    assert not any("no client model has BatchNorm" in r.getMessage() for r in records)  # said once, as above


def test_fedhydra_weights_a_dp_fleet_by_the_released_label_histograms(tmp_path, mnist_dir, log_text):
    # MS's scores are near uniform on DP-SGD models; a DP fleet's class scores are the released counts instead.
    cfg = from_run_config(merge_overrides({**TINY, "method": "fedhydra"}))
    strategy = build_strategy(cfg, run_dir=tmp_path / "run")
    claim = dp.plan(100, 10, 1, DPConfig(epsilon=8.0)).to_meta()
    strategy._sent = [1, 2]
    counts = [np.array([30, 10, 0, 0, 0, 0, 0, 0, 0, 5]), np.array([10, 30, 0, 0, 0, 0, 0, 0, 0, 15])]
    replies = [reply_message(encode("classifier", "cnn2-gn", build("cnn2-gn", (1, 28, 28), 10, seed=k).state_dict(),
                                    counts[k], k, {"local-test-accuracy": 0.5}, extra=claim), k + 1)
               for k in range(2)]
    strategy.aggregate_train(1, replies)
    report = json.loads((tmp_path / "run" / "stratification.json").read_text())
    assert report["scores_from"] == "released-label-histograms"
    u_r = np.array(report["used_u_r"])  # (class, client): each client's share of the class's released examples
    assert np.allclose(u_r[0], [0.75, 0.25]) and np.allclose(u_r[1], [0.25, 0.75])  # 30 / 40, 10 / 40
    assert np.allclose(u_r[9], [0.25, 0.75])  # 5 / 20, 15 / 20
    assert np.allclose(u_r[2], [0.5, 0.5])  # nobody released an example of class 2: uniform
    u_c = np.array(report["used_u_c"])  # each class's share of the client's: client 0 released 45 examples
    assert np.allclose(u_c[:, 0], np.array([30, 10, 0, 0, 0, 0, 0, 0, 0, 5]) / 45)
    assert any("class scores are the 2 clients' released label histograms" in r.getMessage()
               for r in log_text.records)
