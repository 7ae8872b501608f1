"""A failed quorum says how many uploads were of a role the method cannot use, and the ways on."""

import numpy as np
import pytest

from oneshot_fl import archive
from oneshot_fl.config import from_run_config, merge_overrides
from oneshot_fl.errors import QuorumError
from oneshot_fl.models.cvae import build_cvae
from oneshot_fl.models.registry import build
from oneshot_fl.uploads import decode_and_check, encode
from strategies import build_strategy
from tests.conftest import reply_message

MNIST = (1, 28, 28)


def classifier(node):
    return reply_message(encode("classifier", "cnn2", build("cnn2", MNIST, 10, seed=node).state_dict(),
                                np.full(10, 10), node - 1, {"local-test-accuracy": 0.5}), src_node_id=node)


def decoder(node):
    state = build_cvae("cvae-mlp", MNIST, 10, seed=node).decoder.state_dict()
    return reply_message(encode("decoder", "cvae-mlp", state, np.full(10, 10), node - 1, {"train-loss": 1.0},
                                extra={"latent-dim": 2}), src_node_id=node)


def _strategy(tmp_path, name, **over):
    flat = merge_overrides({"preset": "smoke", "eval.test-samples": 100, **over})
    return build_strategy(from_run_config(flat), run_dir=tmp_path / name)


def mixed_archive(tmp_path):
    """A FedMHO fleet's archive: partitions 0-4 uploaded classifiers, 5-9 decoders."""
    fedmho = _strategy(tmp_path, "fedmho", method="fedmho", **{"num-clients": 10})
    replies = [classifier(node) for node in range(1, 6)] + [decoder(node) for node in range(6, 11)]
    uploads = [decode_and_check(r.content, r.metadata.src_node_id, 10, MNIST, fedmho.roles, fedmho.expectation())
               for r in replies]
    return archive.save_uploads(tmp_path / "archive", uploads, fedmho.archive_context())


def test_replaying_a_mixed_fedmho_archive_with_fedavg_names_the_decoders_and_the_ways_on(tmp_path, mnist_dir):
    from launcher.replay import replay

    uploads = mixed_archive(tmp_path)
    with pytest.raises(QuorumError) as failed:
        replay(uploads, ["method='fedavg'"], run_dir=tmp_path / "fedavg")
    message = str(failed.value)
    assert message.startswith("5 valid uploads, 10 required")
    assert "5 of the archive's 10 uploads are decoder uploads, which fedavg cannot use" in message
    assert "set min-clients=5 to go on with the 5 classifier uploads" in message
    assert "replay with a method that uses classifier and decoder uploads: fedmho, fedmho-md, fedmho-sd." in message
    assert message.endswith("No global model written.")
    result = replay(uploads, ["method='fedavg' min-clients=5"], run_dir=tmp_path / "fedavg-5")  # the way on works
    assert [c["role"] for c in result["clients"]] == ["classifier"] * 5


def test_a_live_round_counts_the_rejected_uploads_of_another_role(tmp_path, mnist_dir):
    strategy = _strategy(tmp_path, "live", method="fedavg", **{"num-clients": 4})
    replies = [classifier(1), classifier(2), decoder(3), decoder(4)]
    strategy._sent = [1, 2, 3, 4]
    with pytest.raises(QuorumError) as failed:
        strategy.aggregate_train(1, replies)
    message = str(failed.value)
    assert "2 of the 4 uploads are decoder uploads, which fedavg cannot use (it uses classifier uploads)" in message
    assert "set min-clients=2 to go on with the 2 classifier uploads" in message
    assert "run with a method that uses classifier and decoder uploads: fedmho, fedmho-md, fedmho-sd" in message


def test_a_quorum_missed_for_other_reasons_has_no_role_hint(tmp_path, mnist_dir):
    strategy = _strategy(tmp_path, "short", method="fedavg", **{"num-clients": 3})
    strategy._sent = [1, 2, 3]
    with pytest.raises(QuorumError) as failed:
        strategy.aggregate_train(1, [classifier(1)])
    assert "cannot use" not in str(failed.value) and "min-clients=1" not in str(failed.value)
