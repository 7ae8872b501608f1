"""End-to-end smoke runs of the data-free methods through `flwr run` (Ray simulation)."""

import json

import pytest

from launcher.launch import run_simulation

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("method", ["fedhydra", "dense"])
def test_smoke_run_produces_a_model_above_chance(method, mnist_dir, tmp_path):
    run = run_simulation({"method": method, "preset": "smoke", "num-clients": 5, "output-dir": str(tmp_path)},
                         stream=False)
    assert run.ok, run.status_details + run.log_text[-3000:]
    result = run.result()
    assert result["method"] == method and len(result["clients"]) == 5
    assert result["global"]["accuracy"] > 0.2  # chance is 0.1
    assert result["global"]["ensemble_accuracy"] > 0.2
    history = result["history"]
    assert [h["epoch"] for h in history] == list(range(1, len(history) + 1))
    for name in ("accuracy.png", "synthetic_samples.png", "global_model.pt"):
        assert (run.run_dir / name).is_file(), name
    if method == "fedhydra":
        strat = json.loads((run.run_dir / "stratification.json").read_text())
        assert len(strat["u_r"]) == 10 and len(strat["u_r"][0]) == 5
        assert (run.run_dir / "stratification_u_r.png").is_file()
        assert result["timings"]["stratification"] > 0
