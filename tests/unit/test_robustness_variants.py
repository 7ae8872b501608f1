"""The robustness benchmark's poisoned clients: each variant changes exactly what its name says."""

import json

import numpy as np
import pytest
import torch

from benchmarks.poisoning import classifier_keys, make_variant, poisoned_state, retrained_state
from oneshot_fl.config import from_run_config, merge_overrides
from oneshot_fl.models.registry import build

SHAPE = (1, 28, 28)


def cnn_state(seed=3):
    return build("cnn2", SHAPE, 10, seed=seed).state_dict()


def test_flip_rolls_the_classifier_rows_so_logit_j_answers_what_logit_j_minus_1_did():
    state = cnn_state()
    weight, bias = classifier_keys(state, 10)
    flipped = poisoned_state(state, "flip", "cnn2", SHAPE, 10, seed=0)
    assert torch.equal(flipped[weight][0], state[weight][9]) and torch.equal(flipped[weight][4], state[weight][3])
    assert torch.equal(flipped[bias][0], state[bias][9]) and torch.equal(flipped[bias][7], state[bias][6])
    assert all(torch.equal(flipped[k], v) for k, v in state.items() if k not in (weight, bias))
    x = torch.randn(8, *SHAPE)
    model, poisoned = build("cnn2", SHAPE, 10), build("cnn2", SHAPE, 10)
    model.load_state_dict(state)
    poisoned.load_state_dict(flipped)
    model.eval(), poisoned.eval()
    assert torch.equal(poisoned(x).argmax(1), (model(x).argmax(1) + 1) % 10)


def test_scale10_multiplies_the_parameters_and_keeps_the_bn_statistics():
    state = build("cnn3-bn", (3, 32, 32), 10, seed=1).state_dict()
    state = {k: v + 0.5 if "running_var" in k else v for k, v in state.items()}  # not the init's ones
    scaled = poisoned_state(state, "scale10", "cnn3-bn", (3, 32, 32), 10, seed=0)
    params = {name for name, _ in build("cnn3-bn", (3, 32, 32), 10).named_parameters()}
    for key, value in state.items():
        assert torch.equal(scaled[key], value * 10.0 if key in params else value), key
    assert any("running_var" in k for k in state) and any("num_batches_tracked" in k for k in state)


def test_random_is_the_seeded_fresh_init_of_the_architecture():
    random = poisoned_state(cnn_state(), "random", "cnn2", SHAPE, 10, seed=42)
    assert all(torch.equal(random[k], v) for k, v in cnn_state(seed=42).items())
    with pytest.raises(ValueError, match="unknown poisoning 'melt'"):
        poisoned_state(cnn_state(), "melt", "cnn2", SHAPE, 10, seed=0)


def _archive(tmp_path, run_config=None, dtype=torch.float32):
    uploads = tmp_path / "uploads"
    uploads.mkdir()
    entries = []
    for pid in range(3):
        torch.save({k: v.to(dtype) if v.is_floating_point() else v for k, v in cnn_state(pid).items()},
                   uploads / f"node-{pid}.pt")
        entries.append({"file": f"node-{pid}.pt", "partition_id": pid, "arch": "cnn2",
                        "metrics": {"local-test-accuracy": 0.9, "train-seconds": 1.0, "train-accuracy": 0.99}})
    context = {"input_shape": list(SHAPE), "num_classes": 10, "run_config": run_config or {}}
    (uploads / "manifest.json").write_text(json.dumps({"format": 1, "context": context, "uploads": entries}))
    return uploads


def test_a_variant_replaces_or_drops_only_the_victim_and_names_its_source(tmp_path):
    uploads = _archive(tmp_path)
    assert make_variant(uploads, "honest", 1, tmp_path / "honest") == uploads
    minus = make_variant(uploads, "minus", 1, tmp_path / "minus")
    manifest = json.loads((minus / "manifest.json").read_text())
    assert [e["partition_id"] for e in manifest["uploads"]] == [0, 2] and not (minus / "node-1.pt").exists()
    assert (minus / "node-2.pt").read_bytes() == (uploads / "node-2.pt").read_bytes()
    flip = make_variant(uploads, "flip", 1, tmp_path / "flip")
    entries = json.loads((flip / "manifest.json").read_text())["uploads"]
    assert entries[1]["poisoned"] == "flip" and entries[1]["metrics"] == {"train-seconds": 1.0}  # no honest scores
    assert "poisoned" not in entries[0] and entries[0]["metrics"]["local-test-accuracy"] == 0.9
    state, weight = torch.load(flip / "node-1.pt"), classifier_keys(cnn_state(1), 10)[0]
    assert torch.equal(state[weight][1], cnn_state(1)[weight][0])
    assert (flip / "node-0.pt").read_bytes() == (uploads / "node-0.pt").read_bytes()


def test_shuffled_retrains_the_victim_as_its_client_did_except_for_the_labels(mnist_dir, tmp_path):
    from client_app.task import run_client
    from oneshot_fl.uploads import decode_and_check

    flat = merge_overrides({"preset": "smoke", "num-clients": 3, "local.max-samples": 96, "seed": 4})
    cfg = from_run_config(flat)
    content = run_client(cfg, {"partition-id": 1, "num-partitions": 3}, {})
    honest = decode_and_check(content, 7, 10, SHAPE).state
    # without a shuffle the retraining is the ClientApp's training, bit for bit: same init, shard, batches
    again = retrained_state(cfg.flat, 1, "cnn2", shuffle_seed=None)
    assert set(again) == set(honest) and all(torch.equal(again[k], honest[k].to(again[k].dtype)) for k in honest)
    shuffled = retrained_state({**cfg.flat, "data-dir": str(tmp_path / "gone")}, 1, "cnn2", shuffle_seed=9)
    weight = classifier_keys(honest, 10)[0]
    assert not torch.allclose(shuffled[weight], honest[weight].to(shuffled[weight].dtype))
    # in an archive of half-precision uploads the shuffled victim stays half precision
    uploads = _archive(tmp_path, run_config=cfg.flat, dtype=torch.float16)
    out = make_variant(uploads, "shuffled", 1, tmp_path / "shuffled")
    state = torch.load(out / "node-1.pt")
    assert state[weight].dtype == torch.float16
    assert torch.equal(state[weight], retrained_state(cfg.flat, 1, "cnn2", shuffle_seed=10_001)[weight].half())
    assert json.loads((out / "manifest.json").read_text())["uploads"][1]["poisoned"] == "shuffled"


def test_shuffled_refuses_clients_it_cannot_retrain_faithfully():
    from oneshot_fl.config import ConfigError

    flat = merge_overrides({"preset": "smoke", "local.loss": "fedlmd"})
    with pytest.raises(ConfigError, match="local.loss='fedlmd'"):
        retrained_state(flat, 0, "cnn2", shuffle_seed=1)


def test_the_shuffle_keeps_the_label_counts_the_victim_reports():
    labels = np.array([0, 0, 1, 2, 2, 2])
    shuffled = np.random.default_rng(10_000).permutation(labels)
    assert sorted(shuffled.tolist()) == labels.tolist() and shuffled.tolist() != labels.tolist()
