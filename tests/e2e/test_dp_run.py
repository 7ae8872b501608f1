"""End-to-end (issue 37): differentially private clients through `flwr run`, smoke preset. The clients train with
DP-SGD and upload noised label counts with their guarantee; the server verifies every claim, DENSE distils from
the GroupNorm teachers with its BN prior off, and result.json reports each guarantee and the fleet's worst."""

import numpy as np
import pytest

from launcher.launch import run_simulation

pytestmark = pytest.mark.e2e


def test_a_dp_dense_run_through_flwr_run(mnist_dir, tmp_path):
    config = {"method": "dense", "preset": "smoke", "num-clients": 3, "model": "cnn2-gn", "local.dp.epsilon": 3.0,
              "local.max-samples": 256, "eval.test-samples": 500, "distill.epochs": 1, "distill.kd-steps": 5,
              "output-dir": str(tmp_path)}
    run = run_simulation(config, stream=False)
    assert run.ok, run.status_details + run.log_text[-3000:]
    result = run.result()
    assert len(result["clients"]) == 3 and result["rejected"] == []
    epsilons = [client["dp"]["epsilon"] for client in result["clients"]]
    assert all(2.85 <= eps <= 3.0 for eps in epsilons), epsilons
    assert result["privacy"]["worst_epsilon"] == max(epsilons) and result["privacy"]["target_epsilon"] == 3.0
    assert "dense: BN-statistics prior off: the 3 differentially private uploads" in run.log_text

    from client_app.task import load_shard
    from oneshot_fl.archive import load_uploads
    from oneshot_fl.config import from_run_config, merge_overrides
    from oneshot_fl.data.partition import label_counts

    cfg = from_run_config(merge_overrides({k: v for k, v in config.items() if k != "output-dir"}))
    uploads = load_uploads(run.run_dir / "uploads", 10, (1, 28, 28), ("classifier",))
    exact = [label_counts(load_shard(cfg, up.partition_id).labels, 10) for up in uploads]
    assert any(not np.array_equal(up.label_counts, counts) for up, counts in zip(uploads, exact))  # noised
    assert all(not any(k.endswith("running_var") for k in up.state) and up.dp is not None for up in uploads)


def test_a_dp_fedmho_md_mixed_fleet_through_flwr_run(mnist_dir, tmp_path):
    # two DP classifier clients (DP-SGD on cnn2-gn) and two DP decoder clients (DP-SGD on the whole CVAE, the
    # decoder uploaded): every upload's claim verified, and the server's sampling quota read from the noised counts
    from oneshot_fl.engine.decoders import squared_plan

    config = {"method": "fedmho-md", "preset": "smoke", "num-clients": 4, "fedmho.constrained-clients": 2,
              "model": "cnn2-gn", "local.dp.epsilon": 8.0, "local.max-samples": 256, "eval.test-samples": 500,
              "output-dir": str(tmp_path)}
    run = run_simulation(config, stream=False)
    assert run.ok, run.status_details + run.log_text[-3000:]
    result = run.result()
    assert sorted(c["role"] for c in result["clients"]) == ["classifier"] * 2 + ["decoder"] * 2
    assert result["rejected"] == []
    assert all(0.99 * 8.0 <= c["dp"]["epsilon"] <= 8.0 for c in result["clients"])
    decoders = [c for c in result["clients"] if c["role"] == "decoder"]
    counts = np.array([c["label_counts"] for c in decoders])
    assert result["global"]["synthetic"]["plan"] == squared_plan(counts, 200).tolist()
    assert 0.0 <= result["global"]["accuracy_final"] <= 1.0
