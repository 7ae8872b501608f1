"""End-to-end smoke runs of the baselines through `flwr run` (Ray simulation): OT fusion with the
FedLMD-Tf local loss, Co-Boosting in multi-round mode with FedLMD, FedDF on a heterogeneous fleet.
Three simulations cover every new method family and client option (FedDF's public-data source is
a server-side choice, covered by tests/unit/test_feddf.py)."""

import json

import pytest

from oneshot_fl.config import ConfigError
from launcher.launch import check_run_config, run_simulation

pytestmark = pytest.mark.e2e


def _run(tmp_path, **overrides):
    run = run_simulation({"preset": "smoke", "output-dir": str(tmp_path), **overrides}, stream=False)
    assert run.ok, run.status_details + run.log_text[-3000:]
    return run, run.result()


def test_ot_fusion_of_clients_trained_with_fedlmd_tf(mnist_dir, tmp_path):
    run, result = _run(tmp_path, method="ot", **{"num-clients": 4, "local.loss": "fedlmd-tf", "local.lmd-beta": 0.5})
    assert result["method"] == "ot" and len(result["clients"]) == 4
    assert result["config"]["local.loss"] == "fedlmd-tf"
    assert result["global"]["accuracy"] > 0.3  # chance is 0.1
    assert result["global"]["solver"] == "emd" and result["global"]["reference_partition"] == 0
    assert result["timings"]["alignment"] <= result["timings"]["total"]
    # the saved global model is the OT fusion of the archived uploads with the run's settings
    # (EMD, aligned to partition 0, sample-weighted), not their plain average or the reference
    import torch

    from oneshot_fl.archive import load_uploads
    from oneshot_fl.fusion.ot import ot_fuse
    from oneshot_fl.models.registry import build

    uploads = sorted(load_uploads(run.run_dir / "uploads", 10, (1, 28, 28), ("classifier",)),
                     key=lambda up: up.partition_id)
    expected = ot_fuse([up.state for up in uploads], [up.num_examples for up in uploads],
                       build("cnn2", (1, 28, 28), 10), 0, "emd", 0.01, "cnn2")
    saved = torch.load(run.run_dir / "global_model.pt", weights_only=False)["state_dict"]
    for key, value in expected.items():
        assert torch.allclose(saved[key].float(), value.float(), atol=1e-5), key
    assert "local loss fedlmd-tf (majority labels" in run.log_text


def test_coboosting_over_two_rounds_with_fedlmd_clients(mnist_dir, tmp_path):
    run, result = _run(tmp_path, method="coboosting", rounds=2,
                       **{"num-clients": 3, "local.loss": "fedlmd", "distill.epochs": 3,
                          "distill.generator-steps": 5, "distill.kd-steps": 5})
    assert [r["round"] for r in result["rounds"]] == [1, 2] and result["round"] == 2
    for r in (1, 2):
        per_round = json.loads((run.run_dir / f"round-{r}" / "result.json").read_text())
        assert per_round["round"] == r and (run.run_dir / f"round-{r}" / "uploads" / "manifest.json").is_file()
    weights = result["global"]["client_weights"]
    assert len(weights) == 3 and all(0.0 <= w <= 1.0 for w in weights)
    assert len(result["global"]["weight_history"]) == 3  # uniform start + epochs 2 and 3
    assert result["global"]["accuracy"] > 0.2
    # round 1 has no global model (teacher-free), round 2 distils from the global model sent down
    assert "local loss fedlmd-tf" in run.log_text and "local loss fedlmd (majority" in run.log_text
    assert (run.run_dir / "global_model.pt").is_file()


def test_feddf_on_a_heterogeneous_fleet(mnist_dir, tmp_path):
    fleet = {"num-clients": 3, "client-models": "cnn2,lenet,cnn3-bn", "server-model": "cnn3-bn"}
    with pytest.raises(ConfigError, match="fedavg averages parameters and cannot fuse a heterogeneous fleet"):
        from strategies import build_strategy

        build_strategy(check_run_config({"method": "fedavg", "preset": "smoke", **fleet}), run_dir=tmp_path / "x")
    run, result = _run(tmp_path, method="feddf", **fleet, **{"feddf.patience": 2})
    assert [c["arch"] for c in result["clients"]] == ["cnn2", "lenet", "cnn3-bn"]
    assert result["global"]["arch"] == "cnn3-bn" and result["global"]["student_init"] == "scratch"
    assert result["global"]["source"] == "generator"
    assert all("val_kl" in h for h in result["history"])
    assert result["global"]["accuracy"] > 0.2
