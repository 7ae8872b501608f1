"""The peer check's graph: every other client up to MAX_PEERS + 1 clients, a seeded ring of MAX_PEERS peers beyond,
so the check's forwards grow linearly in the fleet; the sums and means run over a client's peers only."""

import pytest
import torch
from torch import nn

from oneshot_fl.engine.trust import MAX_PEERS, peer_check, peer_distributions, peer_graph, recognition


def test_small_fleets_use_every_other_client():
    for m in (2, 5, MAX_PEERS + 1):
        assert torch.equal(peer_graph(m, seed=3), ~torch.eye(m, dtype=torch.bool))


def test_large_fleets_get_a_symmetric_ring_of_max_peers():
    m = 100
    graph = peer_graph(m, seed=3)
    assert torch.equal(graph, graph.T) and not graph.diagonal().any()
    assert graph.sum(dim=1).tolist() == [MAX_PEERS] * m
    assert torch.equal(graph, peer_graph(m, seed=3)) and not torch.equal(graph, peer_graph(m, seed=4))
    # a ring: the graph is connected (a client is reached from client 0 in at most m / MAX_PEERS hops)
    reached = torch.zeros(m, dtype=torch.bool)
    reached[0] = True
    for _ in range(m // MAX_PEERS + 1):
        reached |= (graph[reached].any(dim=0))
    assert reached.all()


def test_ring_by_hand():
    # 7 clients, 2 peers each (1 per side), order given by the seeded permutation: neighbours on that ring only
    graph = peer_graph(7, seed=0, max_peers=2)
    order = torch.randperm(7, generator=torch.Generator().manual_seed(0)).tolist()
    for i, k in enumerate(order):
        assert set(torch.nonzero(graph[k]).flatten().tolist()) == {order[i - 1], order[(i + 1) % 7]}


class _Constant(nn.Module):
    """Answers every input with the same class distribution; counts the images it is shown."""

    def __init__(self, probs):
        super().__init__()
        self.logits = torch.log(torch.tensor(probs))
        self.seen = 0

    def forward(self, x):
        self.seen += len(x)
        return self.logits.expand(len(x), -1)


def test_judges_look_only_at_their_peers_images():
    m, c, s = 5, 2, 3
    models = [_Constant([0.8, 0.2]) for _ in range(m)]
    samples = torch.zeros(m, c, s, 1, 2, 2)
    graph = peer_graph(m, seed=0, max_peers=2)
    d = peer_distributions(models, samples, torch.device("cpu"), peers=graph)
    # each judge sees its 2 peers' and its own images: 3 owners x c x s, not m x c x s
    assert [model.seen for model in models] == [3 * c * s] * m
    for judge in range(m):
        for owner in range(m):
            shown = bool(graph[judge, owner]) or judge == owner
            expected = torch.tensor([0.8, 0.2]) if shown else torch.zeros(2)
            assert torch.allclose(d[judge, owner, 0], expected)


def test_recognition_and_agreement_average_over_peers_only():
    # 4 clients, 2 classes; graph: 0-1, 1-2, 2-3, 3-0 (a ring of 2 peers each)
    graph = torch.zeros(4, 4, dtype=torch.bool)
    for a, b in ((0, 1), (1, 2), (2, 3), (3, 0)):
        graph[a, b] = graph[b, a] = True
    d = torch.zeros(4, 4, 2, 2)
    d[:, :, 0, 0], d[:, :, 1, 1] = 1.0, 1.0  # every judge calls every image its class...
    d[0, 2] = torch.tensor([[0.0, 1.0], [1.0, 0.0]])  # ...but judge 0 swaps owner 2's, which is not its peer
    r = recognition(d, graph)
    assert r.tolist() == [[1.0] * 4, [1.0] * 4]  # hit 1, false 0 for everyone: owner 2 is outside 0's peers
    assert recognition(d)[:, 0].tolist() == pytest.approx([1 / 3, 1 / 3])  # all peers: judge 0 hit 2/3, false 1/3
    # agreement: owner 2's class-0 images judged by its peers 1 and 3 (weights 0.25 each): 1.0, not judge 0's 0
    u = torch.full((2, 4), 1.0)
    u_r = u / 4
    agree = torch.diagonal(d, dim1=2, dim2=3)
    check = peer_check(u, u_r, agree, min_evidence=0.25, judges=2, peers=graph, rounds=1)
    assert check.agreement[0, 2].item() == pytest.approx(1.0)
    assert check.evidence[0, 2].item() == pytest.approx(0.5)  # two peers of weight 0.25
    everyone = peer_check(u, u_r, agree, min_evidence=0.25, judges=2, rounds=1)
    assert everyone.agreement[0, 2].item() == pytest.approx(2 / 3)  # judge 0's 0 counts when all are peers
