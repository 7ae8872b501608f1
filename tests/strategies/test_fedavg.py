import numpy as np
import pytest
import torch

from oneshot_fl.config import ConfigError, from_run_config, merge_overrides
from oneshot_fl.fusion.averaging import HeterogeneousFleetError, average_states
from oneshot_fl.models.registry import build
from oneshot_fl.uploads import encode
from strategies import build_strategy
from oneshot_fl.errors import QuorumError
from tests.conftest import reply_message


def test_weighted_average_against_a_hand_computed_example():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(10)}
    b = {"w": torch.tensor([4.0, -1.0]), "n": torch.tensor(20)}
    out = average_states([a, b], [1, 2])  # weights 1/3, 2/3
    assert torch.allclose(out["w"], torch.tensor([(1 + 8) / 3, (2 - 2) / 3]))
    assert out["n"].dtype == torch.int64 and int(out["n"]) == round((10 + 40) / 3)


def test_average_refuses_different_layouts():
    with pytest.raises(HeterogeneousFleetError):
        average_states([{"w": torch.zeros(2)}, {"w": torch.zeros(3)}], [1, 1])


def _strategy(tmp_path, **over):
    flat = merge_overrides({"method": "fedavg", "preset": "smoke", **over})
    return build_strategy(from_run_config(flat), run_dir=tmp_path / "run")


def _reply(node, arch="cnn2", seed=0, counts=(10,) * 10, scale=None, partition=None):
    """A classifier reply from `node`; its partition id defaults to the node's place in these tests'
    fleets (nodes 1, 2, ... or 11, 12, ... hold partitions 0, 1, ...)."""
    model = build(arch, (1, 28, 28), 10, seed=seed)
    state = model.state_dict()
    if scale is not None:
        state = {k: (v.fill_(scale) if v.is_floating_point() else v) for k, v in state.items()}
    partition = (node - 1) % 10 if partition is None else partition
    content = encode("classifier", arch, state, np.array(counts), partition, {"local-test-accuracy": 0.5})
    return reply_message(content, src_node_id=node)


def test_aggregate_train_averages_by_sample_count_bn_stats_included(tmp_path, mnist_dir):
    strategy = _strategy(tmp_path, **{"num-clients": 2})
    strategy._sent = [1, 2]
    replies = [_reply(1, counts=[10] * 10, scale=1.0), _reply(2, counts=[30] * 10, scale=5.0)]
    replies[1].content.metric_records["metrics"]["local-test-accuracy"] = 0.75
    arrays, metrics = strategy.aggregate_train(1, replies)
    # Flower's "ClientApp-side Train Metrics": what the clients reported; the global accuracy is server-side
    assert dict(metrics) == {"accepted-uploads": 2, "num-examples": 400, "mean-local-test-accuracy": 0.625}
    assert strategy.central_evaluate(1, arrays)["accuracy"] == strategy.evaluation.accuracy
    state = arrays.to_torch_state_dict()
    for key in ("features.0.weight", "features.1.running_mean", "features.1.running_var"):
        assert torch.allclose(state[key], torch.full_like(state[key], 0.25 * 1 + 0.75 * 5)), key
    assert (tmp_path / "run" / "result.json").is_file()
    assert (tmp_path / "run" / "uploads" / "manifest.json").is_file()


def test_bad_replies_are_dropped_and_the_run_goes_on(tmp_path, mnist_dir):
    strategy = _strategy(tmp_path, **{"num-clients": 4, "min-clients": 2})
    strategy._sent = [1, 2, 3, 4]
    bad = _reply(3)
    bad.content.config_records["meta"]["arch"] = "nope"
    replies = [_reply(1), _reply(2, seed=1), bad, reply_message(None, 4, error="out of memory")]
    strategy.aggregate_train(1, replies)
    import json

    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert [c["node_id"] for c in result["clients"]] == [1, 2]
    reasons = {r["node_id"]: r["reason"] for r in result["rejected"]}
    assert "unknown architecture" in reasons[3] and "out of memory" in reasons[4]


def test_too_few_valid_uploads_stop_with_a_clear_error_and_no_model(tmp_path, mnist_dir):
    strategy = _strategy(tmp_path, **{"num-clients": 3})
    strategy._sent = [1, 2, 3]
    with pytest.raises(QuorumError, match=r"1 valid uploads, 3 required.*missing nodes: \[2, 3\]"):
        strategy.aggregate_train(1, [_reply(1)])
    assert not (tmp_path / "run" / "global_model.pt").exists()
    assert not (tmp_path / "run" / "result.json").exists()


def test_fedavg_refuses_a_heterogeneous_fleet(tmp_path, mnist_dir):
    with pytest.raises(ConfigError, match="heterogeneous"):
        _strategy(tmp_path, **{"client-models": "cnn2,lenet", "server-model": "cnn2"})
    # a node config may pick another architecture (node-archs tells the server): fedavg refuses to mix
    strategy = _strategy(tmp_path, **{"num-clients": 2, "node-archs": "lenet"})
    strategy._sent = [1, 2]
    with pytest.raises(HeterogeneousFleetError, match="cnn2, lenet"):
        strategy.aggregate_train(1, [_reply(1), _reply(2, arch="lenet")])
    # without it, an architecture the run did not assign is that node's rejection
    strategy = _strategy(tmp_path, **{"num-clients": 2, "min-clients": 1})
    strategy._sent = [1, 2]
    strategy.aggregate_train(1, [_reply(1), _reply(2, arch="lenet")])
    import json

    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert "'lenet' was not assigned to partition 1" in result["rejected"][0]["reason"]


# --- FedAvg's weighting on hand-built uploads (no data set, no Flower) ------------------------

def _fedavg_on(tmp_path, weighting, uploads):
    from oneshot_fl.data.datasets import Split
    from strategies.context import FuseContext
    from strategies.fedavg import FedAvg

    cfg = from_run_config(merge_overrides({"method": "fedavg", "preset": "smoke", "fedavg.weighting": weighting}))
    ctx = FuseContext(cfg=cfg, device=torch.device("cpu"), num_classes=10, input_shape=(1, 28, 28),
                      test=Split(np.zeros((1, 28, 28, 1), np.uint8), np.zeros(1, np.int64)), run_dir=tmp_path)
    return FedAvg(cfg, ctx).fuse(uploads, ctx).model.state_dict()


def _upload(node, fill, batches, num_examples):
    """A cnn2 upload: float tensor k (in state order) = fill + k, BN's num_batches_tracked = batches."""
    from oneshot_fl.uploads import Upload

    state = build("cnn2", (1, 28, 28), 10, seed=0).state_dict()
    floats = [k for k, v in state.items() if v.is_floating_point()]
    state = {k: (torch.full_like(v, fill + floats.index(k)) if v.is_floating_point() else torch.full_like(v, batches))
             for k, v in state.items()}
    counts = np.zeros(10, np.int64)
    counts[0] = num_examples
    return Upload(node_id=node, partition_id=node, role="classifier", arch="cnn2", state=state,
                  label_counts=counts, num_examples=num_examples)


@pytest.mark.parametrize("weighting, w_b", [("num-examples", 0.75), ("uniform", 0.5)])
def test_fedavg_weighting_on_two_hand_built_uploads_bn_buffers_included(tmp_path, weighting, w_b):
    a, b = _upload(1, fill=1.0, batches=4, num_examples=10), _upload(2, fill=5.0, batches=12, num_examples=30)
    state = _fedavg_on(tmp_path, weighting, [a, b])
    keys = [k for k, v in a.state.items() if v.is_floating_point()]
    assert {"features.1.running_mean", "features.1.running_var"} <= set(keys)  # BN buffers averaged too
    for i, key in enumerate(keys):
        # tensor i holds 1 + i in a and 5 + i in b: the mean is (1 - w_b)(1 + i) + w_b (5 + i) = 1 + i + 4 w_b
        assert torch.allclose(state[key], torch.full_like(state[key], 1.0 + i + 4.0 * w_b)), key
    nbt = [k for k in a.state if k.endswith("num_batches_tracked")]
    assert nbt and all(state[k].dtype == torch.int64 and int(state[k]) == 4 + round(8 * w_b) for k in nbt)


def test_fedavg_sample_weighting_follows_num_examples_not_the_upload_order(tmp_path):
    a, b = _upload(1, fill=1.0, batches=0, num_examples=30), _upload(2, fill=5.0, batches=0, num_examples=10)
    state = _fedavg_on(tmp_path, "num-examples", [a, b])
    i = [k for k, v in a.state.items() if v.is_floating_point()].index("classifier.bias")
    expected = 0.75 * (1.0 + i) + 0.25 * (5.0 + i)  # a has 3x b's samples
    assert torch.allclose(state["classifier.bias"], torch.full_like(state["classifier.bias"], expected))
