"""FedHydra's strategy steps on a hand-built 3-client fleet, without data sets or Flower: what MS is
asked to do per mode, which U / space / route / divisors reach the SA teacher, what stratification.json
and the run's metrics say, and the report's server actions. (Fast: the mutation tests run these.)"""

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch import nn

import strategies.fedhydra as fh
from oneshot_fl.config import from_run_config, merge_overrides
from oneshot_fl.engine.stratify import Stratification, normalise
from oneshot_fl.engine.synthesizer import GeneratorLoss
from oneshot_fl.engine.teachers import ClientEnsemble, StratifiedAggregation, calibrate
from oneshot_fl.engine.trust import PeerCheck, agreement_of, discredit, peer_check, peer_distributions, round_trip
from oneshot_fl.models.generator import GeneratorSpec
from strategies.base import FuseContext

C = 3  # classes; images are one-hot vectors e_j of shape (1, 1, C)


class Linear(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.fc = nn.Linear(C, C, bias=False)
        with torch.no_grad():
            self.fc.weight.copy_(weight)

    def forward(self, x):
        return self.fc(x.flatten(1))


def fleet():
    """Clients 0 and 1 honest (logit 2 on their input's class), client 2 the same answers x3 louder."""
    return [Linear(2.0 * torch.eye(C)), Linear(2.0 * torch.eye(C)), Linear(6.0 * torch.eye(C))]


def fixed_result() -> Stratification:
    u = torch.tensor([[0.9, 0.2, 0.5], [0.1, 0.8, 0.5], [0.3, 0.3, 0.6]])  # (c, m)
    u_r, u_c = normalise(u)
    samples = torch.eye(C).view(1, C, 1, 1, 1, C).repeat(3, 1, 2, 1, 1, 1)  # (m, c, s=2, 1, 1, C): e_j
    return Stratification(u=u, u_r=u_r, u_c=u_c, losses=torch.zeros(3, C, 2), seconds=1.5, score="prob-auc",
                          samples=samples)


def strategy(tmp_path, **overrides):
    cfg = from_run_config(merge_overrides({"method": "fedhydra", "preset": "smoke", "num-clients": 3,
                                           **{f"fedhydra.{k}": v for k, v in overrides.items()}}))
    hydra = fh.FedHydra.__new__(fh.FedHydra)  # no test set, no run folder set-up: the steps alone
    hydra.cfg, hydra.params = cfg, fh.FedHydra.parse_params(cfg.flat)
    ctx = FuseContext(cfg=cfg, device=torch.device("cpu"), num_classes=C, input_shape=(1, 28, 28), test=None,
                      run_dir=tmp_path)
    return hydra, ctx


def uploads():
    counts = [np.array([50, 0, 5]), np.array([0, 40, 5]), np.array([0, 0, 60])]
    return [SimpleNamespace(partition_id=k, arch="lin", label_counts=counts[k]) for k in range(3)]


def record_ms(monkeypatch):
    calls = []

    def recorder(name):
        def run(*args, **kwargs):
            calls.append((name, args, kwargs))
            return fixed_result()
        return run
    monkeypatch.setattr(fh, "stratify", recorder("batched"))
    monkeypatch.setattr(fh, "stratify_sequential", recorder("sequential"))
    return calls


@pytest.mark.parametrize("overrides, batch, score, stop, keep", [
    ({}, 16, "prob-auc", 0.01, 16),  # robust: small batch, bounded score, early stop, images kept
    ({"mode": "paper"}, "synth", "paper", 0.0, 0),  # paper: distill.synth-batch, Eq. 2, no stop, none kept
    ({"ms-batch": 8, "ms-score": "paper", "ms-stop-loss": 0.5}, 8, "paper", 0.5, 16),  # explicit values win
    ({"peer-check": "off"}, 16, "prob-auc", 0.01, 0),  # calibrated SA needs no MS images
    ({"peer-check": "off", "sa-space": "capped"}, 16, "prob-auc", 0.01, 16),  # capped SA still needs them
    ({"peer-check": "off", "sa-space": "probs"}, 16, "prob-auc", 0.01, 0),  # nobody looks at them
    ({"mode": "paper", "peer-check": "on"}, "synth", "paper", 0.0, 16),
])
def test_ms_gets_the_modes_settings(tmp_path, monkeypatch, overrides, batch, score, stop, keep):
    calls = record_ms(monkeypatch)
    hydra, ctx = strategy(tmp_path, **overrides, **{"ms-steps": 7})
    ensemble = ClientEnsemble(fleet(), ["lin"] * 3)
    assert hydra.stratify(ensemble, ctx).u.shape == (C, 3)
    (name, args, kwargs), = calls
    dcfg = hydra.cfg.distill
    assert name == "sequential"  # auto on a CPU
    assert args[0] is ensemble.models and args[1] == C and args[3] == 7
    assert args[2] == GeneratorSpec(dcfg.nz, dcfg.ngf, 28, 1)
    assert args[4] == (dcfg.synth_batch if batch == "synth" else batch)
    assert args[5] == dcfg.lr_generator and args[6] == ctx.seed("stratification") and args[7] == ctx.device
    assert kwargs == {"score": score, "stop_loss": stop, "keep_samples": keep}


@pytest.mark.parametrize("setting, device, runs", [
    ("yes", "cpu", "batched"), ("auto", "cuda", "batched"), ("no", "cuda", "sequential"), ("auto", "cpu", "sequential"),
])
def test_ms_batched_picks_the_vmapped_ms_on_gpus_or_when_asked(tmp_path, monkeypatch, setting, device, runs):
    calls = record_ms(monkeypatch)
    hydra, ctx = strategy(tmp_path, **{"ms-batched": setting})
    ctx.device = torch.device(device)  # MS itself is recorded, not run: no GPU needed
    hydra.stratify(ClientEnsemble(fleet(), ["lin"] * 3), ctx)
    assert [c[0] for c in calls] == [runs]


def test_robust_aggregator_uses_the_peer_checked_u_calibrated_logits_and_writes_what_it_did(tmp_path, monkeypatch):
    record_ms(monkeypatch)
    hydra, ctx = strategy(tmp_path)
    ensemble = ClientEnsemble(fleet(), ["lin"] * 3)
    aggregator = hydra.make_aggregator(ensemble, uploads(), ctx)
    result = fixed_result()
    agree = agreement_of(peer_distributions(fleet(), result.samples, ctx.device))
    expected = peer_check(result.u, result.u_r, agree, min_evidence=0.25, judges=2)
    assert (aggregator.space, aggregator.route, aggregator.scales) == ("calibrated", "class", None)
    assert torch.allclose(aggregator.u_r, expected.u_r) and torch.allclose(aggregator.u_c, expected.u_c)
    assert ensemble.bn_cap == 10.0
    report = json.loads((tmp_path / "stratification.json").read_text())
    assert report["logit_divisors"] is None and "louder" not in report["server_action"]
    assert report["settings"]["sa_space"] == "calibrated" and report["settings"]["mode"] == "robust"
    assert torch.allclose(torch.tensor(report["used_u_r"]), expected.u_r)
    # client 2 answers x3 louder: calibrated, its logits are the others' (each client on its own scale)
    x = torch.eye(C)[[0, 1, 2, 0]] * torch.tensor([1.0, 2.0, 0.5, 3.0])[:, None]  # top logits vary over the batch
    logits = ensemble.logits(x.view(4, 1, 1, C))
    out = aggregator(logits)
    assert torch.allclose(out, torch.einsum("ck,kbc->bc", expected.u_r, calibrate(logits)), atol=1e-6)
    assert torch.allclose(calibrate(logits)[2], calibrate(logits)[0], atol=1e-6)


def test_an_expelled_clients_bn_statistics_leave_the_generators_loss(tmp_path, monkeypatch):
    record_ms(monkeypatch)
    result = fixed_result()
    ones = torch.ones(C, 3)
    expelled = PeerCheck(agreement=ones, evidence=ones, trust=ones, verifiable=ones.bool(), u=result.u,
                         u_r=result.u_r, u_c=result.u_c, rejected_share=torch.zeros(3),
                         claim_recognition=torch.ones(3), expelled=torch.tensor([False, True, False]))
    monkeypatch.setattr(fh, "expel", lambda *args, **kwargs: expelled)
    hydra, ctx = strategy(tmp_path)
    ensemble = ClientEnsemble(fleet(), ["lin"] * 3)
    hydra.make_aggregator(ensemble, uploads(), ctx)
    assert ensemble.left_out.tolist() == [False, True, False]
    nobody = dataclasses.replace(expelled, expelled=torch.zeros(3, dtype=torch.bool))
    monkeypatch.setattr(fh, "expel", lambda *args, **kwargs: nobody)
    kept = ClientEnsemble(fleet(), ["lin"] * 3)
    hydra.make_aggregator(kept, uploads(), ctx)
    assert kept.left_out is None


def flipped_result() -> Stratification:
    """fixed_result, but client 2's class-j images are e_{j-1}: what MS finds for a label-flipped client."""
    result = fixed_result()
    result.samples[2] = torch.roll(result.samples[2], 1, dims=0)
    return result


def test_roundtrip_peer_check_sets_the_teachers_u_and_reports_the_pairs_it_shrank(tmp_path, monkeypatch):
    monkeypatch.setattr(fh, "stratify_sequential", lambda *args, **kwargs: flipped_result())
    hydra, ctx = strategy(tmp_path, **{"peer-check": "roundtrip", "peer-power": 3.0})
    models = [Linear(2.0 * torch.eye(C)), Linear(2.0 * torch.eye(C)), Linear(6.0 * torch.roll(torch.eye(C), 1, 0))]
    aggregator = hydra.make_aggregator(ClientEnsemble(models, ["lin"] * 3), uploads(), ctx)
    result = flipped_result()
    distributions = peer_distributions(models, result.samples, ctx.device)
    expected = round_trip(result.u, result.u_r, distributions, power=3.0)
    assert not torch.allclose(expected.u_r, round_trip(result.u, result.u_r, distributions, power=2.0).u_r)
    assert torch.allclose(aggregator.u_r, expected.u_r) and torch.allclose(aggregator.u_c, expected.u_c)
    report = json.loads((tmp_path / "stratification.json").read_text())
    assert report["peer_check"]["check"] == "roundtrip" and report["settings"]["peer_check"] == "roundtrip"
    assert report["settings"]["peer_power"] == 3.0
    shrunk = [(j, k, int(expected.partner[j, k])) for j in range(C) for k in range(3)
              if expected.trust[j, k] < 0.5 and result.u_r[j, k] >= 0.1]
    assert [(j, k) for j, k, _ in shrunk if k == 2] == [(0, 2), (1, 2), (2, 2)]  # the flipper, every class
    assert all(partner == (j - 1) % C for j, k, partner in shrunk if k == 2)  # its j is the peers' j - 1
    assert [tuple(p) for p in report["peer_check"]["shrunk"]] == shrunk
    assert report["server_action"] == (f"round-trip check shrank {len(shrunk)} weighted (class, client) pairs below "
                                       f"half (class, client, the peers' class it matched) {shrunk}")


def test_capped_aggregator_uses_the_peer_checked_u_capped_logits_and_writes_what_it_did(tmp_path, monkeypatch):
    record_ms(monkeypatch)
    hydra, ctx = strategy(tmp_path, **{"sa-space": "capped"})
    models = fleet()
    ensemble = ClientEnsemble(models, ["lin"] * 3)
    assert hydra.extra_metrics() == {"stratification": None}  # before any stratification
    aggregator = hydra.make_aggregator(ensemble, uploads(), ctx)

    result = fixed_result()
    agree = agreement_of(peer_distributions(models, result.samples, ctx.device))
    expected = peer_check(result.u, result.u_r, agree, min_evidence=0.25, judges=2)
    assert isinstance(aggregator, StratifiedAggregation)
    assert (aggregator.space, aggregator.route) == ("capped", "class")
    assert torch.allclose(aggregator.u_r, expected.u_r) and torch.allclose(aggregator.u_c, expected.u_c)
    # client 2's logits are 3x the others' on every image: divided by 3, the others left at 1
    assert aggregator.scales.tolist() == pytest.approx([1.0, 1.0, 3.0], rel=1e-5)
    assert ensemble.bn_cap == 10.0
    assert "stratification" in ctx.timer.seconds

    report = json.loads((tmp_path / "stratification.json").read_text())
    assert report["clients"] == ["p0 lin", "p1 lin", "p2 lin"]
    assert torch.allclose(torch.tensor(report["used_u_r"]), expected.u_r)
    assert torch.allclose(torch.tensor(report["used_u_c"]), expected.u_c)
    assert torch.equal(torch.tensor(report["u_r"]), result.u_r)  # MS's own U kept beside the used one
    assert not torch.allclose(expected.u_r, result.u_r)  # (and the check did change it on this fleet)
    assert report["logit_divisors"] == pytest.approx([1.0, 1.0, 3.0], rel=1e-5)
    assert report["settings"] == {"ms_score": "prob-auc", "ms_stop_loss": 0.01, "ms_batch": 16, "sa_space": "capped",
                                  "sa_route": "class", "peer_check": "on", "bn_cap": 10.0, "mode": "robust",
                                  "ms_steps": hydra.params.ms_steps, "peer_min_evidence": 0.25, "peer_judges": 2,
                                  "peer_power": 2.0, "peer_reject_below": 0.0, "peer_rejections": 1,
                                  "peer_recognition": 0.0, "peer_recognition_of": "all", "peer_expel": 0.6,
                                  "peer_expel_recognition": 0.5}
    assert report["server_action"].endswith("divided down to it (upload index, divisor): [(2, 3.0)]")
    assert report["one_owner_per_class"] is False and report["owners_per_class"] == [1, 1, 3]
    assert torch.allclose(torch.tensor(report["peer_check"]["u_r"]), expected.u_r)  # the check is reported
    for key in ("u_r", "u_c"):
        assert (tmp_path / f"stratification_{key}.png").stat().st_size > 0
    summary = hydra.extra_metrics()["stratification"]
    assert set(summary) == {"tracking", "one_owner_per_class", "server_action"}
    assert summary["server_action"] == report["server_action"]
    assert summary["one_owner_per_class"] is False and summary["tracking"] == report["tracking"]


def test_paper_aggregator_uses_ms_u_in_logit_space_routed_by_label_without_caps(tmp_path, monkeypatch):
    record_ms(monkeypatch)
    hydra, ctx = strategy(tmp_path, mode="paper")
    ensemble = ClientEnsemble(fleet(), ["lin"] * 3)
    aggregator = hydra.make_aggregator(ensemble, uploads(), ctx)
    result = fixed_result()
    assert (aggregator.space, aggregator.route, aggregator.scales) == ("logits", "label", None)
    assert torch.equal(aggregator.u_r, result.u_r) and torch.equal(aggregator.u_c, result.u_c)
    assert ensemble.bn_cap == 0.0
    report = json.loads((tmp_path / "stratification.json").read_text())
    assert report["logit_divisors"] is None and "peer_check" not in report
    assert report["server_action"] == "paper-mode stratification (no peer check)"


def test_no_divisor_above_one_means_no_action_line(tmp_path, monkeypatch):
    record_ms(monkeypatch)
    hydra, ctx = strategy(tmp_path, **{"peer-check": "off", "sa-space": "capped"})
    quiet = [Linear(2.0 * torch.eye(C)) for _ in range(3)]
    aggregator = hydra.make_aggregator(ClientEnsemble(quiet, ["lin"] * 3), uploads(), ctx)
    assert aggregator.scales.tolist() == pytest.approx([1.0, 1.0, 1.0])
    report = json.loads((tmp_path / "stratification.json").read_text())
    assert "louder" not in report["server_action"]


def test_each_louder_client_is_named_with_its_divisor_after_the_checks_action(tmp_path, monkeypatch, caplog):
    record_ms(monkeypatch)
    hydra, ctx = strategy(tmp_path, **{"sa-space": "capped"})
    monkeypatch.setattr(hydra, "logit_caps", lambda ensemble, result, ctx: torch.tensor([1.0, 1.23456, 1.5]))
    with caplog.at_level("INFO", logger="oneshot_fl.strategy"):
        hydra.make_aggregator(ClientEnsemble(fleet(), ["lin"] * 3), uploads(), ctx)
    action = json.loads((tmp_path / "stratification.json").read_text())["server_action"]
    assert action.startswith("peer check shrank ")
    assert action.endswith("; logits of the clients louder than the median client divided down to it "
                           "(upload index, divisor): [(1, 1.235), (2, 1.5)]")
    assert "SA on capped logits; each client's logits divided by [1.0, 1.235, 1.5]" in caplog.messages


@pytest.mark.parametrize("mode, says", [
    ("paper", "SA routes by the synthetic label, so a sample's teacher is its class's owner alone"),
    ("robust", "SA routes by output class on calibrated logits: each class is scored by its owner, on the owner's "
               "own scale, and an owner answers an input of a class it never saw less strongly than it answers its "
               "typical input"),
])
def test_the_report_describes_the_route_and_space_the_teacher_uses(tmp_path, monkeypatch, mode, says):
    record_ms(monkeypatch)
    hydra, ctx = strategy(tmp_path, mode=mode)
    one_owner_each = [SimpleNamespace(partition_id=k, arch="lin", label_counts=np.eye(C, dtype=int)[k] * 50)
                      for k in range(3)]
    hydra.make_aggregator(ClientEnsemble(fleet(), ["lin"] * 3), one_owner_each, ctx)
    action = json.loads((tmp_path / "stratification.json").read_text())["server_action"]
    assert action.endswith("one owner per class in the uploaded counts (report only): " + says)


def test_logit_caps_divide_the_relative_spread_by_the_cap_and_never_amplify(tmp_path, monkeypatch):
    seen = {}

    def scales(models, images, device):
        seen["images"] = images.shape
        return torch.tensor([0.5, 1.0, 3.0])
    monkeypatch.setattr(fh, "logit_scales", scales)
    hydra, ctx = strategy(tmp_path, **{"logit-cap": 1.5})
    divisors = hydra.logit_caps(ClientEnsemble(fleet(), ["lin"] * 3), fixed_result(), ctx)
    assert divisors.tolist() == pytest.approx([1.0, 1.0, 2.0])  # max(1, r / 1.5)
    assert seen["images"] == (3 * C * 2, 1, 1, C)  # every kept image of every (client, class) run


def test_check_peers_passes_ms_u_and_the_evidence_knob(tmp_path, monkeypatch):
    seen = {}
    distributions = torch.rand(3, 3, C, C)
    monkeypatch.setattr(fh, "peer_distributions", lambda models, samples, device: distributions)
    monkeypatch.setattr(fh, "agreement_of", lambda among: ("diagonal of", among))
    monkeypatch.setattr(fh, "peer_check", lambda u, u_r, agree, *, min_evidence, judges: seen.update(
        u=u, u_r=u_r, agree=agree, min_ev=min_evidence, judges=judges) or "checked")
    monkeypatch.setattr(fh, "discredit", lambda check, u, ms_u_r, *, below, rejections: seen.update(
        d_check=check, d_u=u, d_u_r=ms_u_r, below=below, rejections=rejections) or "discredited")
    hydra, ctx = strategy(tmp_path, **{"peer-min-evidence": 0.4, "peer-judges": 3, "peer-expel": 0.0})
    result = fixed_result()
    assert hydra.check_peers(ClientEnsemble(fleet(), ["lin"] * 3), result, ctx) == "checked"  # discredit: off
    assert torch.equal(seen["u"], result.u) and torch.equal(seen["u_r"], result.u_r)  # MS's U_r, from its scores
    assert seen["min_ev"] == 0.4 and seen["judges"] == 3
    assert "d_check" not in seen
    assert strategy(tmp_path)[0].params.peer_judges == 2
    assert seen["agree"][0] == "diagonal of" and torch.equal(seen["agree"][1], distributions)
    on, ctx = strategy(tmp_path, **{"peer-reject-below": 0.1, "peer-rejections": 2, "peer-expel": 0.0})
    assert on.check_peers(ClientEnsemble(fleet(), ["lin"] * 3), result, ctx) == "discredited"
    assert seen["d_check"] == "checked" and torch.equal(seen["d_u"], result.u)
    assert torch.equal(seen["d_u_r"], result.u_r)
    assert (seen["below"], seen["rejections"]) == (0.1, 2)


def test_check_peers_recognises_after_the_check_and_discredit_when_asked(tmp_path, monkeypatch):
    seen = {}
    distributions = torch.rand(3, 3, C, C)
    monkeypatch.setattr(fh, "peer_distributions", lambda models, samples, device: distributions)
    monkeypatch.setattr(fh, "agreement_of", lambda among: "agreement")
    monkeypatch.setattr(fh, "peer_check", lambda *args, **kwargs: "checked")
    monkeypatch.setattr(fh, "discredit", lambda check, *args, **kwargs: f"discredited {check}")
    monkeypatch.setattr(fh, "recognise", lambda check, u, distributions, *, power, clients: seen.update(
        check=check, u=u, distributions=distributions, power=power, clients=clients) or "recognised")
    result, ensemble = fixed_result(), ClientEnsemble(fleet(), ["lin"] * 3)
    off, ctx = strategy(tmp_path, **{"peer-expel": 0.0})
    assert off.params.peer_recognition == 0.0 and off.check_peers(ensemble, result, ctx) == "checked" and not seen
    on, ctx = strategy(tmp_path, **{"peer-recognition": 2.0, "peer-expel": 0.0})
    assert on.check_peers(ensemble, result, ctx) == "recognised"
    assert seen["check"] == "checked" and torch.equal(seen["u"], result.u)
    assert torch.equal(seen["distributions"], distributions) and (seen["power"], seen["clients"]) == (2.0, None)
    both, ctx = strategy(tmp_path, **{"peer-recognition": 1.5, "peer-reject-below": 0.1, "peer-expel": 0.0})
    assert both.check_peers(ensemble, result, ctx) == "recognised" and seen["check"] == "discredited checked"
    assert seen["power"] == 1.5 and seen["clients"] is None


def test_check_peers_expels_with_the_whole_check_as_the_mode_or_the_knobs_say(tmp_path, monkeypatch):
    seen, calls = {}, []
    distributions = torch.arange(3 * 3 * C * C, dtype=torch.float).view(3, 3, C, C)
    monkeypatch.setattr(fh, "peer_distributions", lambda models, samples, device: distributions)
    monkeypatch.setattr(fh, "agreement_of", lambda among: ("agreement of", among))
    monkeypatch.setattr(fh, "peer_check", lambda u, u_r, agree, **kwargs: calls.append(("check", u, u_r, agree)) or
                        "checked")
    monkeypatch.setattr(fh, "discredit", lambda check, u, u_r, **kwargs: calls.append(("discredit", u, u_r)) or
                        f"discredited {check}")
    monkeypatch.setattr(fh, "recognise", lambda check, u, among, **kwargs: calls.append(("recognise", u, among)) or
                        f"recognised {check}")
    monkeypatch.setattr(fh, "expel", lambda check_of, u, distributions, *, rejected_above, recognition_below:
                        seen.update(check_of=check_of, u=u, distributions=distributions, above=rejected_above,
                                    below=recognition_below) or "expelled")
    result, ensemble = fixed_result(), ClientEnsemble(fleet(), ["lin"] * 3)
    robust, ctx = strategy(tmp_path)  # the robust mode's 0.6 and the 0.5 default
    assert robust.check_peers(ensemble, result, ctx) == "expelled"
    assert seen["u"] is result.u and seen["distributions"] is distributions and (seen["above"], seen["below"]) == (
        0.6, 0.5)
    assert seen["check_of"](torch.ones(3, dtype=torch.bool)) == "checked"
    _, u, u_r, (_, among) = calls[0]
    assert torch.equal(u, result.u) and torch.equal(u_r, result.u_r) and torch.equal(among, distributions)
    # the check it reruns is the run's whole chain, on the kept clients alone (their scores, U_r, distributions)
    chained, ctx = strategy(tmp_path, **{"peer-expel": 0.7, "peer-expel-recognition": 0.3, "peer-reject-below": 0.1,
                                         "peer-recognition": 2.0})
    assert chained.check_peers(ensemble, result, ctx) == "expelled" and (seen["above"], seen["below"]) == (0.7, 0.3)
    calls.clear()
    keep = torch.tensor([True, False, True])
    assert seen["check_of"](keep) == "recognised discredited checked"
    assert [name for name, *_ in calls] == ["check", "discredit", "recognise"]
    kept_u, kept_d = result.u[:, [0, 2]], distributions[[0, 2]][:, [0, 2]]
    assert torch.equal(calls[0][1], kept_u) and torch.equal(calls[0][2], normalise(kept_u)[0])
    assert torch.equal(calls[0][3][1], kept_d) and torch.equal(calls[1][1], kept_u)
    assert torch.equal(calls[2][1], kept_u) and torch.equal(calls[2][2], kept_d)
    seen.clear()
    off, ctx = strategy(tmp_path, **{"peer-expel": 0.0})
    assert off.check_peers(ensemble, result, ctx) == "checked" and not seen
    paper_on, ctx = strategy(tmp_path, **{"mode": "paper", "peer-check": "on"})  # the paper mode's 0: not expelled
    assert paper_on.params.resolved("peer_expel") == 0.0 and paper_on.check_peers(ensemble, result, ctx) == "checked"
    # the mode's value follows only the agreement check: the round trip runs without it, and is not refused
    monkeypatch.setattr(fh, "round_trip", lambda *args: "round trip")
    trip, ctx = strategy(tmp_path, **{"peer-check": "roundtrip"})
    assert trip.check_peers(ensemble, result, ctx) == "round trip" and not seen


def test_recognition_of_the_suspects_scales_the_clients_discredit_rejected(tmp_path, monkeypatch):
    seen = {}
    rejected = PeerCheck(*(torch.zeros(1),) * 7, rejected=torch.tensor([0, 2, 1]), credit=torch.ones(3))
    monkeypatch.setattr(fh, "peer_distributions", lambda models, samples, device: torch.rand(3, 3, C, C))
    monkeypatch.setattr(fh, "peer_check", lambda *args, **kwargs: "checked")
    monkeypatch.setattr(fh, "agreement_of", lambda among: "agreement")
    monkeypatch.setattr(fh, "discredit", lambda check, *args, **kwargs: rejected)
    monkeypatch.setattr(fh, "recognise", lambda check, u, distributions, *, power, clients: seen.update(
        check=check, clients=clients) or "recognised")
    hydra, ctx = strategy(tmp_path, **{"peer-recognition": 2.0, "peer-reject-below": 0.1, "peer-rejections": 2,
                                       "peer-recognition-of": "suspects", "peer-expel": 0.0})
    assert hydra.check_peers(ClientEnsemble(fleet(), ["lin"] * 3), fixed_result(), ctx) == "recognised"
    assert seen["check"] is rejected and seen["clients"].tolist() == [False, True, False]  # >= 2 rejections


@pytest.mark.parametrize("knobs, named", [
    ({"peer-recognition": 2.0, "peer-check": "off"}, "peer-recognition"),
    ({"peer-expel": 0.6, "peer-check": "roundtrip"}, "peer-expel"),
    ({"peer-expel": 0.5, "mode": "paper"}, "peer-expel"),
    ({"peer-recognition": 2.0, "peer-check": "roundtrip"}, "peer-recognition"),
    ({"peer-reject-below": 0.1, "mode": "paper"}, "peer-reject-below"),
])
def test_the_agreement_checks_followers_are_refused_without_it(tmp_path, knobs, named):
    from oneshot_fl.config import ConfigError

    with pytest.raises(ConfigError, match=rf"fedhydra\.{named} follows the agreement check, which this run does not "
                                          rf"make \(fedhydra\.peer-check resolves to '(off|roundtrip)'\)"):
        strategy(tmp_path, **knobs)
    assert strategy(tmp_path, **{**knobs, "peer-check": "on"})[0].params.peer_check == "on"


@pytest.mark.parametrize("knobs", [{"peer-recognition": 2.0}, {"peer-reject-below": 0.1}, {}])
def test_recognition_of_the_suspects_needs_recognition_and_discredit(tmp_path, knobs):
    from oneshot_fl.config import ConfigError

    with pytest.raises(ConfigError, match=r"fedhydra\.peer-recognition-of='suspects' scales the clients that "
                                          r"discredit rejects: set fedhydra\.peer-recognition > 0 and "
                                          r"fedhydra\.peer-reject-below > 0"):
        strategy(tmp_path, **knobs, **{"peer-recognition-of": "suspects"})


def test_ms_the_logit_caps_and_the_peer_check_run_without_the_bn_statistics(tmp_path, monkeypatch):
    from oneshot_fl.models.registry import build

    ensemble = ClientEnsemble([build("cnn2", (1, 28, 28), C, seed=s) for s in (0, 1)], ["cnn2"] * 2)
    hooks = [h for runner in ensemble.runners for per_model in runner.bn.per_model for h in per_model]
    states = {}

    def seen(name, value):
        def call(*args, **kwargs):
            states[name] = [h.enabled for h in hooks]
            return value
        return call
    monkeypatch.setattr(fh, "stratify_sequential", seen("ms", fixed_result()))
    monkeypatch.setattr(fh, "logit_scales", seen("caps", torch.ones(2)))
    monkeypatch.setattr(fh, "peer_distributions", seen("peers", torch.zeros(2, 2, C, C)))
    monkeypatch.setattr(fh, "peer_check", lambda *args, **kwargs: None)
    monkeypatch.setattr(fh, "discredit", lambda *args, **kwargs: None)
    monkeypatch.setattr(fh, "expel", lambda *args, **kwargs: None)
    hydra, ctx = strategy(tmp_path)
    hydra.stratify(ensemble, ctx), hydra.logit_caps(ensemble, fixed_result(), ctx)
    hydra.check_peers(ensemble, fixed_result(), ctx)
    assert hooks and states == {name: [False] * len(hooks) for name in ("ms", "caps", "peers")}
    assert all(h.enabled for h in hooks)  # back on for the distillation
    ensemble.close()


def test_generator_loss_and_student_beta_carry_the_knobs(tmp_path):
    hydra, _ = strategy(tmp_path, **{"lambda-bn": 0.5, "lambda-adv": 2.0, "adv-mask": "disagree", "beta": 0.3})
    assert hydra.generator_loss() == GeneratorLoss(ce=1.0, bn=0.5, adv=2.0, adv_mask="disagree")
    assert hydra.student_beta() == 0.3


# --- stratification_report: the server actions it states ------------------------------------

def one_owner():
    u = torch.tensor([[0.9, 0.01], [0.01, 0.9]])
    u_r, u_c = normalise(u)
    return Stratification(u=u, u_r=u_r, u_c=u_c, losses=torch.zeros(2, 2, 1)), [np.array([30, 0]),
                                                                                np.array([0, 30])]


@pytest.mark.parametrize("route, space, says", [
    ("label", "logits", "SA routes by the synthetic label, so a sample's teacher is its class's owner alone"),
    ("class", "capped", "SA routes by output class on capped logits: each class is scored by its owner, and an "
                        "owner answers an input of a class it never saw with smaller logits than that class's owner"),
    ("class", "calibrated", "SA routes by output class on calibrated logits: each class is scored by its owner, on "
                            "the owner's own scale, and an owner answers an input of a class it never saw less "
                            "strongly than it answers its typical input"),
    ("class", "probs", "SA routes by output class, so every owner scores every sample"),
    ("class", "logits", "SA routes by output class, so every owner scores every sample"),
])
def test_one_owner_fleet_is_reported_with_what_the_route_does(route, space, says):
    result, counts = one_owner()
    report = fh.stratification_report(result, None, counts, route, space)
    assert report["one_owner_per_class"] is True and report["owners_per_class"] == [1, 1]
    assert report["server_action"] == "one owner per class in the uploaded counts (report only): " + says
    assert report["tracking"]["mean_spearman"] == pytest.approx(1.0)  # U_r ranks the owner first


def test_peer_check_report_lists_shrunk_pairs_and_unjudgeable_classes():
    """Pairs shrunk: verifiable, trust < 0.5 and MS weight >= 0.1; a class whose top client is not
    verifiable is named."""
    u = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6], [0.5, 0.05, 0.45]])
    u_r, u_c = normalise(u)
    result = Stratification(u=u, u_r=u_r, u_c=u_c, losses=torch.zeros(3, 3, 1))
    trust = torch.tensor([[1.0, 0.4, 0.2], [0.3, 1.0, 0.9], [1.0, 0.1, 0.49]])
    verifiable = torch.tensor([[True, True, True], [True, True, False], [False, True, True]])
    checked = (u * trust)
    c_r, c_c = normalise(checked)
    check = PeerCheck(agreement=trust, evidence=torch.ones(3, 3), trust=trust, verifiable=verifiable, u=checked,
                      u_r=c_r, u_c=c_c)
    counts = [np.array([10, 0, 5]), np.array([5, 5, 0]), np.array([0, 10, 5])]
    report = fh.stratification_report(result, check, counts, "class", "capped")
    # (0, 1): u_r 0.3, trust 0.4 -> shrunk; (0, 2): u_r 0.2, trust 0.2 -> shrunk; (1, 0): u_r 0.2, trust 0.3 -> shrunk;
    # (2, 1): u_r 0.05 < 0.1 -> not; (2, 2): trust 0.49, u_r 0.45 -> shrunk; (1, 2) not verifiable -> not
    assert report["peer_check"]["shrunk"] == [(0, 1), (0, 2), (1, 0), (2, 2)]
    # after the check class 1's top client is 2 (not verifiable); class 2's top is client 0 (not verifiable)
    assert report["server_action"] == ("peer check shrank 4 weighted (class, client) pairs below half "
                                       "[(0, 1), (0, 2), (1, 0), (2, 2)]; classes [1, 2] have a top client no peer "
                                       "can judge (left as scored)")
    assert report["peer_check"]["trust"] == check.trust.tolist() and report["score"] == result.score
    assert report["tracking"]["after_peer_check"] == fh.tracking(check.u_r, counts)
    assert report["tracking"]["mean_spearman"] == report["tracking"]["after_peer_check"]["mean_spearman"]
    assert report["tracking"]["ms"] == fh.tracking(result.u_r, counts)
    # the same check after `discredit` at 0.35: judged pairs with MS weight >= 0.1 are client 0's classes 0, 1
    # (trust 1.0, 0.3: one rejection), client 1's 0, 1 (0.4, 1.0: none; its class 2, trust 0.1, carried 0.05) and
    # client 2's 0, 2 (0.2, 0.49: one). The unjudged pairs of the rejected keep the median of their judged trust,
    # the lower middle value of two: client 0 0.3 (its class 2), client 2 0.2 (its class 1)
    discredited = discredit(check, u, u_r, below=0.35, rejections=1)
    assert discredited.credit.tolist() == pytest.approx([0.3, 1.0, 0.2])
    assert discredited.trust[2, 0].item() == pytest.approx(0.3) and discredited.trust[1, 2].item() == pytest.approx(0.2)
    report = fh.stratification_report(result, discredited, counts, "class", "capped")
    assert report["server_action"].endswith(
        "; clients the peers rejected outright on a judged class keep the median trust of their judged classes on "
        "the classes no one could judge (upload index, rejections, trust): [(0, 1, 0.3), (2, 1, 0.2)]")
    assert report["peer_check"]["credit"] == pytest.approx([0.3, 1.0, 0.2])
    assert report["peer_check"]["rejected"] == [1, 0, 1]



def test_expel_report_names_the_clients_left_out_or_says_none_was():
    u = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
    u_r, u_c = normalise(u)
    result = Stratification(u=u, u_r=u_r, u_c=u_c, losses=torch.zeros(3, 2, 1))
    ones = torch.ones(2, 3)
    counts = [np.array([5, 0]), np.array([0, 5]), np.array([5, 5])]
    check = PeerCheck(agreement=ones, evidence=ones, trust=torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 1.0]]),
                      verifiable=ones.bool(), u=u, u_r=u_r, u_c=u_c, rejected_share=torch.tensor([0.1, 0.8123, 0.0]),
                      claim_recognition=torch.tensor([0.4, 0.0212, 0.3]), expelled=torch.tensor([False, True, False]))
    report = fh.stratification_report(result, check, counts, "class", "calibrated")
    assert report["server_action"].endswith(
        "; left out of the teacher 1 client(s) the peers mostly reject and that do not recognise their images of "
        "the classes they claim (upload index, rejected share, claim recognition; median 0.3): [(1, 0.812, 0.021)]")
    assert report["peer_check"]["expelled"] == [False, True, False]
    assert report["peer_check"]["rejected_share"] == pytest.approx([0.1, 0.8123, 0.0])
    nobody = dataclasses.replace(check, expelled=torch.zeros(3, dtype=torch.bool))
    assert fh.stratification_report(result, nobody, counts, "class", "calibrated")["server_action"].endswith(
        "; no client both mostly rejected and blind to its peers' images of its classes")


def test_recognition_report_lists_the_weighted_pairs_it_took_half_of():
    u = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
    u_r, u_c = normalise(u)
    result = Stratification(u=u, u_r=u_r, u_c=u_c, losses=torch.zeros(3, 2, 1))
    ones = torch.ones(2, 3)
    check = PeerCheck(agreement=ones, evidence=ones, trust=ones, verifiable=ones.bool(), u=u, u_r=u_r, u_c=u_c,
                      recognition=torch.zeros(2, 3), recognised=torch.tensor([[1.0, 0.4, 0.3], [0.45, 0.9, 1.0]]))
    report = fh.stratification_report(result, check, [np.array([5, 0]), np.array([0, 5]), np.array([5, 5])],
                                      "class", "calibrated")
    # (0, 1): u_r 0.3, factor 0.4; (0, 2): u_r 0.2, 0.3; (1, 0): u_r 0.2, 0.45; (1, 1) keeps 0.9
    assert report["server_action"].endswith(
        "; recognition took at least half of 3 weighted (class, client) pairs whose client recognises its peers' "
        "images of the class far less than the class's best recogniser does [(0, 1), (0, 2), (1, 0)]")
    assert report["peer_check"]["recognised"] == check.recognised.tolist()


@pytest.mark.parametrize("space, says", [
    ("calibrated", "SA on calibrated logits: each client's standardised by the mean and spread of its top logit over "
                   "each batch"),
    ("capped", "SA on capped logits; each client's logits divided by [1.0, 1.0, 3.0]"),
])
def test_what_the_server_log_says(tmp_path, monkeypatch, caplog, space, says):
    record_ms(monkeypatch)
    hydra, ctx = strategy(tmp_path, **{"ms-steps": 5, "sa-space": space})
    ensemble = ClientEnsemble(fleet(), ["lin"] * 3)
    with caplog.at_level("INFO", logger="oneshot_fl.strategy"):
        aggregator = hydra.make_aggregator(ensemble, uploads(), ctx)
    report = json.loads((tmp_path / "stratification.json").read_text())
    top = [round(float(v), 3) for v in aggregator.u_r.max(dim=1).values]
    assert [r.getMessage() for r in caplog.records if r.module == "fedhydra"] == [
        "stratification: 3 clients x 3 classes, T_G=5, prob-auc score",
        f"stratification done in 1.5s (prob-auc score); U_r top weight per class: {top}; rank correlation of U_r "
        f"with the uploaded label shares (report only): mean {report['tracking']['mean_spearman']:.2f}",
        says,
        f"FedHydra: {report['server_action']}",
    ]


def test_the_u_heatmaps_show_the_used_u_with_their_meaning(tmp_path, monkeypatch):
    record_ms(monkeypatch)
    drawn = []
    monkeypatch.setattr(fh.plots, "heatmap", lambda values, path, title, xlabel, ylabel: drawn.append(
        (values, path, title, xlabel, ylabel)))
    hydra, ctx = strategy(tmp_path)
    aggregator = hydra.make_aggregator(ClientEnsemble(fleet(), ["lin"] * 3), uploads(), ctx)
    assert [d[1:] for d in drawn] == [
        (tmp_path / "stratification_u_r.png", "U_r: whom to trust for each class (rows sum to 1)", "client", "class"),
        (tmp_path / "stratification_u_c.png", "U_c: what each client is good at (columns sum to 1)", "client", "class")]
    assert np.array_equal(drawn[0][0], aggregator.u_r.numpy()) and np.array_equal(drawn[1][0], aggregator.u_c.numpy())


def test_the_unjudgeable_class_is_read_at_the_checked_top_client_and_every_action_is_listed():
    """(c=2, m=3). Class 0: MS's top client 0 (verifiable) loses to client 1 (not verifiable) after the check.
    One owner per class in the counts: the report's second action, after a '; '."""
    u = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    u_r, u_c = normalise(u)
    result = Stratification(u=u, u_r=u_r, u_c=u_c, losses=torch.zeros(3, 2, 1))
    trust = torch.tensor([[0.2, 1.0, 1.0], [1.0, 1.0, 1.0]])
    verifiable = torch.tensor([[True, False, True], [True, True, True]])
    c_r, c_c = normalise(u * trust)  # class 0: [0.12, 0.3, 0.1]
    check = PeerCheck(agreement=trust, evidence=torch.ones(2, 3), trust=trust, verifiable=verifiable, u=u * trust,
                      u_r=c_r, u_c=c_c)
    report = fh.stratification_report(result, check, [np.array([10, 0]), np.array([0, 10]), np.array([0, 0])],
                                      "class", "calibrated")
    assert report["server_action"] == (
        "peer check shrank 1 weighted (class, client) pairs below half [(0, 0)]; classes [0] have a top client no "
        "peer can judge (left as scored); one owner per class in the uploaded counts (report only): SA routes by "
        "output class on calibrated logits: each class is scored by its owner, on the owner's own scale, and an "
        "owner answers an input of a class it never saw less strongly than it answers its typical input")


def test_a_round_trip_that_shrank_nothing_says_so_without_a_list():
    u = torch.tensor([[0.9, 0.1], [0.1, 0.9]])
    u_r, u_c = normalise(u)
    result = Stratification(u=u, u_r=u_r, u_c=u_c, losses=torch.zeros(2, 2, 1))
    check = round_trip(u, u_r, torch.eye(2).expand(2, 2, 2, 2))  # every answer the asked class: no match
    report = fh.stratification_report(result, check, [np.array([5, 5]), np.array([5, 5])], "class", "calibrated")
    assert report["server_action"] == "round-trip check shrank 0 weighted (class, client) pairs below half"
    assert report["peer_check"]["shrunk"] == []


def test_halved_pairs_boundaries_on_a_non_square_fleet():
    # (c=2, m=3): trust exactly 0.5 is not halved; an MS weight of exactly 0.1 counts as carried
    trust = torch.tensor([[0.5, 0.49, 0.2], [0.1, 0.3, 1.0]])
    ms_u_r = torch.tensor([[0.1, 0.1, 0.8], [0.09, 0.1, 0.81]], dtype=torch.float64)  # 0.1 exactly the bound
    assert fh.halved_pairs(trust, ms_u_r) == [(0, 1), (0, 2), (1, 1)]


def test_a_peer_check_that_shrank_nothing_says_so_without_a_list():
    u = torch.tensor([[0.9, 0.1], [0.1, 0.9]])
    u_r, u_c = normalise(u)
    result = Stratification(u=u, u_r=u_r, u_c=u_c, losses=torch.zeros(2, 2, 1))
    ones = torch.ones(2, 2)
    check = PeerCheck(agreement=ones, evidence=ones, trust=ones, verifiable=ones.bool(), u=u, u_r=u_r, u_c=u_c)
    report = fh.stratification_report(result, check, [np.array([5, 5]), np.array([5, 5])], "class", "calibrated")
    assert report["server_action"] == "peer check shrank 0 weighted (class, client) pairs below half"
    assert report["peer_check"]["shrunk"] == []


def test_owner_count_boundary_and_empty_class():
    # class 0: 5 of 100 (exactly the 5 % share: an owner) and 95; class 1: 4 of 100 (not) and 96; class 2: none held
    counts = [np.array([5, 4, 0]), np.array([95, 96, 0])]
    assert fh.owners_per_class(counts) == [2, 1, 0]
    assert fh.owners_per_class(counts, share=0.06) == [1, 1, 0]
    assert fh.owners_per_class([np.array([1, 0]), np.array([0, 0])]) == [1, 0]  # one example is a class held


def test_tracking_leaves_classes_without_a_ranking_undefined():
    counts = [np.array([10, 5, 0]), np.array([0, 5, 0]), np.array([5, 5, 0])]
    u_r = torch.tensor([[0.6, 0.1, 0.3], [0.2, 0.5, 0.3], [1 / 3, 1 / 3, 1 / 3]])
    out = fh.tracking(u_r, counts)
    # class 0 shares (2/3, 0, 1/3) rank like U_r's row: 1.0; class 1 shares are equal (no ranking);
    # class 2 nobody holds (shares 0) and its U_r row is constant
    assert out["spearman_per_class"] == [pytest.approx(1.0), None, None]
    assert out["mean_spearman"] == pytest.approx(1.0)
    flat = fh.tracking(torch.full((3, 3), 1 / 3), counts)
    assert flat["spearman_per_class"] == [None, None, None] and np.isnan(flat["mean_spearman"])
    reversed_row = fh.tracking(torch.tensor([[0.1, 0.6, 0.3]] * 3), counts)
    assert reversed_row["spearman_per_class"] == [pytest.approx(-1.0), None, None]
    assert reversed_row["mean_spearman"] == pytest.approx(-1.0)


def test_tracking_on_more_classes_than_clients_by_hand():
    counts = [np.array([10, 5, 0, 1]), np.array([0, 5, 3, 2]), np.array([5, 5, 9, 3])]  # (m=3, c=4)
    u_r = torch.tensor([[0.6, 0.1, 0.3], [0.2, 0.3, 0.5], [0.2, 0.3, 0.5], [0.5, 0.3, 0.2]])
    out = fh.tracking(u_r, counts)
    # class 0 ranks (2, 0, 1) both ways: 1; class 1 equal counts: none; class 2 ranks agree: 1; class 3 reversed: -1
    assert out["spearman_per_class"] == [pytest.approx(1.0), None, pytest.approx(1.0), pytest.approx(-1.0)]
    assert out["mean_spearman"] == pytest.approx(1 / 3)


@pytest.mark.parametrize("key", ["bn-cap", "ms-stop-loss", "peer-expel"])
def test_sentinel_knobs_refuse_values_between_the_sentinel_and_off(key, tmp_path):
    from oneshot_fl.config import ConfigError

    for bad in (-0.5, -2.0):
        message = rf"fedhydra\.{key}={bad} is out of range: must be >= 0\.0 \(or -1\.0: the mode's value\)"
        with pytest.raises(ConfigError, match=message):
            strategy(tmp_path, **{key: bad})
    for ok in (-1.0, 0.0, 0.5):
        assert getattr(strategy(tmp_path, **{key: ok})[0].params, key.replace("-", "_")) == ok
