"""Expel's rejected-share bar is inclusive: a client whose rejected share lies exactly on the bar (the robust recipe's
expel_rejected) and that recognises its claimed classes below half the median client's is left out; with a strict
`>` it would stay. No other test puts a share on the bar (the mutation report listed `>=` -> `>` as a survivor)."""

import torch

from oneshot_fl.engine.stratify import normalise
from oneshot_fl.engine.trust import PeerCheck, claim_recognition, expel, rejected_share
from strategies.fedhydra import RECIPES

# 3 clients, 2 classes. U_r of client 2: 3 / 10 on class 0, 2 / 10 on class 1 (rows sum to 10); its class-0 claim is
# judged and rejected (trust 0), its class-1 claim judged and accepted (trust 1): rejected share 0.3 / (0.3 + 0.2)
U = torch.tensor([[3.5, 3.5, 3.0], [4.0, 4.0, 2.0]])
TRUST = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
VERIFIABLE = torch.tensor([[False, False, True], [False, False, True]])


def _distributions():
    """D[judge, owner, image class, call]: clients 0 and 1 call every peer image by its class (recognition 1),
    client 2 calls each by the other class (recognition 0)."""
    eye = torch.eye(2)
    d = torch.zeros(3, 3, 2, 2)
    d[0], d[1], d[2] = eye, eye, 1 - eye
    return d


def _check_of(keep):
    """The hand-set trust on the kept clients, as the agreement check would leave it."""
    u, trust = U[:, keep], TRUST[:, keep]
    zeros = torch.zeros_like(u)
    return PeerCheck(agreement=zeros, evidence=zeros, trust=trust, verifiable=VERIFIABLE[:, keep])


def test_a_client_whose_rejected_share_is_exactly_the_recipes_bar_is_expelled():
    bar = RECIPES["robust"].expel_rejected
    assert bar == 0.6
    share = rejected_share(_check_of(torch.ones(3, dtype=torch.bool)), normalise(U)[0])
    # on the bar to the last bit (float32: 0.3 / 0.5 and the bar both round to the float nearest 0.6)
    assert share.tolist() == [0.0, 0.0, torch.tensor(0.6).item()] and bool(share[2] == bar)
    claims = claim_recognition(_distributions(), normalise(U)[1])
    assert claims.tolist() == [1.0, 1.0, 0.0]  # median 1: client 2 is below half of it
    recognition = RECIPES["robust"].expel_recognition
    out = expel(_check_of, U, _distributions(), rejected_above=bar, recognition_below=recognition)
    assert out.expelled.tolist() == [False, False, True]
    assert out.trust[:, 2].tolist() == [0.0, 0.0] and not out.verifiable[:, 2].any()  # the rest checked without it
    # a hair above the share keeps it: the bar is where expel starts
    above = expel(_check_of, U, _distributions(), rejected_above=0.6000001, recognition_below=recognition)
    assert not above.expelled.any()
