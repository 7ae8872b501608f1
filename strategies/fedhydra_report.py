"""FedHydra's stratification.json: what MS scored, what the peer check did, and how well the weights the
teacher used track the uploaded label shares. The label counts are read here only: the method never
uses them (a client can lie about them)."""

from __future__ import annotations

import numpy as np
import torch

from oneshot_fl.engine.stratify import Stratification
from oneshot_fl.engine.trust import PeerCheck


def owners_per_class(label_counts: list[np.ndarray], share: float = 0.05) -> list[int]:
    """How many clients hold at least `share` of each class's uploaded examples."""
    counts = np.stack(label_counts).astype(np.float64)  # (m, c)
    totals = counts.sum(axis=0)
    return [int((counts[:, j] >= share * totals[j]).sum()) if totals[j] > 0 else 0 for j in range(counts.shape[1])]


def tracking(u_r: torch.Tensor, label_counts: list[np.ndarray]) -> dict:
    """Per class, the rank correlation between U_r's row and the clients' true shares of that class (the
    ranks of the uploaded counts of class j are the ranks of the shares of class j)."""
    from scipy.stats import spearmanr  # report only: scipy.stats costs a second of CPU to import

    counts = np.stack(label_counts).astype(np.float64)  # (m, c)
    per_class = []
    for j in range(u_r.shape[0]):
        if np.ptp(counts[:, j]) == 0 or float(u_r[j].max() - u_r[j].min()) == 0:
            per_class.append(None)  # a constant row has no ranking
            continue
        per_class.append(float(spearmanr(u_r[j].numpy(), counts[:, j]).statistic))
    defined = [r for r in per_class if r is not None]
    return {"spearman_per_class": per_class, "mean_spearman": float(np.mean(defined)) if defined else float("nan")}


def halved_pairs(trust: torch.Tensor, ms_u_r: torch.Tensor) -> list[tuple[int, int]]:
    """(class, client) pairs that carried weight (U_r >= 0.1 from MS) and a check took at least half of."""
    return [(j, k) for j in range(trust.shape[0]) for k in range(trust.shape[1])
            if float(trust[j, k]) < 0.5 and float(ms_u_r[j, k]) >= 0.1]


def expel_action(check: PeerCheck) -> str:
    """What expel did, in words (the server log's line and stratification.json's server_action)."""
    out = [(k, round(float(check.rejected_share[k]), 3), round(float(check.claim_recognition[k]), 3))
           for k in check.expelled.nonzero().flatten().tolist()]
    median = round(float(check.claim_recognition.median()), 3)
    if not out:
        return "no client both mostly rejected and blind to its peers' images of its classes"
    return (f"left out of the teacher {len(out)} client(s) the peers mostly reject and that do not recognise their "
            f"images of the classes they claim (upload index, rejected share, claim recognition; median {median}): "
            f"{out}")


def one_owner_action(route: str, space: str) -> str:
    if route == "label":
        how = "SA routes by the synthetic label, so a sample's teacher is its class's owner alone"
    elif space == "calibrated":
        how = ("SA routes by output class on calibrated logits: each class is scored by its owner, on the "
               "owner's own scale, and an owner answers an input of a class it never saw less strongly "
               "than it answers its typical input")
    else:
        how = "SA routes by output class, so every owner scores every sample"
    return "one owner per class in the uploaded counts (report only): " + how


def stratification_report(result: Stratification, check: PeerCheck | None, label_counts: list[np.ndarray],
                          route: str, space: str, used_u_r: torch.Tensor) -> dict:
    """stratification.json: the MS scores, the peer check expel read (its per-pair trust included, as a
    diagnostic: `shrunk` lists the weighted pairs the peers mostly disagree with), and how the U_r the teacher
    used compares with the uploaded counts."""
    owners = owners_per_class(label_counts)
    one_owner = all(n == 1 for n in owners)
    report = {**result.as_dict(), "owners_per_class": owners, "one_owner_per_class": one_owner,
              "tracking": {"ms": tracking(result.u_r, label_counts)}}
    actions = []
    if check is not None:
        report["peer_check"] = check.as_dict()
        report["peer_check"]["shrunk"] = [(j, k) for j, k in halved_pairs(check.trust, result.u_r)
                                          if bool(check.verifiable[j, k])]
        report["tracking"]["after_expel"] = tracking(used_u_r, label_counts)
        if check.expelled is not None:
            actions.append(expel_action(check))
    used = "after_expel" if check is not None else "ms"  # the U_r the teacher uses
    report["tracking"]["mean_spearman"] = report["tracking"][used]["mean_spearman"]
    if one_owner:
        actions.append(one_owner_action(route, space))
    report["server_action"] = "; ".join(actions) or ("stratification only (no peer check)" if check is None
                                                      else "peer check made, nobody left out")
    return report
