"""End-to-end: a FedMHO mixed fleet (classifier + decoder clients) through `flwr run`, smoke preset,
then other server methods replayed on the same uploads."""

import pytest

from launcher.launch import run_simulation
from launcher.replay import replay

pytestmark = pytest.mark.e2e


def test_fedmho_md_mixed_fleet_smoke_run_through_flwr_run(mnist_dir, tmp_path):
    run = run_simulation({"method": "fedmho-md", "preset": "smoke", "dataset": "mnist", "num-clients": 4,
                          "fedmho.constrained-clients": 2, "output-dir": str(tmp_path)}, stream=False)
    assert run.ok, run.status_details + run.log_text[-3000:]
    result = run.result()
    assert result["rejected"] == [] and result["missing_nodes"] == []
    assert [c["role"] for c in result["clients"]] == ["classifier", "classifier", "decoder", "decoder"]
    g = result["global"]
    assert g["teacher"] == "mean logits of 2 classifier clients" and g["synthetic"]["kept"] == 160
    assert g["accuracy"] > 0.2  # chance is 0.1; smoke clients train one epoch on 512 samples
    # The start model is the uniform average of the classifier uploads, so a fusion that did
    # nothing would return that average: the saved global model must have moved away from it,
    # by at most what 1 epoch of Adam (lr 1e-5, 3 steps of 64 on 160 kept samples) can move it.
    assert g["fusion_epochs"] == 1 and g["fusion_lr"] == 1e-5 and g["fusion_kd"] is True
    import torch

    from oneshot_fl.archive import load_uploads

    classifiers = load_uploads(run.run_dir / "uploads", 10, (1, 28, 28), ("classifier",), skip_other_roles=True)
    assert len(classifiers) == 2
    fused = torch.load(run.run_dir / "global_model.pt", weights_only=False)["state_dict"]
    trained = [k for k, v in fused.items() if v.is_floating_point() and "running_" not in k]
    moved = max(float((fused[k] - torch.stack([up.state[k] for up in classifiers]).mean(0)).abs().max())
                for k in trained)
    assert 1e-7 < moved <= 3 * 1e-5 * 1.5, moved
    decoder = result["upload_bytes"]["per_role"]["decoder"]
    assert decoder["raw_bytes"] == [204_816 * 4] * 2  # the decoder only: no encoder tensor left the client
    assert decoder["max_ratio_to_raw_plus_counts"] <= 1.02
    assert (run.run_dir / "synthetic_samples.png").is_file()
    # The decoder uploads are what the server drew from: one plan row per decoder client, each class's quota
    # (200 // 10) split by the squares of the label counts those clients uploaded; a real-data scorer (a cnn2
    # fitted on half the 1,000 test images) judged each decoder's kept samples.
    import numpy as np

    from oneshot_fl.engine.decoders import squared_plan

    decoders = [c for c in result["clients"] if c["role"] == "decoder"]
    counts = np.array([c["label_counts"] for c in decoders])
    assert g["synthetic"]["plan"] == squared_plan(counts, 200).tolist()
    assert all(sum(row) > 0 for row in g["synthetic"]["plan"])  # both decoders drew samples
    scores = g["decoder_samples"]
    assert scores["scorer"]["fitted_on"] == 500 and len(scores["kept_per_decoder"]) == 2
    assert all(s is None or 0.0 <= s <= 1.0 for s in scores["kept_per_decoder"])

    # the same uploads: plain FedMHO, and FedAvg on the classifier uploads alone
    plain = replay(run.run_dir / "uploads", ["method='fedmho'"], run_dir=tmp_path / "plain")
    assert plain["global"]["teacher"] == "none" and len(plain["clients"]) == 4
    fedavg = replay(run.run_dir / "uploads", ["method='fedavg' min-clients=2"], run_dir=tmp_path / "fedavg")
    assert [c["role"] for c in fedavg["clients"]] == ["classifier", "classifier"]
