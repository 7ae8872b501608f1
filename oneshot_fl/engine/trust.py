"""Peer check of a Model Stratification: does client k's class-j evidence convince the clients that know j?

Model Stratification scores how easily a generator convinces each client of each class. A client
that answers confidently and wrongly (labels flipped, poisoned) scores as high as an honest one,
so the score alone would give it the weight for the classes it claims. Each MS run leaves images
X_kj that convinced client k of class j; the other clients look at them:

  A[k', k, j] = mean over X_kj of p_k'(j | x)                     (peer k' agrees that X_kj is j)
  a_kj = sum_{k' != k} U_r[j, k'] A[k', k, j] / sum_{k' != k} U_r[j, k']   (competent peers' agreement)
  e_kj = sum_{k' != k} U_r[j, k']                                  (how much of j the peers know)

A peer is weighted by its own competence on j, so a client that never saw j cannot veto it; a
label-flipped client's class-j images look like the class it relabelled as j, so the peers that
know j disagree, and a random client's images look like nothing. The trust of a pair is its
agreement relative to the best-agreed client of that class, t_kj = a_kj / max_k' a_k'j. The trust is
`expel`'s signal and a diagnostic in stratification.json; it does not reweight the scores the teacher
uses (docs/decisions.md: the peer check's reweighting of U). Where the peers know too little of j to
judge, the pair gets trust 1 and is reported as unverifiable, not guessed: one owner per class (2c/c
splits), and a one-against-one dispute. A pair needs `judges` peers to be judged (each peer's weight
counts up to min_evidence / judges towards min_evidence): when two clients claim class j and nobody
else knows it, either one's verdict on the other is as good as the other's, and a single judge
hands the class to whichever finds the other's images less convincing, a label-flipped client as
easily as an honest one. `rounds` > 1 repeats the check with each peer weighted by U_r of the scores
times the last round's trust (u_kj t_kj, renormalised), so a poisoner's own veto loses weight too.

`expel` reads the check per client: a client whose judged classes the peers mostly reject AND that recognises
its peers' images of the classes it claims far worse than the fleet's median client is confidently wrong about
its own classes (a label-flipped model, for one); it is left out of the teacher altogether. Weighting cannot mend
such a client: it is wrong exactly where it has data.

Cost. Every judge looks at every other client's MS images: m x (m - 1) x c x s forwards, quadratic in the
fleet (at m = 100 on one CPU thread, minutes beside MS's m x c generator runs). Beyond MAX_PEERS + 1 clients each
client is judged by, and judges, MAX_PEERS peers only (`peer_graph`: its neighbours on a seeded random ring),
so the check grows linearly in m; every sum and mean above runs over those peers. Up to MAX_PEERS + 1 clients
every other client is a peer and nothing changes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from oneshot_fl.engine.stratify import normalise


@dataclass
class PeerCheck:
    agreement: torch.Tensor  # (c, m) a_kj
    evidence: torch.Tensor  # (c, m) e_kj
    trust: torch.Tensor  # (c, m) t_kj in [0, 1]; 1 where unverifiable
    verifiable: torch.Tensor  # (c, m) bool
    rejected_share: torch.Tensor | None = None  # (m,) `expel`: share of a client's judged MS weight the peers reject
    claim_recognition: torch.Tensor | None = None  # (m,) `expel`: how well it recognises the classes it claims
    expelled: torch.Tensor | None = None  # (m,) bool `expel`: clients left out of the teacher

    def as_dict(self) -> dict:
        out = {"agreement": self.agreement.tolist(), "evidence": self.evidence.tolist(),
               "trust": self.trust.tolist(), "verifiable": self.verifiable.tolist()}
        if self.expelled is not None:
            out.update(rejected_share=self.rejected_share.tolist(), claim_recognition=self.claim_recognition.tolist(),
                       expelled=self.expelled.tolist())
        return out


MAX_PEERS = 20  # beyond MAX_PEERS + 1 clients, each client's peers in the check (see the module doc)


def peer_graph(m: int, seed: int, max_peers: int = MAX_PEERS) -> torch.Tensor:
    """(m, m) bool, [k', k]: k' is a peer of k (judges k's MS images, and k judges k''s). Every other client
    while m - 1 <= max_peers; beyond, the max_peers // 2 neighbours on each side of k on a ring of the clients
    in a seeded random order: symmetric, no self, max_peers // 2 * 2 peers each."""
    if m - 1 <= max_peers:
        return ~torch.eye(m, dtype=torch.bool)
    order = torch.randperm(m, generator=torch.Generator().manual_seed(seed))
    position = torch.empty(m, dtype=torch.long)
    position[order] = torch.arange(m)
    gap = (position[:, None] - position[None, :]) % m
    distance = torch.minimum(gap, m - gap)
    return (distance >= 1) & (distance <= max_peers // 2)


def _others(m: int, peers: torch.Tensor | None) -> torch.Tensor:
    """[k', k] = 1.0 where k' is a peer of k: `peers`, or every other client."""
    return 1.0 - torch.eye(m) if peers is None else peers.float()


@torch.no_grad()
def peer_distributions(models: Sequence[nn.Module], samples: torch.Tensor, device: torch.device,
                       batch_size: int = 1024, peers: torch.Tensor | None = None) -> torch.Tensor:
    """D[k', k, j, :] = mean_s softmax(model_k'(samples[k, j, s])): what client k' calls the images
    that convinced client k of class j, shape (m_judges, m, c, c). With `peers` ((m, m) bool, `peer_graph`)
    judge k' looks only at its peers' images (and its own, which the checks never read): the other entries are 0.

    samples: (m, c, s, C, H, W), the images MS left for every (client, class) pair."""
    m, c, s = samples.shape[:3]
    out = torch.zeros(len(models), m, c, c)
    for i, model in enumerate(models):
        owners = (torch.arange(m) if peers is None
                  else torch.nonzero(peers[i] | (torch.arange(m) == i)).flatten())
        flat = samples[owners].reshape(len(owners) * c * s, *samples.shape[3:])
        probs = torch.cat([F.softmax(model(flat[f:f + batch_size].to(device)).float(), dim=1).cpu()
                           for f in range(0, len(flat), batch_size)])
        out[i, owners] = probs.view(len(owners), c, s, -1).mean(dim=2)
    return out


def agreement_of(distributions: torch.Tensor) -> torch.Tensor:
    """A[k', k, j] = D[k', k, j, j]: peer k' agrees that client k's class-j images are j. (m, m, c)."""
    return torch.diagonal(distributions, dim1=2, dim2=3)


def peer_check(u: torch.Tensor, u_r: torch.Tensor, agree: torch.Tensor, *, min_evidence: float, judges: int,
               rounds: int = 2, peers: torch.Tensor | None = None) -> PeerCheck:
    """u, u_r: (c, m) from MS; agree: (m_peer, m_owner, c) from `agreement_of`; peers: `peer_graph` (None: all)."""
    c, m = u.shape
    others = _others(m, peers)  # [k', k]: k' is a peer of k
    weights_r = u_r
    for round_ in range(max(1, rounds)):
        peer_w = weights_r.T[:, None, :] * others[:, :, None]  # (k', k, j): competence of k' on j, not k itself
        evidence = peer_w.sum(dim=0)  # (k, j)
        agreement = (peer_w * agree).sum(dim=0) / evidence.clamp_min(1e-12)
        # no single peer counts for more than min_evidence / judges: `judges` peers must share the verdict
        verifiable = peer_w.clamp_max(min_evidence / judges).sum(dim=0) >= min_evidence
        best = torch.where(verifiable, agreement, torch.zeros_like(agreement)).max(dim=0).values
        # in [0, 1] without a clamp: agreement >= 0, and no verifiable pair's exceeds its class's best
        trust = torch.where(verifiable, agreement / best.clamp_min(1e-12), torch.ones_like(agreement))
        if round_ + 1 < rounds:  # the next round's judges, each weighed by its trusted competence
            weights_r = normalise(u * trust.T)[0]
    return PeerCheck(agreement=agreement.T.contiguous(), evidence=evidence.T.contiguous(), trust=trust.T.contiguous(),
                     verifiable=verifiable.T.contiguous())


# --- does a client recognise its peers' images of the classes it claims? ----------------------------

def recognition(distributions: torch.Tensor, peers: torch.Tensor | None = None) -> torch.Tensor:
    """r[j, k] = max(0, hit - false), (c, m), from D = `peer_distributions` (m judges = the m clients):

      hit[k, j]   = mean over peers k' != k of D[k, k', j, j]          (k calls its peers' class-j images j)
      false[k, j] = mean over peers k' != k, classes i != j of D[k, k', i, j]   (... and their other images j)

    The same MS images as the agreement check, read the other way round: there the peers judge client k's
    images, here client k judges theirs. A client that holds j calls a peer's class-j images j (they show j
    if the peer knows j at all); a label-flipped client calls them the class it relabelled and calls j the
    images of the class it relabelled as j; a client that saw a handful of j rarely calls anything j; and a
    client that calls everything j (trained on shuffled labels, or on j alone) has hit ~ false. No peer has
    to know j as well: k only needs peers whose class-j images show j, which every peer that holds some j
    gives it."""
    m = distributions.shape[0]
    c = distributions.shape[2]
    if m < 2 or c < 2:  # no peer to show a class, or no other class to tell it from: nothing recognised
        return torch.zeros(c, m)
    others = _others(m, peers)  # symmetric: [k, k'] = k' is a peer of k
    count = others.sum(dim=1, keepdim=True).clamp_min(1.0)  # (k, 1) peers of k
    shown = others[:, :, None]
    hit = (torch.diagonal(distributions, dim1=2, dim2=3) * shown).sum(dim=1) / count  # (k, j)
    called = (distributions * shown[..., None]).sum(dim=(1, 2))  # (k, j): every peer image that k calls j
    false = (called - hit * count) / (count * (c - 1))
    return (hit - false).clamp_min(0).T.contiguous()


# --- leave out a client that is confidently wrong about its own classes -----------------------------

def claim_recognition(distributions: torch.Tensor, ms_u_c: torch.Tensor,
                      peers: torch.Tensor | None = None) -> torch.Tensor:
    """R_k = sum_j U_c[j, k] r[j, k], (m,): `recognition` averaged over the classes client k claims (MS's U_c,
    what k is good at by its own account). An honest client recognises its peers' images of its own classes
    wherever a peer made them; a label-flipped one calls them the class it relabelled."""
    return (ms_u_c * recognition(distributions, peers)).sum(dim=0)


def rejected_share(check: PeerCheck, ms_u_r: torch.Tensor) -> torch.Tensor:
    """(m,): sum_j U_r[j, k] (1 - t_kj) / sum_j U_r[j, k] over the pairs the check could judge (MS's U_r: how much
    each claim carried); 0 for a client with no judged pair."""
    weight = ms_u_r * check.verifiable
    return (weight * (1.0 - check.trust)).sum(dim=0) / weight.sum(dim=0).clamp_min(1e-12)


def expel(check_of: Callable[[torch.Tensor], PeerCheck], u: torch.Tensor, distributions: torch.Tensor, *,
          rejected_above: float, recognition_below: float, peers: torch.Tensor | None = None) -> PeerCheck:
    """Leave out every client k in which both signs of a confidently wrong client meet:
      rejected_share_k >= rejected_above                  (the peers reject most of what it claims and they can judge)
      R_k < recognition_below x median_k' R_k'            (it does not recognise their images of its classes)
    Either alone also marks honest clients on Dirichlet 0.1 fleets: an honest owner of classes that are judged by
    peers MS misranks gets rejected, and one whose classes nobody else holds recognises nothing (no peer's images
    show them); it takes both to mark a client. With a strict `<`
    against the median fewer than half the clients can be expelled, and none where the median is 0 (one owner
    per class: nothing to recognise).
    check_of(keep) makes the agreement check on the clients the (m,) bool
    `keep` marks, as if they were the whole fleet: (c, kept) tensors. It runs on every client, then once more on
    the others, so the expelled judge nobody and set no class's best agreement: the rest of the fleet is checked
    as if they had never uploaded. u: (c, m) MS scores. Returns the check widened back to m clients (the expelled:
    trust 0, unjudged) with `rejected_share`, `claim_recognition`, `expelled` set."""
    m = u.shape[1]
    check = check_of(torch.ones(m, dtype=torch.bool))
    ms_u_r, ms_u_c = normalise(u)
    share = rejected_share(check, ms_u_r)
    claims = claim_recognition(distributions, ms_u_c, peers)
    out = (share >= rejected_above) & (claims < recognition_below * claims.median())
    if bool(out.any()):
        check = widened(check_of(~out), ~out)
    return replace(check, rejected_share=share, claim_recognition=claims, expelled=out)


def widened(check: PeerCheck, keep: torch.Tensor) -> PeerCheck:
    """A check made on the clients `keep` marks, as m columns: the others unjudged, trust 0."""
    def column(values: torch.Tensor | None, fill: float) -> torch.Tensor | None:
        if values is None:
            return None
        full = torch.full((*values.shape[:-1], keep.numel()), fill, dtype=values.dtype)
        full[..., keep] = values
        return full

    return replace(check, agreement=column(check.agreement, 0.0), evidence=column(check.evidence, 0.0),
                   trust=column(check.trust, 0.0), verifiable=column(check.verifiable, False))
