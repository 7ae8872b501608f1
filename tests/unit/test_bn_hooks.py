"""The BN-statistics hooks' bookkeeping (engine/hooks.py): a forward made with the hooks paused leaves no statistics
behind, the no-BN warning is said once, where it applies and in its words, and removed hooks leave an inactive loss.
(The loss's value by hand: tests/unit/test_losses.py.)"""

import logging

import torch
from torch import nn

from oneshot_fl.engine.hooks import BNStatsLoss

NO_BN = "no client model has BatchNorm layers: the BN-statistics loss is 0"


def _bn():
    bn = nn.BatchNorm1d(2).eval()
    bn.running_mean.copy_(torch.tensor([1.0, 0.0]))
    return bn


def test_a_paused_forward_leaves_no_statistics_of_the_last_one():
    bn = _bn()
    loss = BNStatsLoss([bn])
    x = torch.tensor([[0.0, 1.0], [2.0, 3.0]])  # mean (1, 2), biased var (1, 1): distance sqrt(0 + 4) + 0 = 2
    bn(x)
    assert loss.value().item() == 2.0
    with loss.paused():
        bn(x)
    assert loss.value().item() == 0.0 and loss.per_model[0][0].loss is None
    bn(x)  # the hooks are back
    assert loss.value().item() == 2.0
    loss.remove()
    assert not loss.active and loss.per_model == [] and loss.value().item() == 0.0
    assert len(bn._forward_hooks) == 0


def test_the_no_bn_warning_is_said_where_no_model_has_bn_unless_told_not_to(caplog):
    with caplog.at_level(logging.WARNING, logger="oneshot_fl.engine.hooks"):
        BNStatsLoss([nn.Linear(2, 2)])
        assert [r.getMessage() for r in caplog.records] == [NO_BN]
        caplog.clear()
        BNStatsLoss([nn.Linear(2, 2)], warn=False)  # a teacher bank says it once for the whole fleet
        BNStatsLoss([nn.Linear(2, 2), _bn()])  # one model with BN: a BN loss there is
        BNStatsLoss([_bn()], warn=True)
        assert caplog.records == []
