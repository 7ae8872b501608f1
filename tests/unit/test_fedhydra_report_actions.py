"""stratification.json's server_action names every action the server took, each whole, joined by "; ": on a fleet with
one owner per class where the peer check also decided on expel, both are said."""

import numpy as np
import torch

import strategies.fedhydra_report as fr
from oneshot_fl.engine.stratify import Stratification, normalise
from oneshot_fl.engine.trust import PeerCheck


def test_two_actions_are_joined_whole():
    u = torch.tensor([[0.9, 0.1], [0.1, 0.9]])
    u_r, u_c = normalise(u)
    result = Stratification(u=u, u_r=u_r, u_c=u_c, losses=torch.zeros(2, 2, 1))
    ones = torch.ones(2, 2)
    check = PeerCheck(agreement=ones, evidence=ones, trust=ones, verifiable=ones.bool(),
                      rejected_share=torch.zeros(2), claim_recognition=torch.ones(2),
                      expelled=torch.zeros(2, dtype=torch.bool))
    counts = [np.array([10, 0]), np.array([0, 10])]  # one owner per class
    report = fr.stratification_report(result, check, counts, "label", "logits", used_u_r=u_r)
    assert report["one_owner_per_class"] is True
    assert report["server_action"] == (
        "no client both mostly rejected and blind to its peers' images of its classes; one owner per class in the "
        "uploaded counts (report only): SA routes by the synthetic label, so a sample's teacher is its class's owner "
        "alone")
