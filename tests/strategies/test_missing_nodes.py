"""Nodes that send nothing: Flower's own error replies (dead SuperNode, crashed ClientApp) and
silence until round-timeout both make a node *missing*, named with the reason, never *rejected*."""

from __future__ import annotations

import json
import time

import pytest
from flwr.app import ConfigRecord, Error, Message, Metadata, RecordDict
from flwr.common.constant import ErrorCode

from oneshot_fl.errors import QuorumError
from tests.strategies.test_fedavg import _reply, _strategy

SUPERLINK = 1  # Flower's SuperLink writes NODE_UNAVAILABLE replies with itself as the sender


def _instruction(node: int, message_id: str) -> Message:
    meta = Metadata(run_id=1, message_id=message_id, src_node_id=0, dst_node_id=node, reply_to_message_id="",
                    group_id="1", created_at=time.time(), ttl=60.0, message_type="train")
    return Message(RecordDict({"config": ConfigRecord({})}), metadata=meta)


def _flower_error(reply_to: str, code: int, reason: str) -> Message:
    meta = Metadata(run_id=1, message_id="", src_node_id=SUPERLINK, dst_node_id=SUPERLINK,
                    reply_to_message_id=reply_to, group_id="1", created_at=time.time(), ttl=60.0,
                    message_type="train")
    return Message(Error(code=code, reason=reason), metadata=meta)


def _sent(strategy, nodes):
    strategy._sent = list(nodes)
    strategy._instructions = [_instruction(n, f"msg-{n}") for n in nodes]


def test_a_dead_supernode_is_missing_under_its_own_id_and_the_quorum_goes_on(tmp_path, mnist_dir):
    strategy = _strategy(tmp_path, **{"num-clients": 4, "min-clients": 2})
    _sent(strategy, [11, 12, 13, 14])
    replies = [_reply(11), _reply(12, seed=1),
               _flower_error("msg-13", ErrorCode.NODE_UNAVAILABLE, "Error: Node Unavailable - no heartbeat"),
               _flower_error("msg-14", ErrorCode.CLIENT_APP_CRASHED, "ClientApp stopped responding.")]
    strategy.aggregate_train(1, replies)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert [c["node_id"] for c in result["clients"]] == [11, 12]
    assert result["rejected"] == [] and result["missing_nodes"] == [13, 14]
    reasons = {m["node_id"]: m["reason"] for m in result["missing"]}
    assert "Node Unavailable" in reasons[13] and "stopped responding" in reasons[14]


def test_silence_until_the_timeout_is_missing_and_a_client_exception_is_rejected(tmp_path, mnist_dir):
    strategy = _strategy(tmp_path, **{"num-clients": 3, "min-clients": 1, "round-timeout": 30.0})
    _sent(strategy, [11, 12, 13])
    from tests.conftest import reply_message

    strategy.aggregate_train(1, [_reply(11), reply_message(None, 12, error="ValueError: partition-id=7")])
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["missing"] == [{"node_id": 13, "reason": "no reply within round-timeout=30s"}]
    assert result["rejected"] == [{"node_id": 12, "reason": "client error: ValueError: partition-id=7"}]


def test_too_few_uploads_after_node_failures_write_nothing(tmp_path, mnist_dir):
    strategy = _strategy(tmp_path, **{"num-clients": 3, "min-clients": 2})
    _sent(strategy, [11, 12, 13])
    with pytest.raises(QuorumError, match=r"1 valid uploads, 2 required.*missing nodes: \[12, 13\]"):
        strategy.aggregate_train(1, [_reply(11), _flower_error("msg-12", ErrorCode.NODE_UNAVAILABLE, "gone")])
    assert not any((tmp_path / "run").glob("*.pt")) and not (tmp_path / "run" / "result.json").exists()


def test_classes_only_a_missing_node_held_are_named_in_the_results(tmp_path, mnist_dir, caplog):
    """2c/c: node 12 held classes 2 and 3 and died; the survivors' counts hold none of them (and class 9
    none by construction): the run goes on and names them, from the uploaded counts."""
    strategy = _strategy(tmp_path, **{"num-clients": 3, "min-clients": 2})
    _sent(strategy, [11, 12, 13])
    first, third = (50, 40, 0, 0, 0, 0, 0, 0, 0, 0), (0, 0, 0, 0, 30, 20, 1, 2, 3, 0)
    replies = [_reply(11, counts=first),
               _flower_error("msg-12", ErrorCode.NODE_UNAVAILABLE, "Error: Node Unavailable - no heartbeat"),
               _reply(13, seed=1, counts=third)]
    with caplog.at_level("WARNING"):
        strategy.aggregate_train(1, replies)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["classes_without_data"] == [2, 3, 9]
    assert "classes [2, 3, 9]: no accepted upload reports an example" in caplog.text


def test_a_fleet_that_holds_every_class_names_none(tmp_path, mnist_dir, caplog):
    strategy = _strategy(tmp_path, **{"num-clients": 2})
    _sent(strategy, [1, 2])
    with caplog.at_level("WARNING"):
        strategy.aggregate_train(1, [_reply(1, counts=(1,) + (0,) * 9), _reply(2, seed=1, counts=(0,) + (5,) * 9)])
    assert json.loads((tmp_path / "run" / "result.json").read_text())["classes_without_data"] == []
    assert "no accepted upload reports" not in caplog.text


def test_a_client_exception_wrapped_by_ray_is_named_by_its_own_message():
    from strategies.base import client_error_message

    wrapped = ("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()\x1b[39m "
               "(pid=6498, ip=192.0.2.2, actor_id=88cc8a72, repr=<flwr...ClientAppActor object at 0x7f32>)\n"
               "  File \"ray_actor.py\", line 65, in run\n    raise ClientAppException(str(ex)) from ex\n"
               "flwr.clientapp.client_app.ClientAppException: \nException ClientAppException occurred. "
               "Message: client p4: non-finite CVAE loss at epoch 2 (lower cvae.lr)'>")
    assert client_error_message(wrapped) == "client p4: non-finite CVAE loss at epoch 2 (lower cvae.lr)"
    assert client_error_message("ValueError: partition-id=7") == "ValueError: partition-id=7"  # not wrapped
    assert client_error_message("Message: '>") == "Message: '>"  # nothing after the marker: the reason as it was
