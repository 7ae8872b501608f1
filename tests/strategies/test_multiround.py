"""Multi-round mode: the global model goes down from round 2, every round gets its own folder,
the final result lists every round, and clients start from the model they were sent."""

from __future__ import annotations

import json

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord

from oneshot_fl.config import ConfigError, from_run_config, merge_overrides
from oneshot_fl.uploads import GLOBAL_MODEL_KEY
from tests.strategies.test_fedavg import _reply, _strategy


class _Grid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


def test_multi_round_needs_a_homogeneous_fleet_of_the_server_architecture():
    with pytest.raises(ConfigError, match="rounds=2.*homogeneous|rounds=2.*server's architecture"):
        from_run_config(merge_overrides({"rounds": 2, "client-models": "cnn2,lenet", "server-model": "cnn2"}))
    with pytest.raises(ConfigError, match="rounds=3"):
        from_run_config(merge_overrides({"rounds": 3, "server-model": "lenet"}))  # clients cnn2, server lenet
    assert from_run_config(merge_overrides({"rounds": 3})).rounds == 3
    with pytest.raises(ConfigError, match="rounds=0"):
        from_run_config(merge_overrides({"rounds": 0}))


def test_round_two_sends_the_global_model_and_its_architecture(tmp_path, mnist_dir, monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_node_id", "_task_id"):  # what a ServerApp process has set when it builds messages
        monkeypatch.setattr(TaskIdentity, attr, 1)
    strategy = _strategy(tmp_path, **{"num-clients": 2, "rounds": 2})
    first = list(strategy.configure_train(1, ArrayRecord(), ConfigRecord({"seed": 0}), _Grid([5, 6])))
    assert all(GLOBAL_MODEL_KEY not in m.content.array_records for m in first)
    arrays = ArrayRecord(torch.nn.Linear(2, 2).state_dict())
    second = list(strategy.configure_train(2, arrays, ConfigRecord({"seed": 0}), _Grid([5, 6])))
    for message in second:
        assert message.content.config_records["config"]["global-arch"] == "cnn2"
        assert message.content.config_records["config"]["server-round"] == 2
        assert set(message.content.array_records[GLOBAL_MODEL_KEY].keys()) == {"weight", "bias"}


def test_each_round_gets_a_folder_and_the_final_result_lists_all_rounds(tmp_path, mnist_dir):
    strategy = _strategy(tmp_path, **{"num-clients": 2, "rounds": 2})
    strategy._sent = [1, 2]
    seeds = []
    for server_round in (1, 2):
        strategy.aggregate_train(server_round, [_reply(1, scale=1.0 * server_round), _reply(2, seed=1)])
        seeds.append(strategy.ctx.seed("student"))
        assert strategy.ctx.round == server_round
    root = tmp_path / "run"
    for r in (1, 2):
        result = json.loads((root / f"round-{r}" / "result.json").read_text())
        assert result["round"] == r and result["num_rounds"] == 2
        assert (root / f"round-{r}" / "uploads" / "manifest.json").is_file()
    final = json.loads((root / "result.json").read_text())
    assert [s["round"] for s in final["rounds"]] == [1, 2] and final["round"] == 2
    assert final["round_dirs"] == ["round-1", "round-2"]
    assert (root / "global_model.pt").is_file()
    assert seeds[0] != seeds[1]  # later rounds draw fresh server-side streams; round 1 keeps one-shot's
    assert strategy.ctx.previous_model is not None


def test_a_client_starts_from_the_global_model_and_refuses_another_architecture(mnist_dir):
    from client_app.task import ClientJob, start_model
    from oneshot_fl.data.datasets import DATASETS
    from oneshot_fl.models.registry import build

    cfg = from_run_config(merge_overrides({"preset": "smoke", "rounds": 2}))
    info = DATASETS["mnist"]
    sent = build("cnn2", info.input_shape, 10, seed=123).state_dict()
    job = ClientJob(cfg, 0, "cnn2", {"server-round": 2, "global-arch": "cnn2"}, sent)
    model = start_model(job, info)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in sent.items())
    fresh = start_model(ClientJob(cfg, 0, "cnn2", {"server-round": 1}), info)
    assert not torch.equal(fresh.state_dict()["classifier.weight"], sent["classifier.weight"])
    wrong = ClientJob(cfg, 0, "lenet", {"server-round": 2, "global-arch": "cnn2"}, sent)
    expected = "^round 2: the server sent a 'cnn2' global model but this node trains 'lenet'"
    with pytest.raises(ValueError, match=expected):
        start_model(wrong, info)  # the round comes from the instruction's server-round
    assert ClientJob(cfg, 0, "cnn2", {}).round == 1  # no server-round: the one-shot round


def test_clients_share_one_init_unless_asked_for_independent_ones(mnist_dir):
    from client_app.task import ClientJob, start_model
    from oneshot_fl.data.datasets import DATASETS

    info = DATASETS["mnist"]
    for init, same in (("shared", True), ("independent", False)):
        cfg = from_run_config(merge_overrides({"preset": "smoke", "local.init": init}))
        a, b = (start_model(ClientJob(cfg, pid, "cnn2", {}), info).state_dict() for pid in (0, 1))
        assert torch.equal(a["classifier.weight"], b["classifier.weight"]) == same, init


def test_local_stream_changes_only_the_training_draws(mnist_dir, monkeypatch):
    """local.stream: stream 0 is the stream every earlier run used (seed, "local", pid); another value trains from
    another generator while the shard and the init stay the fleet's."""
    import client_app.task as task
    from oneshot_fl.seeding import derive_seed

    seen = {}

    class Stop(Exception):
        pass

    def fake_train_local(model, shard, local, device, generator, **kwargs):
        seen["seed"], seen["labels"] = generator.initial_seed(), shard.labels.copy()
        seen["weight"] = model.state_dict()["classifier.weight"].clone()
        raise Stop

    monkeypatch.setattr(task, "train_local", fake_train_local)
    runs = {}
    for stream in (0, 3):
        cfg = from_run_config(merge_overrides({"preset": "smoke", "seed": 7, "local.stream": stream}))
        with pytest.raises(Stop):
            task.train_classifier(task.ClientJob(cfg, 1, "cnn2", {}))
        runs[stream] = dict(seen)
    assert runs[0]["seed"] == derive_seed(7, "local", 1)
    assert runs[3]["seed"] == derive_seed(7, "local", 1, "stream", 3)
    assert (runs[0]["labels"] == runs[3]["labels"]).all()
    assert torch.equal(runs[0]["weight"], runs[3]["weight"])


def test_local_init_draw_changes_only_the_init(mnist_dir, monkeypatch):
    """local.init-draw: draw 0 is every earlier run's init (seed, "init", arch); another value starts the shared
    classifier from another seeded init, the same for every client, and each CVAE from another init, while the
    training stream and the shard stay the fleet's."""
    import client_app.task as task
    from client_app.task import ClientJob, start_model
    from oneshot_fl.data.datasets import DATASETS
    from oneshot_fl.models.registry import build
    from oneshot_fl.seeding import derive_seed

    info = DATASETS["mnist"]
    cfg = {d: from_run_config(merge_overrides({"preset": "smoke", "seed": 7, "local.init-draw": d})) for d in (0, 2)}
    start = {d: start_model(ClientJob(cfg[d], 1, "cnn2", {}), info).state_dict()["classifier.weight"] for d in (0, 2)}
    want = {d: build("cnn2", info.input_shape, info.num_classes, seed=derive_seed(7, "init", "cnn2", *names))
            .state_dict()["classifier.weight"] for d, names in ((0, ()), (2, ("draw", 2)))}
    for d in (0, 2):
        assert torch.equal(start[d], want[d]), d
    assert not torch.equal(start[0], start[2])
    assert torch.equal(start[2], start_model(ClientJob(cfg[2], 0, "cnn2", {}), info).state_dict()["classifier.weight"])

    seen = {}

    class Stop(Exception):
        pass

    def fake_build_cvae(*args, seed, **kwargs):
        seen["cvae_seed"] = seed
        raise Stop

    monkeypatch.setattr(task, "build_cvae", fake_build_cvae)
    for d in (0, 2):
        with pytest.raises(Stop):
            task.train_decoder(task.ClientJob(cfg[d], 1, "cvae", {}))
        assert seen["cvae_seed"] == derive_seed(7, "cvae-init", 1, *(() if d == 0 else ("draw", 2)))
