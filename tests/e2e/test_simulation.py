"""End-to-end: the real app through `flwr run` (local SuperLink + Ray), smoke preset."""


import pytest

from launcher.launch import find_superlinks, run_simulation

pytestmark = pytest.mark.e2e


def test_fedavg_smoke_run_through_flwr_run(mnist_dir, tmp_path):
    # no shard cap: the smoke cap (512) would give every client the same sample count, and then
    # sample-weighted and uniform FedAvg would be the same model
    run = run_simulation({"method": "fedavg", "preset": "smoke", "dataset": "mnist", "num-clients": 5,
                          "local.max-samples": -1, "output-dir": str(tmp_path)}, stream=False)
    assert run.ok, run.status_details + run.log_text[-3000:]
    assert not find_superlinks(run.flwr_home), "the launcher must stop its SuperLink"
    result = run.result()
    assert result["status"] == "completed" and result["method"] == "fedavg"
    assert len(result["clients"]) == 5 and result["rejected"] == []
    assert result["global"]["accuracy"] > 0.3  # chance is 0.1
    for client in result["clients"]:
        assert client["raw_bytes"] < client["received_bytes"] <= 1.02 * client["raw_bytes"]
    prov = result["provenance"]
    assert prov["versions"]["flwr"] == "1.41.0" and prov["git"]["source"] == "launcher"
    assert (run.run_dir / "run.log").stat().st_size > 0  # the simulation's log, fetched by the launcher
    for name in ("global_model.pt", "label_counts.md", "label_counts.png", "client_accuracy.png",
                 "uploads/manifest.json", "run.log"):
        assert (run.run_dir / name).is_file(), name

    # the same uploads, another server method setting, no retraining
    from launcher.replay import replay

    replayed = replay(run.run_dir / "uploads", ["fedavg.weighting='uniform'"], run_dir=tmp_path / "replay")
    assert replayed["config"]["fedavg.weighting"] == "uniform"
    # the two global models are the sample-weighted and the plain mean of the archived uploads
    import torch

    from oneshot_fl.archive import load_uploads

    uploads = load_uploads(run.run_dir / "uploads", 10, (1, 28, 28), ("classifier",))
    sizes = [up.num_examples for up in uploads]
    assert len(set(sizes)) == len(sizes), sizes  # distinct sizes: the weightings must differ
    weighted = torch.load(run.run_dir / "global_model.pt", weights_only=False)["state_dict"]
    uniform = torch.load(tmp_path / "replay" / "global_model.pt", weights_only=False)["state_dict"]
    key = "classifier.weight"
    stacked = torch.stack([up.state[key].double() for up in uploads])
    w = torch.tensor(sizes, dtype=torch.float64) / sum(sizes)
    assert torch.allclose(weighted[key].double(), torch.tensordot(w, stacked, dims=1), atol=1e-6)
    assert torch.allclose(uniform[key].double(), stacked.mean(0), atol=1e-6)
    assert not torch.allclose(weighted[key], uniform[key], atol=1e-6)
    assert [c["label_counts"] for c in replayed["clients"]] == [c["label_counts"] for c in result["clients"]]
    assert replayed["global"]["accuracy"] > 0.3


def test_a_failed_run_is_reported_as_failed(tmp_path):
    """Files that exist but cannot be read pass the launcher's pre-flight check (which only looks) and fail
    inside the apps: the launcher must report the run's failure, not Flower's exit code 0."""
    damaged = tmp_path / "damaged" / "mnist"
    damaged.mkdir(parents=True)
    for name in ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                 "t10k-labels-idx1-ubyte"):
        (damaged / f"{name}.gz").write_bytes(b"<html>not a dataset</html>")
    run = run_simulation({"method": "fedavg", "preset": "smoke", "num-clients": 2,
                          "data-dir": str(damaged.parent), "download": False,
                          "output-dir": str(tmp_path)}, stream=False)
    assert not run.ok and run.status == "finished:failed"
    assert "cannot be read" in run.status_details + run.log_text
    assert not (run.run_dir / "result.json").exists()
