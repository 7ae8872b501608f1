"""FedHydra's robust mode, pinned by hand: the bounded MS score, the peer check against a label-flipped
client, class-routed SA on a two-owner fleet, and the paper mode reproducing Eq. 2."""

import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from oneshot_fl.engine.stratify import (_result, mean_probability, normalise, relative_range,
                                        stratify, stratify_sequential)
from oneshot_fl.engine.teachers import Calibration, RunningCalibration, StratifiedAggregation, calibrate
from oneshot_fl.engine.trust import (PeerCheck, agreement_of, claim_recognition, expel, peer_check,
                                     peer_distributions, recognition, rejected_share, widened)
from oneshot_fl.models.generator import GeneratorSpec
from strategies.fedhydra import RECIPES, weigh
from strategies.fedhydra_report import owners_per_class, tracking


# --- the MS score ------------------------------------------------------------------------------

def test_prob_auc_stays_finite_and_ordered_when_the_ce_reaches_zero():
    # client 0 is convinced at step 2, client 1 only at step 3: Eq. 2 cannot tell them apart
    losses = torch.tensor([[[2.3, 0.5, 0.0, 0.0]], [[2.3, 1.0, 0.2, 0.0]]])  # (m=2, c=1, T=4)
    paper = relative_range(losses)
    assert paper[0, 0] == paper[1, 0] == pytest.approx(2.3 / 1e-8, rel=1e-6)  # a tie at ~2.3e8
    score = mean_probability(losses)
    by_hand = [(math.exp(-2.3) + math.exp(-0.5) + 1 + 1) / 4,
               (math.exp(-2.3) + math.exp(-1.0) + math.exp(-0.2) + 1) / 4]
    assert score[:, 0].tolist() == pytest.approx(by_hand, rel=1e-6)
    assert torch.isfinite(score).all() and score[0, 0] > score[1, 0]
    # U is (c, m): the faster client gets the larger share of the class
    strat = _result(losses, 0.0, score="prob-auc")
    assert strat.u_r[0].tolist() == pytest.approx([by_hand[0] / sum(by_hand), by_hand[1] / sum(by_hand)], rel=1e-6)


def test_unknown_score_is_refused():
    with pytest.raises(ValueError, match=r"^stratification score 'bogus': use paper or prob-auc$"):
        _result(torch.ones(1, 1, 2), 0.0, score="bogus")


class _Linear(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.fc = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(weight)

    def forward(self, x):
        return self.fc(x.flatten(1))


SPEC = GeneratorSpec(nz=8, ngf=4, image_size=4, channels=1)


def _two_linear_clients():
    g = torch.Generator().manual_seed(0)
    return [_Linear(torch.randn(3, 16, generator=g)).eval() for _ in range(2)]


def test_paper_mode_reproduces_the_published_score_on_a_fixed_seed():
    """stratify_sequential with the paper score equals Eq. 2 applied to an independent replay of the runs."""
    models = _two_linear_clients()
    got = stratify_sequential(models, 3, SPEC, steps=5, batch=4, lr=1e-2, seed=7, device=torch.device("cpu"))
    from oneshot_fl.engine.stratify import _adam, _class_start
    u = torch.zeros(3, 2)
    for cls in range(3):
        for k, model in enumerate(models):
            gen, z = _class_start(SPEC, cls, 4, 7, torch.device("cpu"))
            opt, curve = _adam(gen.parameters(), 1e-2), []
            for _ in range(5):
                loss = F.cross_entropy(model(gen(z)), torch.full((4,), cls))
                curve.append(float(loss.detach()))
                opt.zero_grad()
                loss.backward()
                opt.step()
            u[cls, k] = (max(curve) - min(curve)) / (min(curve) + 1e-8)
    assert got.score == "paper"
    assert torch.allclose(got.u, u, rtol=1e-5)
    u_r, u_c = normalise(u)
    assert torch.allclose(got.u_r, u_r, rtol=1e-5) and torch.allclose(got.u_c, u_c, rtol=1e-5)


def test_early_stop_pads_with_the_last_loss_and_counts_the_steps():
    models = _two_linear_clients()
    full = stratify_sequential(models, 3, SPEC, steps=6, batch=4, lr=5e-2, seed=1, device=torch.device("cpu"),
                               score="prob-auc")
    threshold = float(full.losses[:, :, 2].max()) + 1e-6  # every run is below it from step 2 on (or earlier)
    stopped = stratify_sequential(models, 3, SPEC, steps=6, batch=4, lr=5e-2, seed=1, device=torch.device("cpu"),
                                  score="prob-auc", stop_loss=threshold)
    assert (stopped.steps_run <= 2).all()
    for k in range(2):
        for j in range(3):
            t = int(stopped.steps_run[k, j])
            assert torch.allclose(stopped.losses[k, j, :t + 1], full.losses[k, j, :t + 1])
            assert (stopped.losses[k, j, t:] == stopped.losses[k, j, t]).all()


def test_batched_and_sequential_keep_the_same_samples():
    models = _two_linear_clients()
    kw = dict(steps=3, batch=4, lr=1e-2, seed=2, device=torch.device("cpu"), score="prob-auc", keep_samples=2)
    a, b = stratify_sequential(models, 3, SPEC, **kw), stratify(models, 3, SPEC, **kw)
    assert a.samples.shape == b.samples.shape == (2, 3, 2, 1, 4, 4)
    assert torch.allclose(a.samples, b.samples, atol=1e-4)
    assert torch.allclose(a.u, b.u, rtol=1e-4)


def test_batched_early_stop_stops_each_pair_where_it_is_convinced_then_pads():
    """The vmapped MS stops each (client, class) run at its own first step t with a CE below stop_loss, as the
    sequential loop does: steps_run = t for that pair, its losses padded with step t's, the others run on."""
    models = _two_linear_clients()
    kw = dict(steps=6, batch=4, lr=5e-2, seed=1, device=torch.device("cpu"), score="prob-auc")
    full = stratify(models, 3, SPEC, **kw)
    assert full.steps_run.tolist() == [[6] * 3] * 2 and full.seconds > 0
    threshold = 0.1  # one pair is below it by step 2, two by step 5, three never get there
    assert float((full.losses - threshold).abs().min()) > 0.015  # no CE near it: rounding cannot move a decision
    first = [[next((t for t in range(6) if float(full.losses[k, j, t]) < threshold), 6) for j in range(3)]
             for k in range(2)]
    assert min(map(min, first)) <= 2 and max(map(max, first)) == 6, first  # both kinds on this fleet
    stopped = stratify(models, 3, SPEC, **kw, stop_loss=threshold)
    assert stopped.steps_run.tolist() == first
    for k in range(2):
        for j in range(3):
            t = first[k][j]
            assert torch.allclose(stopped.losses[k, j, :t + 1], full.losses[k, j, :t + 1], atol=1e-6)
            if t < 6:
                assert (stopped.losses[k, j, t:] == stopped.losses[k, j, t]).all()
    never = stratify(models, 3, SPEC, **kw, stop_loss=0.0)  # 0 = never stop, even at zero loss
    assert never.steps_run.tolist() == [[6] * 3] * 2 and torch.allclose(never.losses, full.losses)
    assert full.samples is None  # nothing kept unless asked


def test_batched_and_sequential_stop_at_the_same_step_and_give_the_same_u_and_samples():
    """A fleet on which, at stop_loss 0.1, four (client, class) runs stop early, two at different steps of the same
    client, and two never do (their CE stays above 0.2 over the 8 steps): the vmapped MS gives the loop's steps_run,
    U and kept images (an early-stopped pair's images are its generator's output at its stopping step)."""
    models = _two_linear_clients()
    kw = dict(steps=8, batch=4, lr=5e-2, seed=1, device=torch.device("cpu"), score="prob-auc", keep_samples=2)
    full = stratify_sequential(models, 3, SPEC, **{**kw, "keep_samples": 0})
    # the threshold sits in a gap of every curve (no CE within 0.015 of it): rounding cannot move a decision
    assert float((full.losses - 0.1).abs().min()) > 0.015
    first = [[next((t for t in range(8) if float(full.losses[k, j, t]) < 0.1), 8) for j in range(3)] for k in range(2)]
    early = [(k, j) for k in range(2) for j in range(3) if first[k][j] < 7]
    assert len(early) >= 3 and len({first[k][j] for k, j in early}) >= 2 and sum(r.count(8) for r in first) >= 2, first
    seq = stratify_sequential(models, 3, SPEC, **kw, stop_loss=0.1)
    bat = stratify(models, 3, SPEC, **kw, stop_loss=0.1)
    assert seq.steps_run.tolist() == bat.steps_run.tolist() == first
    assert torch.allclose(bat.losses, seq.losses, atol=1e-5)
    assert torch.allclose(bat.u, seq.u, atol=1e-5, rtol=0)
    assert torch.allclose(bat.u_r, seq.u_r, atol=1e-5, rtol=0) and torch.allclose(bat.u_c, seq.u_c, atol=1e-5, rtol=0)
    assert bat.samples.shape == seq.samples.shape == (2, 3, 2, 1, 4, 4)
    for k, j in early:
        assert torch.allclose(bat.samples[k, j], seq.samples[k, j], atol=1e-5), (k, j)
    assert torch.allclose(bat.samples, seq.samples, atol=1e-4)  # and the pairs that ran every step
    # an early-stopped pair's images are not its generator's last ones: it stopped well before the end
    k, j = min(early, key=lambda pair: first[pair[0]][pair[1]])
    unstopped = stratify_sequential(models, 3, SPEC, **kw)
    assert not torch.allclose(unstopped.samples[k, j], seq.samples[k, j], atol=1e-3)


def test_each_class_starts_from_its_own_seeded_generator_and_noise():
    """One run seed fixes every class's start (paired across clients); classes and seeds differ."""
    from oneshot_fl.engine.stratify import _class_start
    from oneshot_fl.seeding import derive_seed

    cpu = torch.device("cpu")
    g0, z0 = _class_start(SPEC, 0, 4, seed=7, device=cpu)
    g0b, z0b = _class_start(SPEC, 0, 4, seed=7, device=cpu)
    assert torch.equal(z0, z0b) and all(torch.equal(a, b) for a, b in zip(g0.parameters(), g0b.parameters()))
    expected = torch.randn(4, SPEC.nz, generator=torch.Generator().manual_seed(derive_seed(7, "ms", 0)))
    assert torch.equal(z0, expected)
    _, z1 = _class_start(SPEC, 1, 4, seed=7, device=cpu)
    _, z0_other = _class_start(SPEC, 0, 4, seed=8, device=cpu)
    assert not torch.equal(z0, z1) and not torch.equal(z0, z0_other)


def test_ms_says_what_it_is_doing_per_class_and_per_client_chunk(caplog):
    """Issue 11: MS logs one progress line per class (sequential) / client chunk (vmapped), with its
    count, elapsed time and ETA; its optimiser is Adam at the given lr with DCGAN betas."""
    import logging
    import re

    from oneshot_fl.engine.stratify import _adam

    models = _two_linear_clients()
    kw = dict(steps=2, batch=4, lr=1e-2, seed=0, device=torch.device("cpu"), score="prob-auc")
    with caplog.at_level(logging.INFO, logger="oneshot_fl.engine.stratify"):
        seq = stratify_sequential(models, 3, SPEC, **kw)
        stratify(models, 3, SPEC, **kw, clients_per_call=1)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("stratification:")]
    pattern = r"^stratification: {}/{} {} done \(\d+s, ETA \d\d:\d\d\)$"
    expected = [pattern.format(i, 3, "classes") for i in (1, 2, 3)] + [pattern.format(i, 2, "clients") for i in (1, 2)]
    assert len(lines) == 5 and all(re.match(e, line) for e, line in zip(expected, lines)), lines
    assert seq.steps_run.dtype == torch.long and 0 < seq.seconds < 600
    opt = _adam([nn.Parameter(torch.zeros(1))], lr=0.003)
    assert opt.param_groups[0]["lr"] == 0.003 and opt.param_groups[0]["betas"] == (0.5, 0.999)


# --- the peer check ----------------------------------------------------------------------------

def _onehot_images(c):
    return torch.eye(c).view(c, 1, 1, c)  # image of class j = the one-hot vector e_j


def test_peer_check_trusts_a_label_flipped_client_a_twentieth_as_much_as_the_honest_ones_by_hand():
    """Three honest clients answer class j on e_j; a fourth answers j on e_{j-1} (rows rolled by one),
    more confidently than any honest one. Its MS images for class j are e_{j-1}. With a = e^3 / (e^3 + 3),
    b = 1 / (e^3 + 3) and f = 1 / (e^6 + 3) (the flipper on an honest class-j image): round 1 weighs the
    judges by MS's U_r (0.5 / 2.4 each honest, 0.9 / 2.4 the flipper), so an honest client's agreement is
    (2 x 0.2083 a + 0.375 f) / 0.7917 = 0.4590 and the flipper's b = 0.0433, trust 0.0944; round 2 weighs the
    flipper by 0.9 x 0.0944 against 0.5 each honest: (2 x 0.3155 a + 0.0536 f) / 0.6846 = 0.8021, trust
    b / 0.8021 = 0.0540."""
    c = 4
    honest_w = 3.0 * torch.eye(c)
    flipped_w = 6.0 * torch.roll(torch.eye(c), 1, dims=0)  # logit j reads input j-1
    models = [_Linear(honest_w), _Linear(honest_w), _Linear(honest_w), _Linear(flipped_w)]
    images = _onehot_images(c)
    samples = torch.stack([images] * 3 + [torch.roll(images, 1, dims=0)])[:, :, None]  # (m, c, s=1, 1, 1, c)
    agree = agreement_of(peer_distributions(models, samples, torch.device("cpu")))
    p_honest = math.exp(3) / (math.exp(3) + 3)
    assert agree[0, 1, 2].item() == pytest.approx(p_honest, rel=1e-5)  # honest peer on an honest image
    assert agree[0, 3, 2].item() == pytest.approx(1 / (math.exp(3) + 3), rel=1e-5)  # honest peer on the flipper's
    u = torch.tensor([[0.5, 0.5, 0.5, 0.9]]).repeat(c, 1)  # the flipper scores highest: confident
    u_r, _ = normalise(u)
    assert (u_r[:, 3] > 0.3).all()  # MS alone would give it a third of every class
    check = peer_check(u, u_r, agree, min_evidence=0.25, judges=1)
    assert check.verifiable.all()
    assert check.agreement[:, 0].tolist() == pytest.approx([0.8021] * c, abs=1e-4)
    assert check.trust[:, 3].tolist() == pytest.approx([0.0540] * c, abs=1e-4), check.trust
    assert (check.trust[:, :3] == 1.0).all()


def test_peer_check_with_two_judges_still_vetoes_a_flipper_that_three_honest_peers_disagree_with():
    c = 4
    honest_w, flipped_w = 3.0 * torch.eye(c), 6.0 * torch.roll(torch.eye(c), 1, dims=0)
    models = [_Linear(honest_w), _Linear(honest_w), _Linear(honest_w), _Linear(flipped_w)]
    images = _onehot_images(c)
    samples = torch.stack([images] * 3 + [torch.roll(images, 1, dims=0)])[:, :, None]
    agree = agreement_of(peer_distributions(models, samples, torch.device("cpu")))
    u = torch.tensor([[0.5, 0.5, 0.5, 0.9]]).repeat(c, 1)
    u_r, _ = normalise(u)  # 0.5 / 2.4 = 0.208 per honest client: capped at 0.125, three of them make 0.375
    check = peer_check(u, u_r, agree, min_evidence=0.25, judges=2)
    assert check.verifiable.all() and check.trust[:, 3].tolist() == pytest.approx([0.0540] * c, abs=1e-4)


def test_a_one_against_one_dispute_is_undecidable_with_two_judges():
    """Class 0 is claimed by A (honest) and B (label-flipped) alike; C knows nothing of it. B calls
    A's class-0 images something else (agreement 0.02), A finds B's images only half-unlike class 0
    (0.3). With a single judge per pair, B's verdict alone takes A's weight (the flipper wins); with
    judges=2 neither A nor B has two peers who know class 0, so both are left as scored."""
    u = torch.tensor([[0.9, 0.9, 0.01],   # class 0: A, B
                      [0.01, 0.01, 0.9]])  # class 1: C
    u_r, _ = normalise(u)  # class 0: [0.497, 0.497, 0.0055]
    agree = torch.full((3, 3, 2), 0.1)  # [judge, judged, class]
    agree[1, 0, 0], agree[0, 1, 0] = 0.02, 0.3
    one = peer_check(u, u_r, agree, min_evidence=0.25, judges=1, rounds=1)
    # A's agreement (0.497 * 0.02 + 0.0055 * 0.1) / 0.503 = 0.0209; B's (0.497 * 0.3 + 0.0055 * 0.1) / 0.503 = 0.2975
    assert one.verifiable[0, 0] and one.verifiable[0, 1]
    assert one.trust[0, 0].item() == pytest.approx(0.0209 / 0.2975, rel=1e-2) and one.trust[0, 1] == 1.0
    two = peer_check(u, u_r, agree, min_evidence=0.25, judges=2, rounds=1)
    # capped at 0.125 per judge: A's evidence min(0.497, 0.125) + 0.0055 = 0.1305 < 0.25
    assert not two.verifiable[0, 0] and not two.verifiable[0, 1]
    assert two.trust[0, :2].tolist() == [1.0, 1.0]  # left as scored


def test_peer_check_second_round_reweights_the_judges_by_hand():
    """The dispute above with one judge. Round 1 (MS's U_r, class 0 [0.4972, 0.4972, 0.0055]):
    A's evidence 0.4972 + 0.0055 = 0.5028, agreement (0.4972 * 0.02 + 0.0055 * 0.1) / 0.5028 = 0.0209; B's
    (0.4972 * 0.3 + 0.0055 * 0.1) / 0.5028 = 0.2978; C's 0.1 (evidence 0.9945); trust 0.0701, 1, 0.3358, so
    so round 2 weighs the judges of class 0 by 0.9 * [0.0701, 1, 0.0034 / 0.9] normalised = [0.0653, 0.9312,
    0.0035]: A's evidence 0.9312 + 0.0035 = 0.9347, agreement (0.9312 * 0.02 + 0.0035 * 0.1) / 0.9347 = 0.0203;
    B's evidence 0.0653 + 0.0035 = 0.0688 is now below 0.25 (unverifiable, trust 1); C's evidence 0.9965,
    agreement 0.1 is class 0's best; trust A 0.0203 / 0.1 = 0.2030."""
    u = torch.tensor([[0.9, 0.9, 0.01], [0.01, 0.01, 0.9]])
    u_r, _ = normalise(u)
    agree = torch.full((3, 3, 2), 0.1)
    agree[1, 0, 0], agree[0, 1, 0] = 0.02, 0.3
    one = peer_check(u, u_r, agree, min_evidence=0.25, judges=1, rounds=1)
    assert one.evidence[0].tolist() == pytest.approx([0.5028, 0.5028, 0.9945], abs=1e-4)
    assert one.agreement[0].tolist() == pytest.approx([0.0209, 0.2978, 0.1], abs=1e-4)
    assert one.trust[0].tolist() == pytest.approx([0.0701, 1.0, 0.3358], abs=1e-4)
    # class 1: C's only peers hold 0.0109 each (unverifiable), A and B are judged by C, all agreements 0.1
    assert one.evidence[1].tolist() == pytest.approx([0.9891, 0.9891, 0.0217], abs=1e-4)
    assert one.verifiable[1].tolist() == [True, True, False] and one.trust[1].tolist() == [1.0, 1.0, 1.0]
    two = peer_check(u, u_r, agree, min_evidence=0.25, judges=1)  # two rounds by default
    assert two.evidence[0].tolist() == pytest.approx([0.9347, 0.0688, 0.9965], abs=1e-4)
    assert two.agreement[0].tolist() == pytest.approx([0.0203, 0.2899, 0.1], abs=1e-4)
    assert two.verifiable[0].tolist() == [True, False, True]
    assert two.trust[0].tolist() == pytest.approx([0.2030, 1.0, 1.0], abs=1e-4)


def test_peer_check_report_names_every_field():
    u = torch.tensor([[0.9, 0.9, 0.01], [0.01, 0.01, 0.9]])
    u_r, _ = normalise(u)
    check = peer_check(u, u_r, torch.full((3, 3, 2), 0.1), min_evidence=0.25, judges=1)
    d = check.as_dict()
    assert set(d) == {"agreement", "evidence", "trust", "verifiable"}
    for key in d:
        assert d[key] == getattr(check, key).tolist(), key


def test_peer_check_leaves_a_one_owner_class_as_scored_and_says_so():
    u = torch.tensor([[0.9, 0.01], [0.01, 0.9]])  # (c=2, m=2): each class has one owner
    u_r, _ = normalise(u)
    agree = torch.full((2, 2, 2), 0.01)  # nobody agrees with anybody: out-of-support images
    check = peer_check(u, u_r, agree, min_evidence=0.25, judges=1)
    assert not check.verifiable[0, 0] and not check.verifiable[1, 1]
    assert check.trust[0, 0] == 1.0 and check.trust[1, 1] == 1.0
    assert (check.trust == 1.0).all()  # the judged non-owners agree as little as anyone: nobody is distrusted


def _dispute_fleet():
    """4 classes, inputs one-hot. H knows classes 0 and 1; F is a client that knew 0 and 1 with its
    classifier rows rolled (it calls e_0 "1" and e_1 "2"); G knows 2 and 3. Classes 1 and 2 are each
    claimed by one honest client and F, and nobody else knows them."""
    c = 4
    h = torch.zeros(c, c)
    h[0, 0] = h[1, 1] = 4.0
    g = torch.zeros(c, c)
    g[2, 2] = g[3, 3] = 4.0
    f = torch.roll(h, 1, dims=0) * 1.5  # row j+1 = H's row j, louder
    models = [_Linear(h), _Linear(f), _Linear(g)]
    images = _onehot_images(c)  # image j = e_j
    # MS images: each client's class-j images are the input it answers j to (e_j; F's class j is e_{j-1})
    samples = torch.stack([images, torch.roll(images, 1, dims=0), images])[:, :, None]  # (m, c, s=1, 1, 1, c)
    u = torch.tensor([[0.9, 0.01, 0.01],   # class 0: H
                      [0.9, 0.95, 0.01],   # class 1: H and F
                      [0.01, 0.95, 0.9],   # class 2: F and G
                      [0.01, 0.01, 0.9]])  # class 3: G
    return models, samples, u


# --- SA routed by output class (one owner per class) -------------------------------------------

def test_class_routed_sa_lets_other_owners_speak_on_a_two_owner_fleet():
    """A owns classes {0, 1}, B owns {2, 3}. On a sample labelled 0 that B claims as class 2, the
    label-routed (paper) teacher gives B's classes no say (their logits are 0 whatever B answers); the
    class-routed one gives class 2 B's logit."""
    u = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])  # (c, m)
    u_r, u_c = normalise(u)  # U_c's columns: A [0.5, 0.5, 0, 0], B [0, 0, 0.5, 0.5]
    logits = torch.tensor([[[4.0, 0.0, -5.0, -5.0]], [[-5.0, -5.0, 3.0, 0.0]]])  # (m=2, b=1, c=4)
    label0 = torch.tensor([0])
    # label route: U_r[0] = [1, 0] picks A alone, each class weighted by A's U_c: [0.5 x 4, 0.5 x 0, 0, 0]
    paper = StratifiedAggregation(u_r, u_c, "logits", "label")(logits, label0)[0]
    assert paper.tolist() == pytest.approx([2.0, 0.0, 0.0, 0.0], abs=1e-6)
    louder_b = logits.clone()
    louder_b[1, 0, 2] = 30.0
    assert torch.equal(StratifiedAggregation(u_r, u_c, "logits", "label")(louder_b, label0)[0], paper)
    # class route: each class is its owner's logit, A's for 0 and 1, B's for 2 and 3
    routed = StratifiedAggregation(u_r, u_c, "logits", "class")(logits, label0)[0]
    assert routed.tolist() == pytest.approx([4.0, 0.0, 3.0, 0.0], abs=1e-6)
    assert float(F.softmax(routed, 0)[2]) > 0.25 > 0.1 > float(F.softmax(paper, 0)[2])
    # the class-routed teacher ignores the label: it is the same teacher on synthetic and test data
    assert torch.equal(StratifiedAggregation(u_r, u_c, "logits", "class")(logits, None)[0], routed)


def test_logit_space_class_route_by_hand():
    u_r = torch.tensor([[0.75, 0.25], [0.5, 0.5]])  # (c=2, m=2)
    logits = torch.tensor([[[2.0, 1.0]], [[0.0, 4.0]]])
    out = StratifiedAggregation(u_r, u_r, "logits", "class")(logits)[0]
    assert out.tolist() == pytest.approx([0.75 * 2.0 + 0.25 * 0.0, 0.5 * 1.0 + 0.5 * 4.0])


def test_class_routed_logits_on_a_two_owner_fleet_leave_the_non_owners_classes_almost_no_mass():
    """Issue 18's design, by hand. A owns {0, 1}, B owns {2, 3}; on a class-0 input A answers with
    large logits and B, which never saw class 0, with smaller ones that still put most of its
    probability on its own class 2 (softmax: 0.88). Logits keep B's weaker answer weaker: under 1 %."""
    u_r = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    logits = torch.tensor([[[8.0, 0.0, -4.0, -4.0]], [[-4.0, -4.0, 3.0, 1.0]]])  # (m=2, b=1, c=4)
    assert float(F.softmax(logits[1, 0], 0)[2]) > 0.85
    out = StratifiedAggregation(u_r, u_r, "logits", "class")(logits)[0]
    assert out.tolist() == pytest.approx([8.0, 0.0, 3.0, 1.0])  # each class: its owner's own logit
    teacher = F.softmax(out, dim=0)
    z = math.exp(8) + 1 + math.exp(3) + math.exp(1)
    assert teacher.tolist() == pytest.approx([math.exp(8) / z, 1 / z, math.exp(3) / z, math.exp(1) / z], abs=1e-6)
    assert float(teacher[2:].sum()) < 0.01


def test_calibrate_standardises_each_client_by_its_top_logit_over_the_batch_by_hand():
    # client 0: top logits 3 and 1 (mean 2, sample std sqrt 2); client 1: top logits 10 and 4 (mean 7, std 3 sqrt 2)
    logits = torch.tensor([[[3.0, 0.0], [1.0, -1.0]],
                           [[10.0, 2.0], [0.0, 4.0]]])  # (m=2, b=2, c=2)
    out = calibrate(logits)
    r2 = math.sqrt(2)
    assert out[0].flatten().tolist() == pytest.approx([1 / r2, -2 / r2, -1 / r2, -3 / r2])
    assert out[1].flatten().tolist() == pytest.approx([3 / (3 * r2), -5 / (3 * r2), -7 / (3 * r2), -3 / (3 * r2)])
    # one input has no batch statistics: each client's logits shifted by their own top only
    assert calibrate(logits[:, :1]).flatten().tolist() == pytest.approx([0.0, -3.0, 0.0, -8.0])


def test_calibrate_undoes_a_scaled_client_floors_a_constant_one_and_holds_its_statistics_fixed():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 8, 4, generator=g)
    scaled = logits.clone()
    scaled[1] = 10 * scaled[1] + 5  # a client x10 (and shifted): the same calibrated logits
    assert torch.allclose(calibrate(scaled), calibrate(logits), atol=1e-5)
    constant = logits.clone()
    constant[2] = torch.tensor([1.0, 0.0, -1.0, 2.0])  # answers every input alike: no spread at all
    spreads = logits[:2].amax(dim=2).std(dim=1)
    floor = 0.1 * min(spreads[0], spreads[1])  # the median of the spreads (s0, s1, 0)
    out = calibrate(constant)
    assert torch.allclose(out[2], (constant[2] - 2.0) / floor, atol=1e-5)  # shifted by its top, divided by the floor
    assert bool(torch.isfinite(out).all())
    # a fleet whose top logits never vary over the batch has no scale at all: logits only shifted by the mean top
    flat = torch.tensor([[[2.0, 0.0], [0.0, 2.0]], [[6.0, 0.0], [0.0, 6.0]]])
    assert calibrate(flat).flatten().tolist() == pytest.approx([0.0, -2.0, -2.0, 0.0, 0.0, -6.0, -6.0, 0.0])
    # the statistics are constants to autograd: d out / d z = 1 / spread, the same for every entry of a client
    z = logits.clone().requires_grad_(True)
    calibrate(z)[0].sum().backward()
    assert torch.allclose(z.grad[0], torch.full_like(z.grad[0], 1.0 / float(spreads[0])))
    assert float(z.grad[1:].abs().sum()) == 0.0


def test_calibrated_sa_on_a_two_owner_fleet_hands_the_input_to_its_owner_whatever_the_offsets():
    """Issue 18's design, by hand. A owns {0, 1}, B owns {2, 3}; B answers every input 6 logits louder
    than A (trained longer, or on easier classes). On the batch's class-0 input A answers more strongly
    than it answers its typical input, B less; raw logits (the paper's space) give the input to B's class 2
    by B's offset alone, calibrated logits give it to class 0 and leave the non-owner's classes the mass
    that B's own relative confidence earns them."""
    u_r = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    a = torch.tensor([[5.0, 0.0, -3.0, -3.0], [0.0, 3.0, -3.0, -3.0], [1.0, 0.0, -3.0, -3.0], [0.0, 1.0, -3.0, -3.0]])
    b = torch.tensor([[-3.0, -3.0, 8.0, 6.0], [-3.0, -3.0, 7.0, 6.0], [-3.0, -3.0, 11.0, 6.0], [-3.0, -3.0, 6.0, 10.0]])
    logits = torch.stack([a, b])  # (m=2, b=4: a class-0, class-1, class-2, class-3 input, c=4)
    raw = StratifiedAggregation(u_r, u_r, "logits", "class")(logits)
    assert raw[0].argmax() == 2  # B's raw 8 beats A's 5 on A's own class-0 input
    calibrated = StratifiedAggregation(u_r, u_r, "calibrated", "class")(logits)
    top_a, top_b = torch.tensor([5.0, 3.0, 1.0, 1.0]), torch.tensor([8.0, 7.0, 11.0, 10.0])
    expected = torch.cat([(a[0, :2] - top_a.mean()) / top_a.std(), (b[0, 2:] - top_b.mean()) / top_b.std()])
    assert calibrated[0].tolist() == pytest.approx(expected.tolist(), abs=1e-6)
    assert calibrated.argmax(dim=1).tolist() == [0, 1, 2, 3]  # every input to its owner's class
    # on the class-0 input B's classes keep the mass of B's answer relative to its typical one
    teacher = F.softmax(calibrated[0], dim=0)
    assert float(teacher[0]) > 0.6 and 0.05 < float(teacher[2]) < float(teacher[0])


# --- knobs and reporting -----------------------------------------------------------------------

def test_owner_count_and_tracking_by_hand():
    counts = [np.array([100, 0, 10]), np.array([0, 50, 90]), np.array([0, 0, 0])]
    assert owners_per_class(counts) == [1, 1, 2]  # class 2: 10 % and 90 %, both above the 5 % share
    assert owners_per_class([np.array([100, 3]), np.array([0, 97])]) == [1, 1]  # 3 % is below it
    u_r = torch.tensor([[0.8, 0.1, 0.1], [0.1, 0.3, 0.6], [0.2, 0.5, 0.3]])  # (c, m)
    t = tracking(u_r, counts)
    # class 0 shares (1, 0, 0) vs (0.8, 0.1, 0.1): ranks (3, 1.5, 1.5) both -> 1.0;
    # class 1 shares (0, 1, 0) vs (0.1, 0.3, 0.6): ranks (1.5, 3, 1.5) vs (1, 2, 3), centred
    #   (-0.5, 1, -0.5) . (-1, 0, 1) = 0 -> 0.0;
    # class 2 shares (0.1, 0.9, 0) vs (0.2, 0.5, 0.3): ranks (2, 3, 1) vs (1, 3, 2) -> 0.5
    assert t["spearman_per_class"] == pytest.approx([1.0, 0.0, 0.5])
    assert t["mean_spearman"] == pytest.approx(0.5)


# --- expel: a client confidently wrong about its own classes ---------------------------------------

def _hand_check(trust, verifiable, u):
    zeros = torch.zeros_like(u)
    return PeerCheck(agreement=zeros, evidence=zeros, trust=trust, verifiable=verifiable)


def _flipper_fleet(with_flipper: bool = True):
    """4 classes, inputs one-hot. H1 and H2 know classes 0 and 1, O knows 2 and 3; F knew 0 and 1 with its
    classifier rows rolled, so it claims 1 (its 0s) and 2 (its 1s). Its class 1 is judged by H1 and H2 (they
    call its images 0); its class 2 is a one-against-one dispute with O that nobody can judge."""
    c = 4
    h = torch.zeros(c, c)
    h[0, 0] = h[1, 1] = 4.0
    o = torch.zeros(c, c)
    o[2, 2] = o[3, 3] = 4.0
    f = torch.roll(h, 1, dims=0) * 1.5
    images = _onehot_images(c)
    models = [_Linear(h), _Linear(h), _Linear(o)] + ([_Linear(f)] if with_flipper else [])
    samples = torch.stack([images, images, images] + ([torch.roll(images, 1, dims=0)] if with_flipper else []))
    u = torch.tensor([[0.9, 0.9, 0.01, 0.01], [0.9, 0.9, 0.01, 0.95], [0.01, 0.01, 0.9, 0.95],
                      [0.01, 0.01, 0.9, 0.01]])
    return models, samples[:, :, None], u[:, :len(models)]


# --- recognition: does a client call its peers' class-j images j? -------------------------------

def _two_class_distributions():
    """D[k, k', i, :] for 3 clients, 2 classes: what judge k calls owner k''s class-i images, as [p(0), p(1)].
    Judge 0 knows both classes (its verdicts differ by owner), judge 1 is flipped, judge 2 barely knows either.
    Each judge's verdicts on its own images (k' = k) are set to nonsense: they must not count."""
    p0 = torch.full((3, 3, 2), 0.99)  # p(0 | image) for [judge, owner, image class]
    p0[0, 1] = torch.tensor([0.9, 0.2])
    p0[0, 2] = torch.tensor([0.7, 0.4])
    p0[1, 0] = p0[1, 2] = torch.tensor([0.1, 0.7])
    p0[2, 0] = p0[2, 1] = torch.tensor([0.6, 0.5])
    return torch.stack([p0, 1 - p0], dim=-1)


def test_recognition_is_the_hit_rate_on_peers_images_above_the_false_rate_by_hand():
    r = recognition(_two_class_distributions())
    # judge 0: class 0 hit (0.9 + 0.7) / 2 = 0.8, false (0.2 + 0.4) / 2 = 0.3; class 1 hit (0.8 + 0.6) / 2 = 0.7,
    # false (0.1 + 0.3) / 2 = 0.2. Judge 1: hit 0.1 / 0.3 below false 0.7 / 0.9 -> 0. Judge 2: 0.6 - 0.5, 0.5 - 0.4
    assert r.tolist() == [pytest.approx([0.5, 0.0, 0.1], abs=1e-6), pytest.approx([0.5, 0.0, 0.1], abs=1e-6)]
    # a lone client has no peer whose images it could recognise: r 0 (not a 0 / 0)
    assert recognition(torch.full((1, 1, 2, 2), 0.5)).tolist() == [[0.0], [0.0]]


def test_recognition_reads_a_flippers_one_against_one_classes_the_agreement_check_cannot_judge():
    """The dispute fleet: F claims 1 (H's 0s) and 2 (H's 1s); each is disputed one against one. Peers' images are
    one-hot, so each r is a closed form in a = e^4 / (e^4 + 3) (a client sure of a class it knows) and b = 1 / (e^4
    + 3); a client answers an input it knows nothing of uniformly (0.25)."""
    models, samples, u = _dispute_fleet()
    u_r, _ = normalise(u)
    distributions = peer_distributions(models, samples, torch.device("cpu"))
    a, b = math.exp(4) / (math.exp(4) + 3), 1 / (math.exp(4) + 3)
    r = recognition(distributions)
    b6 = 1 / (math.exp(6) + 3)  # F's answers are louder (x 1.5)
    assert r[:3, 1].tolist() == pytest.approx([0, 0, 0], abs=1e-6)  # F calls the peers' j-images j + 1 (or 0.25)
    # its class 3 (an empty row) answers the unknown e_3 uniformly and the e_0 / e_1 it knows at b6: the toy's blur
    assert r[3, 1].item() == pytest.approx((0.5 - 2 * b6) / 3, abs=1e-6)
    assert r[1, 0].item() == pytest.approx((2 * (a + b) - 1) / 6, abs=1e-6)  # H on class 1
    assert r[2, 2].item() == pytest.approx((a - b) / 3, abs=1e-6)  # G on class 2
    assert r[2, 0].item() == pytest.approx(0, abs=1e-6)  # H does not know 2
    # G calls the peers' class-1 images (e_1, e_0: unknown to it) 1 at 0.25 and their e_2 / e_3 images 1 at b
    assert r[1, 2].item() == pytest.approx((1 - 4 * b) / 6, abs=1e-6)
    check = peer_check(u, u_r, agreement_of(distributions), min_evidence=0.25, judges=2)
    assert not check.verifiable[1, 1] and not check.verifiable[2, 1]  # one against one: left as scored
    assert check.trust[1, 1] == 1.0 and check.trust[2, 1] == 1.0
    # what F claims (MS's U_c) it does not recognise: its claim recognition is the fleet's lowest
    claims = claim_recognition(distributions, normalise(u)[1])
    assert claims.argmin() == 1 and float(claims[1]) < 0.5 * float(claims.median())


def _expel_distributions():
    """D[judge, owner, image class, call] over 3 clients, 2 classes: clients 0 and 1 call every peer image by its
    class (r = 1), client 2 calls every one by the other class (r = 0: hit 0, false 1)."""
    eye = torch.eye(2)
    d = torch.zeros(3, 3, 2, 2)
    d[0], d[1], d[2] = eye, eye, 1 - eye
    return d


def test_expel_leaves_out_a_client_the_peers_reject_and_that_recognises_nothing_by_hand():
    distributions = _expel_distributions()
    u = torch.tensor([[2.0, 1.0, 1.0], [1.0, 2.0, 1.0]])  # MS U_r: class 0 [.5 .25 .25], class 1 [.25 .5 .25]
    trust = torch.tensor([[1.0, 1.0, 0.2], [1.0, 1.0, 0.4]])
    verifiable = torch.tensor([[False, False, True], [False, False, True]])
    seen = []

    def check_of(keep):  # a stand-in check: the hand-set trust on the kept clients
        seen.append(keep.tolist())
        return _hand_check(trust[:, keep], verifiable[:, keep], u[:, keep])

    check = check_of(torch.ones(3, dtype=torch.bool))
    # R_k = sum_j U_c[j, k] r[j, k]: 1, 1, 0; client 2's rejected share (.25 x .8 + .25 x .6) / .5 = .7
    assert claim_recognition(distributions, normalise(u)[1]).tolist() == pytest.approx([1.0, 1.0, 0.0])
    assert rejected_share(check, normalise(u)[0]).tolist() == pytest.approx([0.0, 0.0, 0.7])
    seen.clear()
    out = expel(check_of, u, distributions, rejected_above=0.6, recognition_below=0.5)
    assert out.expelled.tolist() == [False, False, True]
    # the check ran on every client, then again on clients 0 and 1 alone (2 judges nobody the second time)
    assert seen == [[True, True, True], [True, True, False]]
    assert out.trust[:, 2].tolist() == [0.0, 0.0] and torch.equal(out.trust[:, :2], trust[:, :2])
    # widened back to three clients: the expelled one unjudged, trust 0
    assert out.verifiable[:, 2].tolist() == [False, False] and torch.equal(out.verifiable[:, :2], verifiable[:, :2])
    assert out.rejected_share.tolist() == pytest.approx([0.0, 0.0, 0.7])  # from the first check, as decided
    assert set(out.as_dict()) >= {"rejected_share", "claim_recognition", "expelled"}
    # either sign alone keeps it: a rejected share under the bar, or (below) a recogniser at the median
    seen.clear()
    kept = expel(check_of, u, distributions, rejected_above=0.75, recognition_below=0.5)
    assert not kept.expelled.any() and len(seen) == 1 and torch.equal(kept.trust, check.trust)
    trust = torch.tensor([[0.0, 1.0, 0.2], [1.0, 1.0, 0.4]])
    verifiable = torch.tensor([[True, False, True], [False, False, True]])
    both = expel(check_of, u, distributions, rejected_above=0.6, recognition_below=0.5)
    assert both.rejected_share.tolist() == pytest.approx([1.0, 0.0, 0.7])
    assert both.expelled.tolist() == [False, False, True]  # client 0: every judged pair rejected, but R_0 = median
    # nobody recognises anything (every judge answers 0.5): median 0, nothing is below it, nobody is expelled
    blind = expel(check_of, u, torch.full((3, 3, 2, 2), 0.5), rejected_above=0.6, recognition_below=0.5)
    assert not blind.expelled.any()


def test_expel_checks_the_rest_of_a_flipped_fleet_as_if_the_flipper_had_never_uploaded():
    """The flipper fleet through the real agreement check: once F is expelled, U_r is the honest fleet's."""
    models, samples, u = _flipper_fleet()
    distributions = peer_distributions(models, samples, torch.device("cpu"))

    def check_of(keep):
        among = distributions[keep][:, keep]
        return peer_check(u[:, keep], normalise(u[:, keep])[0], agreement_of(among), min_evidence=0.25, judges=2)

    out = expel(check_of, u, distributions, rejected_above=0.6, recognition_below=0.5)
    flipper = out.expelled.nonzero().flatten().tolist()
    assert len(flipper) == 1, (out.rejected_share, out.claim_recognition)
    f = flipper[0]
    honest = [k for k in range(u.shape[1]) if k != f]
    models_h, samples_h, u_h = [models[k] for k in honest], samples[honest], u[:, honest]
    alone = peer_check(u_h, normalise(u_h)[0], agreement_of(peer_distributions(models_h, samples_h,
                                                                                 torch.device("cpu"))),
                       min_evidence=0.25, judges=2)
    assert out.trust[:, f].abs().max() == 0 and not out.verifiable[:, f].any()
    for key in ("agreement", "evidence", "trust", "verifiable"):  # exactly the honest fleet's check
        assert torch.equal(getattr(out, key)[:, honest], getattr(alone, key)), key


def _recognising(p):
    """D over len(p) clients, 2 classes: judge k calls every peer image by its class with probability p[k] (and by
    the other class with 1 - p[k]), so r[j, k] = max(0, 2 p[k] - 1) on both classes."""
    m = len(p)
    d = torch.zeros(m, m, 2, 2)
    for k, pk in enumerate(p):
        d[k] = torch.tensor([[pk, 1 - pk], [1 - pk, pk]])
    return d


def _stand_in(trust, verifiable, u, seen=None):
    def check_of(keep):  # the hand-set trust on the kept clients
        if seen is not None:
            seen.append(keep.tolist())
        return _hand_check(trust[:, keep], verifiable[:, keep], u[:, keep])
    return check_of


def test_expel_holds_the_claim_recognition_against_the_median_client_not_the_mean():
    """Five clients; the peers reject most of what clients 3 and 4 claim (rejected share 0.8). Their claim
    recognitions R = (1, 1, 1, 0.4, 0): the median client's is 1, so the bar is 0.5 and both are below it. Against
    the mean (0.68, bar 0.34) client 3 would stay: a client that recognises its classes less than half as well as
    the typical client is out however low the fleet's worst one goes."""
    distributions = _recognising([1.0, 1.0, 1.0, 0.7, 0.5])
    u = torch.ones(2, 5)  # U_r 0.2 each; U_c 0.5 each
    trust = torch.tensor([[1.0, 1.0, 1.0, 0.2, 0.2]] * 2)
    verifiable = torch.tensor([[False, False, False, True, True]] * 2)
    claims = claim_recognition(distributions, normalise(u)[1])
    assert claims.tolist() == pytest.approx([1.0, 1.0, 1.0, 0.4, 0.0], abs=1e-6)
    assert float(claims.median()) == pytest.approx(1.0) and float(claims.mean()) == pytest.approx(0.68, abs=1e-6)
    seen = []
    out = expel(_stand_in(trust, verifiable, u, seen), u, distributions, rejected_above=0.6, recognition_below=0.5)
    assert out.rejected_share.tolist() == pytest.approx([0.0, 0.0, 0.0, 0.8, 0.8])
    assert out.expelled.tolist() == [False, False, False, True, True]
    # the rest is checked as if the two had never uploaded: a second check on clients 0-2 alone
    assert seen == [[True] * 5, [True, True, True, False, False]]
    assert out.trust.tolist() == [[1.0, 1.0, 1.0, 0.0, 0.0]] * 2


def test_expel_reads_what_a_client_claims_from_ms_u_c_not_u_r():
    """Three clients that recognise every peer image (r = 1 everywhere), client 2 a minor one (u 0.1 against 1) whose
    judged pairs the peers reject (rejected share 0.9). U_c weighs each client's own classes (its column sums to 1):
    R = (1, 1, 1), nobody is below half the median, nobody is expelled. Weighted by U_r instead, client 2's R would
    be its U_r column's sum, 0.2 / 2.1 = 0.095 against the median 2 / 2.1: below half of it, expelled for being
    small rather than for not recognising its classes."""
    distributions = _recognising([1.0, 1.0, 1.0])
    u = torch.tensor([[1.0, 1.0, 0.1], [1.0, 1.0, 0.1]])
    ms_u_r, ms_u_c = normalise(u)
    trust = torch.tensor([[1.0, 1.0, 0.1], [1.0, 1.0, 0.1]])
    verifiable = torch.tensor([[False, False, True], [False, False, True]])
    assert claim_recognition(distributions, ms_u_c).tolist() == pytest.approx([1.0, 1.0, 1.0], abs=1e-6)
    by_u_r = claim_recognition(distributions, ms_u_r)
    assert by_u_r.tolist() == pytest.approx([2 / 2.1, 2 / 2.1, 0.2 / 2.1], abs=1e-6)
    assert float(by_u_r[2]) < 0.5 * float(by_u_r.median())  # what reading U_r would decide
    seen = []
    out = expel(_stand_in(trust, verifiable, u, seen), u, distributions, rejected_above=0.6, recognition_below=0.5)
    assert out.expelled.tolist() == [False, False, False] and seen == [[True, True, True]]  # no second check
    assert out.rejected_share.tolist() == pytest.approx([0.0, 0.0, 0.9])
    assert out.claim_recognition.tolist() == pytest.approx([1.0, 1.0, 1.0], abs=1e-6)


# --- weigh: the teacher's U from MS's scores and the peers' view, per recipe --------------------------

def test_weigh_with_the_robust_recipe_expels_the_flipper_and_keeps_ms_u_for_the_rest_by_hand():
    models, samples, u = _flipper_fleet()
    distributions = peer_distributions(models, samples, torch.device("cpu"))
    robust = RECIPES["robust"]
    assert (robust.expel, robust.peer_min_evidence, robust.peer_judges) == (True, 0.25, 2)
    assert (robust.expel_rejected, robust.expel_recognition) == (0.6, 0.5)
    w = weigh(u, distributions, robust)
    assert w.left_out.tolist() == [False, False, False, True] and torch.equal(w.check.expelled, w.left_out)
    # the check expel reads is the agreement check made again on the three others alone, widened back
    keep = torch.tensor([True, True, True, False])
    alone = widened(peer_check(u[:, keep], normalise(u[:, keep])[0], agreement_of(distributions[keep][:, keep]),
                               min_evidence=0.25, judges=2), keep)
    assert torch.equal(w.check.trust, alone.trust) and torch.equal(w.check.evidence, alone.evidence)
    # U is MS's u with column 3 zeroed: rows (0.9, 0.9, 0.01) / 1.81 twice, (0.01, 0.01, 0.9) / 0.92 twice;
    # the kept columns (0.9, 0.9, 0.01, 0.01) / 1.82 twice and (0.01, 0.01, 0.9, 0.9) / 1.82; the expelled 0
    assert w.u_r.tolist() == [pytest.approx([0.9 / 1.81, 0.9 / 1.81, 0.01 / 1.81, 0.0])] * 2 + [
        pytest.approx([0.01 / 0.92, 0.01 / 0.92, 0.9 / 0.92, 0.0])] * 2
    assert w.u_c[:, 0].tolist() == pytest.approx([0.9 / 1.82, 0.9 / 1.82, 0.01 / 1.82, 0.01 / 1.82])
    assert torch.equal(w.u_c[:, 1], w.u_c[:, 0])
    assert w.u_c[:, 2].tolist() == pytest.approx([0.01 / 1.82, 0.01 / 1.82, 0.9 / 1.82, 0.9 / 1.82])
    assert w.u_c[:, 3].abs().max() == 0  # good at nothing, not uniformly good
    kept_r, kept_c = normalise(u[:, :3])  # the kept columns are a three-client fleet's own weights, to the bit
    assert torch.equal(w.u_r[:, :3], kept_r) and torch.equal(w.u_c[:, :3], kept_c)
    # the flipper's share of classes 1 and 2 under MS alone: expel took it away
    assert normalise(u)[0][1:3, 3].min() > 0.3
    # the expelled client has no say in the SA teacher
    logits = torch.randn(4, 5, 4, generator=torch.Generator().manual_seed(0))
    for space, route in (("calibrated", "class"), ("logits", "label"), ("logits", "class")):
        labels = torch.tensor([0, 1, 2, 3, 1])
        four = StratifiedAggregation(w.u_r, w.u_c, space, route)(logits, labels)
        three = StratifiedAggregation(w.u_r[:, :3], w.u_c[:, :3], space, route)(logits[:3], labels)
        assert torch.allclose(four, three, atol=1e-6), (space, route)


def test_weigh_without_expel_and_the_paper_recipe_make_no_check_and_an_honest_fleet_keeps_ms_u():
    models, samples, u = _flipper_fleet()
    distributions = peer_distributions(models, samples, torch.device("cpu"))
    without = dataclasses.replace(RECIPES["robust"], expel=False)
    assert not RECIPES["paper"].expel
    for recipe, d in ((without, distributions), (RECIPES["paper"], None)):  # the paper mode has no peers' view
        w = weigh(u, d, recipe)
        u_r, u_c = normalise(u)
        assert w.check is None and w.left_out is None
        assert torch.equal(w.u_r, u_r) and torch.equal(w.u_c, u_c)
    assert u_r[1].tolist() == pytest.approx([0.9 / 2.76, 0.9 / 2.76, 0.01 / 2.76, 0.95 / 2.76])  # by hand
    # an honest fleet under the robust recipe: the check runs, nobody is left out, U is MS's own
    models, samples, u = _flipper_fleet(with_flipper=False)
    honest = weigh(u, peer_distributions(models, samples, torch.device("cpu")), RECIPES["robust"])
    assert honest.left_out is None and not honest.check.expelled.any()
    assert torch.equal(honest.u_r, normalise(u)[0]) and torch.equal(honest.u_c, normalise(u)[1])


def test_a_client_without_weight_has_no_say_in_sa_not_even_in_the_calibration_median():
    """Client 0 answers every input alike (top-logit spread 0: floored at 0.1 x the fleet's median spread);
    client 2 has no weight (expelled) and a wide spread that would move that median if it counted."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 4, generator=g)
    logits[0] = torch.tensor([3.0, 1.0, 0.0, 0.5]) + 0.01 * torch.randn(6, 4, generator=g)
    logits[2] *= 40.0
    u_r = torch.tensor([[0.5, 0.5, 0.0], [0.7, 0.3, 0.0], [0.2, 0.8, 0.0], [0.4, 0.6, 0.0]])
    u_c = normalise(u_r)[1]
    three = StratifiedAggregation(u_r, u_c, "calibrated", "class")(logits)
    two = StratifiedAggregation(u_r[:, :2], u_c[:, :2], "calibrated", "class")(logits[:2])
    assert torch.allclose(three, two, atol=1e-6)
    counted = torch.einsum("ck,kbc->bc", u_r, calibrate(logits))  # what letting it into the median would give
    assert not torch.allclose(counted, two, atol=1e-3)


def test_fixed_calibration_reads_its_reference_statistics_and_answers_an_image_alone_as_in_any_batch():
    # reference: client 0's top logits 3 and 1 (mean 2, std sqrt 2); client 1's 10 and 4 (mean 7, std 3 sqrt 2)
    reference = torch.tensor([[[3.0, 0.0], [1.0, -1.0]],
                              [[10.0, 2.0], [0.0, 4.0]]])
    stats = Calibration.of(reference)
    assert stats.mean.tolist() == pytest.approx([2.0, 7.0])
    r2 = math.sqrt(2)
    assert stats.spread.tolist() == pytest.approx([r2, 3 * r2])
    batch = torch.tensor([[[5.0, 1.0], [0.0, 2.0], [1.0, 1.0]],
                          [[1.0, 13.0], [7.0, 7.0], [4.0, 0.0]]])  # (m=2, b=3, c=2)
    out = calibrate(batch, stats)
    assert out[0, 0].tolist() == pytest.approx([3 / r2, -1 / r2])  # (z - 2) / sqrt 2
    assert out[1, 0].tolist() == pytest.approx([-6 / (3 * r2), 6 / (3 * r2)])  # (z - 7) / (3 sqrt 2)
    for i in range(3):  # batch-free: each image alone gets the very answer it gets inside the batch
        assert torch.equal(calibrate(batch[:, i:i + 1], stats), out[:, i:i + 1])
    sa = StratifiedAggregation(torch.eye(2), torch.eye(2), "calibrated", "class", calibration=stats)
    assert torch.equal(torch.cat([sa(batch[:, i:i + 1]) for i in range(3)]), sa(batch))


def test_running_calibration_moves_as_bn_running_statistics_and_stands_still_when_frozen():
    first = torch.tensor([[[3.0, 0.0], [1.0, -1.0]]])  # top logits 3, 1: mean 2, std sqrt 2
    second = torch.tensor([[[7.0, 0.0], [5.0, 0.0]]])  # top logits 7, 5: mean 6, std sqrt 2
    running = RunningCalibration(momentum=0.25)
    used = running.use(first)  # no statistics yet: the first batch is standardised with its own
    assert used.mean.tolist() == pytest.approx([2.0])
    assert running.stats.mean.tolist() == pytest.approx([2.0])
    used = running.use(second)  # the second with the first's, then folded in: 0.75 x 2 + 0.25 x 6 = 3
    assert used.mean.tolist() == pytest.approx([2.0])
    assert running.stats.mean.tolist() == pytest.approx([3.0])
    assert running.stats.spread.tolist() == pytest.approx([math.sqrt(2)])
    with running.frozen():
        running.use(first)
        running.use(second)
    assert running.stats.mean.tolist() == pytest.approx([3.0])
    state = running.state_dict()
    restored = RunningCalibration(momentum=0.25)
    restored.load_state_dict(state)
    assert restored.stats.mean.tolist() == pytest.approx([3.0])
    started = RunningCalibration(momentum=0.5, initial=Calibration(torch.tensor([10.0]), torch.tensor([1.0])))
    assert started.use(first).mean.tolist() == pytest.approx([10.0])  # the given start, not the batch's own
    assert started.stats.mean.tolist() == pytest.approx([6.0])
