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
agreement relative to the best-agreed client of that class, t_kj = a_kj / max_k' a_k'j, and the
score becomes u_kj * t_kj (U_r, U_c renormalised). Where the peers know too little of j to judge
the pair is left as scored and reported as unverifiable, not guessed: one owner per class (2c/c
splits), and a one-against-one dispute. A pair needs `judges` peers to be judged (each peer's weight
counts up to min_evidence / judges towards min_evidence): when two clients claim class j and nobody
else knows it, either one's verdict on the other is as good as the other's, and a single judge
hands the class to whichever finds the other's images less convincing, a label-flipped client as
easily as an honest one. `rounds` > 1 repeats the check with the peers weighted by the trusted U_r,
so a poisoner's own veto loses weight too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

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
    u: torch.Tensor  # (c, m) trusted scores
    u_r: torch.Tensor
    u_c: torch.Tensor

    def as_dict(self) -> dict:
        return {"agreement": self.agreement.tolist(), "evidence": self.evidence.tolist(),
                "trust": self.trust.tolist(), "verifiable": self.verifiable.tolist(),
                "u": self.u.tolist(), "u_r": self.u_r.tolist(), "u_c": self.u_c.tolist()}


@torch.no_grad()
def peer_probabilities(models: Sequence[nn.Module], samples: torch.Tensor, device: torch.device,
                       batch_size: int = 1024) -> torch.Tensor:
    """A[k', k, j] = mean_s softmax(model_k'(samples[k, j, s]))[j]: shape (m, m, c).

    samples: (m, c, s, C, H, W), the images MS left for every (client, class) pair."""
    m, c, s = samples.shape[:3]
    flat = samples.reshape(m * c * s, *samples.shape[3:])
    target = torch.arange(c).repeat_interleave(s).repeat(m)  # the class each image was made for
    out = torch.empty(len(models), m, c)
    for i, model in enumerate(models):
        probs = torch.cat([F.softmax(model(flat[f:f + batch_size].to(device)).float(), dim=1).cpu()
                           for f in range(0, len(flat), batch_size)])
        p_target = probs.gather(1, target[:, None]).squeeze(1)
        out[i] = p_target.view(m, c, s).mean(dim=2)
    return out


def peer_check(u: torch.Tensor, u_r: torch.Tensor, agree: torch.Tensor, min_evidence: float = 0.25,
               rounds: int = 2, judges: int = 1) -> PeerCheck:
    """u, u_r: (c, m) from MS; agree: (m_peer, m_owner, c) from `peer_probabilities`."""
    c, m = u.shape
    others = 1.0 - torch.eye(m)  # [k', k]: k' is a peer of k
    weights_r = u_r
    for _ in range(max(1, rounds)):
        peer_w = weights_r.T[:, None, :] * others[:, :, None]  # (k', k, j): competence of k' on j, not k itself
        evidence = peer_w.sum(dim=0)  # (k, j)
        agreement = (peer_w * agree).sum(dim=0) / evidence.clamp_min(1e-12)
        # no single peer counts for more than min_evidence / judges: `judges` peers must share the verdict
        verifiable = peer_w.clamp_max(min_evidence / judges).sum(dim=0) >= min_evidence
        best = torch.where(verifiable, agreement, torch.zeros_like(agreement)).max(dim=0, keepdim=True).values
        trust = torch.where(verifiable, agreement / best.clamp_min(1e-12), torch.ones_like(agreement)).clamp(0, 1)
        trusted = u * trust.T
        weights_r, weights_c = normalise(trusted)
    return PeerCheck(agreement=agreement.T.contiguous(), evidence=evidence.T.contiguous(), trust=trust.T.contiguous(),
                     verifiable=verifiable.T.contiguous(), u=trusted, u_r=weights_r, u_c=weights_c)
