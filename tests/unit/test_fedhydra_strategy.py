"""FedHydra's strategy steps on a hand-built 3-client fleet, without data sets or Flower: what MS is
asked to do per mode, which U / space / route reach the SA teacher, what `weigh` is given and does per
recipe, the generator's objective, what stratification.json and the run's metrics say, and the report's
server actions. (Fast: the mutation tests run these.)"""

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import strategies.fedhydra as fh
import strategies.fedhydra_report as fr
from oneshot_fl.config import distill_schedule, from_run_config, merge_overrides, resolved_config
from oneshot_fl.engine.stratify import Stratification, normalise
from oneshot_fl.engine.synthesizer import GeneratorLoss
from oneshot_fl.engine.teachers import Calibration, ClientEnsemble, StratifiedAggregation, Teacher, calibrate
from oneshot_fl.engine.trust import PeerCheck, agreement_of, peer_check, peer_distributions
from oneshot_fl.models.generator import GeneratorSpec
from strategies.context import FuseContext

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
    return [SimpleNamespace(partition_id=k, arch="lin", label_counts=counts[k], dp=None) for k in range(3)]


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
    ({}, 16, "prob-auc", 0.01, 16),  # robust: small batch, bounded score, early stop, images kept for the check
    ({"mode": "paper"}, "synth", "paper", 0.0, 0),  # paper: distill.synth-batch, Eq. 2, no stop, none kept
])
def test_ms_gets_the_modes_settings(tmp_path, monkeypatch, overrides, batch, score, stop, keep):
    calls = record_ms(monkeypatch)
    hydra, ctx = strategy(tmp_path, **overrides, **{"ms-steps": 7})
    ensemble = ClientEnsemble(fleet(), ["lin"] * 3)
    assert hydra.stratify(ensemble, ctx).u.shape == (C, 3)
    (name, args, kwargs), = calls
    dcfg = hydra.cfg.distill
    assert name == "sequential"  # on a CPU
    assert args[0] is ensemble.models and args[1] == C and args[3] == 7
    assert args[2] == GeneratorSpec(dcfg.nz, dcfg.ngf, 28, 1)
    assert args[4] == (dcfg.synth_batch if batch == "synth" else batch) == hydra.ms_batch()
    assert dcfg.synth_batch != 16  # the two batches differ on this preset: the test tells them apart
    assert args[5] == dcfg.lr_generator and args[6] == ctx.seed("stratification") and args[7] == ctx.device
    assert kwargs == {"score": score, "stop_loss": stop, "keep_samples": keep}


@pytest.mark.parametrize("device, runs", [("cuda", "batched"), ("cpu", "sequential")])
def test_ms_runs_vmapped_on_gpus_and_as_a_loop_on_cpus(tmp_path, monkeypatch, device, runs):
    calls = record_ms(monkeypatch)
    hydra, ctx = strategy(tmp_path)
    ctx.device = torch.device(device)  # MS itself is recorded, not run: no GPU needed
    hydra.stratify(ClientEnsemble(fleet(), ["lin"] * 3), ctx)
    assert [c[0] for c in calls] == [runs]


def test_resolved_settings_are_the_modes_recipe_with_the_ms_batch_and_steps(tmp_path):
    robust, _ = strategy(tmp_path, **{"ms-steps": 7})
    assert robust.recipe is fh.RECIPES["robust"]
    assert robust.resolved_settings() == {
        "mode": "robust", "score": "prob-auc", "stop_loss": 0.01, "ms_batch": 16, "expel": True,
        "sa_space": "calibrated", "sa_route": "class", "bn_cap": 10.0, "peer_min_evidence": 0.25, "peer_judges": 2,
        "expel_rejected": 0.6, "expel_recognition": 0.5, "calibration": "running", "ms_steps": 7}
    paper, _ = strategy(tmp_path, mode="paper")
    assert paper.recipe is fh.RECIPES["paper"] and paper.params.mode == "paper"
    settings = paper.resolved_settings()
    recipe = dataclasses.asdict(fh.RECIPES["paper"])
    # every field of the paper recipe, its MS batch resolved to distill.synth-batch (the recipe's 0)
    assert settings == {"mode": "paper", **recipe, "ms_batch": paper.cfg.distill.synth_batch,
                        "ms_steps": paper.params.ms_steps}
    assert (settings["score"], settings["stop_loss"], settings["expel"], settings["sa_space"],
            settings["sa_route"], settings["bn_cap"]) == ("paper", 0.0, False, "logits", "label", 0.0)
    assert recipe["ms_batch"] == 0


def test_the_run_config_has_only_the_recipe_and_the_papers_weights(tmp_path):
    from oneshot_fl.config import ConfigError

    assert [f.name for f in dataclasses.fields(fh.FedHydraParams)] == ["mode", "ms_steps", "lambda_bn", "lambda_adv",
                                                                     "beta"]
    with pytest.raises(ConfigError, match=r"fedhydra\.mode='fast' is not allowed; choose one of: 'paper', 'robust'"):
        strategy(tmp_path, mode="fast")
    with pytest.raises(ConfigError, match=r"^fedhydra\.sa-space: retired.*docs/decisions\.md"):
        strategy(tmp_path, **{"sa-space": "logits"})


def test_robust_aggregator_uses_ms_u_calibrated_logits_and_writes_what_the_check_found(tmp_path, monkeypatch):
    record_ms(monkeypatch)
    hydra, ctx = strategy(tmp_path)
    models = fleet()
    ensemble = ClientEnsemble(models, ["lin"] * 3)
    aggregator, returned = hydra.make_aggregator(ensemble, uploads(), ctx)

    result = fixed_result()
    agree = agreement_of(peer_distributions(models, result.samples, ctx.device))
    checked = peer_check(result.u, result.u_r, agree, min_evidence=0.25, judges=2)
    expected = result  # nobody expelled: the teacher's U is MS's own, the check only decides expel
    assert isinstance(aggregator, StratifiedAggregation)
    assert (aggregator.space, aggregator.route) == ("calibrated", "class")
    assert torch.equal(aggregator.u_r, expected.u_r) and torch.equal(aggregator.u_c, expected.u_c)
    assert ensemble.bn_cap == 10.0 and len(ensemble) == 3  # nobody expelled on this fleet
    assert "stratification" in ctx.timer.seconds

    report = json.loads((tmp_path / "stratification.json").read_text())
    assert report["clients"] == ["p0 lin", "p1 lin", "p2 lin"]
    assert torch.allclose(torch.tensor(report["used_u_r"]), expected.u_r)
    assert torch.allclose(torch.tensor(report["used_u_c"]), expected.u_c)
    assert torch.equal(torch.tensor(report["u_r"]), result.u_r)  # MS's own U beside the used one (the same here)
    # the check distrusts some pair, and the teacher's U_r is still MS's: the trust does not reweight it
    assert (checked.trust < 1).any()
    assert report["settings"] == hydra.resolved_settings()
    assert report["settings"]["sa_space"] == "calibrated" and report["settings"]["mode"] == "robust"
    assert "logit_divisors" not in report and "louder" not in report["server_action"]
    assert report["server_action"] == "no client both mostly rejected and blind to its peers' images of its classes"
    assert report["one_owner_per_class"] is False and report["owners_per_class"] == [1, 1, 3]
    assert torch.allclose(torch.tensor(report["peer_check"]["trust"]), checked.trust)  # the check is reported
    assert not {"u", "u_r", "u_c"} & set(report["peer_check"])  # and no reweighted U beside it
    assert report["peer_check"]["expelled"] == [False, False, False]
    for key in ("u_r", "u_c"):
        assert (tmp_path / f"stratification_{key}.png").stat().st_size > 0
    assert set(returned) == {"stratification"}  # what result.json's global block gets from this stage
    summary = returned["stratification"]
    assert set(summary) == {"tracking", "one_owner_per_class", "server_action"}
    assert summary["server_action"] == report["server_action"]
    assert summary["one_owner_per_class"] is False and summary["tracking"] == report["tracking"]

    x = torch.eye(C)[[0, 1, 2, 0]] * torch.tensor([1.0, 2.0, 0.5, 3.0])[:, None]  # top logits vary over the batch
    logits = ensemble.logits(x.view(4, 1, 1, C))
    # the teacher answers on the running statistics it starts from (the clients on MS's images), not the batch's
    start = aggregator.calibration.stats
    with aggregator.frozen():
        out = aggregator(logits)
    assert torch.allclose(out, torch.einsum("ck,kbc->bc", expected.u_r, calibrate(logits, start)), atol=1e-6)
    assert not torch.allclose(out, torch.einsum("ck,kbc->bc", expected.u_r, calibrate(logits)), atol=1e-3)
    # client 2 answers x3 louder: calibrated, its logits are the others' (each client on its own scale)
    assert torch.allclose(calibrate(logits)[2], calibrate(logits)[0], atol=1e-6)


def test_an_expelled_client_leaves_the_teacher_bank_and_the_teacher_is_that_of_the_fleet_without_it(
        tmp_path, monkeypatch):
    record_ms(monkeypatch)
    result = fixed_result()
    ones = torch.ones(C, 3)
    expelled = PeerCheck(agreement=ones, evidence=ones, trust=ones, verifiable=ones.bool(),
                         rejected_share=torch.zeros(3), claim_recognition=torch.ones(3),
                         expelled=torch.tensor([False, True, False]))
    monkeypatch.setattr(fh, "expel", lambda *args, **kwargs: expelled)
    hydra, ctx = strategy(tmp_path)
    models = fleet()
    ensemble = ClientEnsemble(models, ["lin"] * 3)
    aggregator, _ = hydra.make_aggregator(ensemble, uploads(), ctx)
    assert len(ensemble) == 2 and ensemble.models == [models[0], models[2]]
    without = normalise(result.u[:, [0, 2]])  # the weights a fleet of clients 0 and 2 gets, bit for bit
    assert torch.equal(aggregator.u_r, without[0]) and torch.equal(aggregator.u_c, without[1])
    report = json.loads((tmp_path / "stratification.json").read_text())
    assert torch.equal(torch.tensor(report["used_u_r"])[:, 1], torch.zeros(C))  # the report keeps every column
    nobody = dataclasses.replace(expelled, expelled=torch.zeros(3, dtype=torch.bool))
    monkeypatch.setattr(fh, "expel", lambda *args, **kwargs: nobody)
    kept = ClientEnsemble(fleet(), ["lin"] * 3)
    hydra.make_aggregator(kept, uploads(), ctx)
    assert len(kept) == 3


def flipped_result() -> Stratification:
    """fixed_result, but client 2's class-j images are e_{j-1}: what MS finds for a label-flipped client."""
    result = fixed_result()
    result.samples[2] = torch.roll(result.samples[2], 1, dims=0)
    return result


def test_the_robust_aggregator_leaves_a_label_flipped_client_out_and_reports_it(tmp_path, monkeypatch):
    """Clients 0 and 1 answer class j on e_j, client 2 on e_{j-1} (louder): its MS images are rolled. Its peers
    reject every class it claims and it does not recognise theirs: expelled, its column 0, its BN left out."""
    monkeypatch.setattr(fh, "stratify_sequential", lambda *args, **kwargs: flipped_result())
    hydra, ctx = strategy(tmp_path)
    models = [Linear(2.0 * torch.eye(C)), Linear(2.0 * torch.eye(C)), Linear(6.0 * torch.roll(torch.eye(C), 1, 0))]
    ensemble = ClientEnsemble(models, ["lin"] * 3)
    aggregator, _ = hydra.make_aggregator(ensemble, uploads(), ctx)
    result = flipped_result()
    expected = fh.weigh(result.u, peer_distributions(models, result.samples, ctx.device), fh.RECIPES["robust"])
    assert expected.left_out.tolist() == [False, False, True]
    assert torch.equal(aggregator.u_r, expected.u_r[:, :2]) and torch.equal(aggregator.u_c, expected.u_c[:, :2])
    assert expected.u_r[:, 2].abs().max() == 0 and ensemble.models == models[:2]
    report = json.loads((tmp_path / "stratification.json").read_text())
    assert report["peer_check"]["expelled"] == [False, False, True]
    share, claims = expected.check.rejected_share, expected.check.claim_recognition
    assert (f"left out of the teacher 1 client(s) the peers mostly reject and that do not recognise their images "
            f"of the classes they claim (upload index, rejected share, claim recognition; median "
            f"{round(float(claims.median()), 3)}): [(2, {round(float(share[2]), 3)}, {round(float(claims[2]), 3)})]"
            ) in report["server_action"]


def test_paper_aggregator_uses_ms_u_in_logit_space_routed_by_label_without_a_check(tmp_path, monkeypatch):
    record_ms(monkeypatch)
    monkeypatch.setattr(fh, "peer_distributions", lambda *args: pytest.fail("the paper mode asks no peer"))
    hydra, ctx = strategy(tmp_path, mode="paper")
    ensemble = ClientEnsemble(fleet(), ["lin"] * 3)
    aggregator, _ = hydra.make_aggregator(ensemble, uploads(), ctx)
    result = fixed_result()
    assert (aggregator.space, aggregator.route) == ("logits", "label")
    assert torch.equal(aggregator.u_r, result.u_r) and torch.equal(aggregator.u_c, result.u_c)
    assert ensemble.bn_cap == 0.0 and len(ensemble) == 3
    report = json.loads((tmp_path / "stratification.json").read_text())
    assert "peer_check" not in report and report["settings"]["mode"] == "paper"
    assert report["server_action"] == "stratification only (no peer check)"


@pytest.mark.parametrize("mode, says", [
    ("paper", "SA routes by the synthetic label, so a sample's teacher is its class's owner alone"),
    ("robust", "SA routes by output class on calibrated logits: each class is scored by its owner, on the owner's "
               "own scale, and an owner answers an input of a class it never saw less strongly than it answers its "
               "typical input"),
])
def test_the_report_describes_the_route_and_space_the_teacher_uses(tmp_path, monkeypatch, mode, says):
    record_ms(monkeypatch)
    hydra, ctx = strategy(tmp_path, mode=mode)
    one_owner_each = [SimpleNamespace(partition_id=k, arch="lin", label_counts=np.eye(C, dtype=int)[k] * 50, dp=None)
                      for k in range(3)]
    hydra.make_aggregator(ClientEnsemble(fleet(), ["lin"] * 3), one_owner_each, ctx)
    action = json.loads((tmp_path / "stratification.json").read_text())["server_action"]
    assert action.endswith("one owner per class in the uploaded counts (report only): " + says)


def test_weigh_gets_ms_u_the_peers_view_and_the_recipe(tmp_path, monkeypatch):
    seen = {}
    distributions = torch.rand(3, 3, C, C)
    monkeypatch.setattr(fh, "stratify_sequential", lambda *args, **kwargs: fixed_result())
    monkeypatch.setattr(fh, "peer_distributions", lambda models, samples, device, peers: seen.update(
        samples=samples, device=device, graph=peers) or distributions)

    def weigh(u, d, recipe, peers=None):
        seen.update(u=u, d=d, recipe=recipe, peers=peers)
        return fh.Weighting(*normalise(u), check=None, left_out=None)
    monkeypatch.setattr(fh, "weigh", weigh)
    hydra, ctx = strategy(tmp_path)
    hydra.make_aggregator(ClientEnsemble(fleet(), ["lin"] * 3), uploads(), ctx)
    result = fixed_result()
    assert torch.equal(seen["u"], result.u) and seen["d"] is distributions and seen["recipe"] is fh.RECIPES["robust"]
    assert torch.equal(seen["samples"], result.samples) and seen["device"] == ctx.device
    # one peer graph for the images shown and the check: every other client in a fleet of 3
    assert seen["graph"] is seen["peers"] and torch.equal(seen["peers"], ~torch.eye(3, dtype=torch.bool))
    seen.clear()
    paper, ctx = strategy(tmp_path, mode="paper")
    paper.make_aggregator(ClientEnsemble(fleet(), ["lin"] * 3), uploads(), ctx)
    assert seen["d"] is None and seen["recipe"] is fh.RECIPES["paper"] and "samples" not in seen


def test_weigh_without_expel_makes_no_check_and_keeps_ms_u(monkeypatch):
    monkeypatch.setattr(fh, "peer_check", lambda *args, **kwargs: pytest.fail("no check without expel"))
    monkeypatch.setattr(fh, "expel", lambda *args, **kwargs: pytest.fail("expel is off"))
    u = fixed_result().u
    w = fh.weigh(u, torch.rand(3, 3, C, C), dataclasses.replace(fh.RECIPES["robust"], expel=False))
    assert w.check is None and w.left_out is None
    assert torch.equal(w.u_r, normalise(u)[0]) and torch.equal(w.u_c, normalise(u)[1])


def test_weigh_expels_with_the_agreement_check_on_the_kept_clients_and_the_recipes_bars(monkeypatch):
    seen, calls = {}, []
    distributions = torch.arange(3 * 3 * C * C, dtype=torch.float).view(3, 3, C, C)
    monkeypatch.setattr(fh, "agreement_of", lambda among: ("agreement of", among))
    monkeypatch.setattr(fh, "peer_check", lambda u, u_r, agree, **kwargs: calls.append((u, u_r, agree, kwargs)) or
                        "checked")
    nobody = SimpleNamespace(expelled=torch.zeros(3, dtype=torch.bool))  # a check: all weigh may read of it
    monkeypatch.setattr(fh, "expel", lambda check_of, u, distributions, *, rejected_above, recognition_below, peers:
                        seen.update(check_of=check_of, u=u, distributions=distributions, above=rejected_above,
                                    below=recognition_below, peers=peers) or nobody)
    u = fixed_result().u
    recipe = dataclasses.replace(fh.RECIPES["robust"], expel_rejected=0.7, expel_recognition=0.3)
    w = fh.weigh(u, distributions, recipe)
    assert w.check is nobody and w.left_out is None  # nobody expelled: nobody left out, U is MS's own
    assert torch.equal(w.u_r, normalise(u)[0]) and torch.equal(w.u_c, normalise(u)[1])
    assert seen["u"] is u and seen["distributions"] is distributions and (seen["above"], seen["below"]) == (0.7, 0.3)
    assert fh.weigh(u, distributions, fh.RECIPES["robust"]) is not None and (seen["above"], seen["below"]) == (0.6, 0.5)
    # the check it reruns is the agreement check on the kept clients alone (their scores, U_r, distributions)
    keep = torch.tensor([True, False, True])
    assert seen["check_of"](keep) == "checked"
    kept_u, kept_d = u[:, [0, 2]], distributions[[0, 2]][:, [0, 2]]
    u_seen, u_r_seen, (_, among), kwargs = calls[-1]
    assert torch.equal(u_seen, kept_u) and torch.equal(u_r_seen, normalise(kept_u)[0])
    assert torch.equal(among, kept_d) and kwargs == {"min_evidence": 0.25, "judges": 2, "peers": None}
    # with a peer graph, expel and the rerun check get it (the rerun: the kept clients' part of it)
    graph = torch.tensor([[False, True, False], [True, False, True], [False, True, False]])
    fh.weigh(u, distributions, fh.RECIPES["robust"], graph)
    assert seen["peers"] is graph and seen["check_of"](keep) == "checked"
    assert torch.equal(calls[-1][3]["peers"], torch.tensor([[False, False], [False, False]]))
    # an expelled client is left out, and U is MS's u without it
    out = SimpleNamespace(expelled=torch.tensor([False, True, False]))
    monkeypatch.setattr(fh, "expel", lambda *args, **kwargs: out)
    plain = fh.weigh(u, distributions, fh.RECIPES["robust"])
    assert plain.left_out.tolist() == [False, True, False]
    assert plain.check is out and torch.equal(plain.u_r, normalise(u * torch.tensor([1.0, 0.0, 1.0]))[0])
    kept_u_c = normalise(u * torch.tensor([1.0, 0.0, 1.0]))[1]
    assert torch.equal(plain.u_c[:, [0, 2]], kept_u_c[:, [0, 2]])
    assert torch.equal(plain.u_c[:, 1], torch.zeros(u.shape[0]))  # good at nothing, not uniformly good


def test_ms_and_the_peer_check_run_without_the_bn_statistics(tmp_path, monkeypatch):
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
    monkeypatch.setattr(fh, "peer_distributions", seen("peers", torch.zeros(2, 2, C, C)))
    monkeypatch.setattr(fh, "weigh", lambda u, d, recipe, peers: fh.Weighting(*normalise(u), check=None, left_out=None))
    monkeypatch.setattr(fh, "reference_calibration", seen("reference", Calibration(torch.zeros(2), torch.ones(2))))
    hydra, ctx = strategy(tmp_path)
    monkeypatch.setattr(hydra, "report", lambda *args: None)
    hydra.make_aggregator(ensemble, uploads(), ctx)
    assert hooks and states == {name: [False] * len(hooks) for name in ("ms", "peers", "reference")}
    assert all(h.enabled for h in hooks)  # back on for the distillation
    ensemble.close()


def test_generator_loss_and_student_beta_carry_the_knobs(tmp_path):
    hydra, _ = strategy(tmp_path, **{"lambda-bn": 0.5, "lambda-adv": 2.0, "beta": 0.3})
    assert hydra.generator_loss() == GeneratorLoss(ce=1.0, bn=0.5, adv=2.0, adv_mask="none")  # Eq. 16: unmasked
    assert hydra.student_beta() == 0.3
    assert strategy(tmp_path, mode="paper")[0].generator_loss().adv_mask == "none"  # in either mode


class _Client(nn.Module):
    """x (b, 1, 1, D) -> Linear -> BatchNorm1d (eval, known running statistics) -> Linear -> logits."""

    def __init__(self, seed, d=6, h=5):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.inner, self.bn, self.head = nn.Linear(d, h), nn.BatchNorm1d(h), nn.Linear(h, C)
        with torch.no_grad():
            for p in (*self.inner.parameters(), *self.head.parameters()):
                p.copy_(torch.randn(p.shape, generator=g))
            self.bn.running_mean.copy_(torch.randn(h, generator=g))
            self.bn.running_var.copy_(torch.rand(h, generator=g) + 0.5)

    def forward(self, x):
        return self.head(self.bn(self.inner(x.flatten(1))))


def test_the_generators_gradient_is_that_of_the_weighted_ce_bn_and_adversarial_terms_by_hand(tmp_path):
    """FedHydra Eq. 16 with its knobs: L = CE(SA teacher(x), y) + lambda_bn L_BN(x) - lambda_adv KL(teacher || student),
    the student's output a function of x (its parameters frozen, not its input). One generator step: its gradient
    is autograd's on the loss written out here, and Adam's first step moves each weight by lr x g / (|g| + eps)."""
    import copy

    from oneshot_fl.engine.synthesizer import GeneratorSynthesizer
    from oneshot_fl.engine.teachers import Teacher

    hydra, _ = strategy(tmp_path, **{"lambda-bn": 0.7, "lambda-adv": 1.3})
    loss = hydra.generator_loss()
    nz, d, batch, lr, seed = 4, 6, 6, 0.01, 5
    clients = [_Client(1), _Client(2)]
    u_r = torch.tensor([[0.7, 0.3], [0.2, 0.8], [0.5, 0.5]])
    u_c = torch.tensor([[0.6, 0.1], [0.3, 0.5], [0.1, 0.4]])
    teacher = Teacher(ClientEnsemble(clients, ["mlp"] * 2), StratifiedAggregation(u_r, u_c, "logits", "label"))
    student = nn.Sequential(nn.Flatten(), nn.Linear(d, C))
    with torch.no_grad():
        student[1].weight.copy_(torch.randn(C, d, generator=torch.Generator().manual_seed(9)))
    synth = GeneratorSynthesizer(teacher, student, GeneratorSpec(nz, 2, 4, 1), loss, C, batch, steps=1, lr=lr,
                                 seed=seed, device=torch.device("cpu"))
    synth.generator = nn.Sequential(nn.Linear(nz, d), nn.Unflatten(1, (1, 1, d)))  # a tiny linear generator
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in synth.generator.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    synth.optimizer = torch.optim.Adam(synth.generator.parameters(), lr=lr, betas=(0.5, 0.999))
    before = copy.deepcopy(synth.generator)
    out = synth.synthesize()

    # the same (z, y) the synthesizer drew: z first, then the labels, from its seeded stream
    z = torch.randn(batch, nz, generator=torch.Generator().manual_seed(seed))
    y = out.labels
    assert sorted(y.tolist()) == [0, 0, 1, 1, 2, 2]
    x = before(z)
    h = [client.inner(x.flatten(1)) for client in clients]  # each client's BN input
    logits = [client.head(client.bn(hk)) for client, hk in zip(clients, h)]
    # SA routed by label (Eq. 8-11 on logits): t[b, c] = sum_k U_r[y_b, k] U_c[c, k] z_k[b, c]
    t = sum(u_r[y, k][:, None] * u_c[:, k][None, :] * logits[k] for k in range(2))
    ce = F.cross_entropy(t, y)
    bn = sum(torch.linalg.vector_norm(hk.mean(0) - c.bn.running_mean) +
             torch.linalg.vector_norm(hk.var(0, unbiased=False) - c.bn.running_var) for c, hk in zip(clients, h)) / 2
    p_t = F.softmax(t, dim=1)
    kl = (p_t * (F.log_softmax(t, dim=1) - F.log_softmax(student(x), dim=1))).sum(dim=1).mean()
    terms = {"ce": ce, "bn": bn, "kl": kl}
    grads = {name: torch.autograd.grad(term, list(before.parameters()), retain_graph=True)
             for name, term in terms.items()}

    def objective(adv_sign=-1.0, student_grad=True):
        kl_grads = grads["kl"]
        if not student_grad:  # the student's output as a constant: only the teacher's side of the KL moves
            s = student(x).detach()
            kl_grads = torch.autograd.grad((p_t * (F.log_softmax(t, 1) - F.log_softmax(s, 1))).sum(1).mean(),
                                           list(before.parameters()), retain_graph=True)
        return [1.0 * g_ce + 0.7 * g_bn + adv_sign * 1.3 * g_kl
                for g_ce, g_bn, g_kl in zip(grads["ce"], grads["bn"], kl_grads)]

    expected = objective()
    got = [p.grad for p in synth.generator.parameters()]
    for g, e in zip(got, expected):
        assert torch.allclose(g, e, atol=1e-5, rtol=1e-4), (g, e)
    # the batch's reported terms are the same loss's
    value = {name: float(term.detach()) for name, term in terms.items()}
    assert out.losses["ce"] == pytest.approx(value["ce"], rel=1e-5)
    assert out.losses["bn"] == pytest.approx(value["bn"], rel=1e-5)
    assert out.losses["adv"] == pytest.approx(-value["kl"], rel=1e-5)
    assert out.losses["total"] == pytest.approx(value["ce"] + 0.7 * value["bn"] - 1.3 * value["kl"], rel=1e-5)
    # Adam's first step (bias-corrected: m / sqrt(v) = g / |g|): each weight moves by lr x g / (|g| + eps)
    for new, old, g in zip(synth.generator.parameters(), before.parameters(), expected):
        assert torch.allclose(new.detach(), old.detach() - lr * g / (g.abs() + 1e-8), atol=1e-6)
    # what the test tells apart: a student output detached, the adversarial term's sign flipped, a term dropped
    for wrong in (objective(student_grad=False), objective(adv_sign=1.0)):
        assert max(float((w - e).abs().max()) for w, e in zip(wrong, expected)) > 1e-2
    for name in ("ce", "bn", "kl"):
        assert max(float(g.abs().max()) for g in grads[name]) > 1e-2, name
    assert all(p.grad is None for p in student.parameters()) and student.training  # the student is untouched
    teacher.ensemble.close()


# --- stratification_report: the server actions it states ------------------------------------

def one_owner():
    u = torch.tensor([[0.9, 0.01], [0.01, 0.9]])
    u_r, u_c = normalise(u)
    return Stratification(u=u, u_r=u_r, u_c=u_c, losses=torch.zeros(2, 2, 1)), [np.array([30, 0]),
                                                                                np.array([0, 30])]


@pytest.mark.parametrize("route, space, says", [
    ("label", "logits", "SA routes by the synthetic label, so a sample's teacher is its class's owner alone"),
    ("class", "calibrated", "SA routes by output class on calibrated logits: each class is scored by its owner, on "
                            "the owner's own scale, and an owner answers an input of a class it never saw less "
                            "strongly than it answers its typical input"),
    ("class", "logits", "SA routes by output class, so every owner scores every sample"),
])
def test_one_owner_fleet_is_reported_with_what_the_route_does(route, space, says):
    result, counts = one_owner()
    report = fr.stratification_report(result, None, counts, route, space, used_u_r=result.u_r)
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
    check = PeerCheck(agreement=trust, evidence=torch.ones(3, 3), trust=trust, verifiable=verifiable)
    counts = [np.array([10, 0, 5]), np.array([5, 5, 0]), np.array([0, 10, 5])]
    used_u_r = normalise(u * torch.tensor([1.0, 0.5, 1.0]))[0]  # whatever U_r the teacher used, not MS's
    report = fr.stratification_report(result, check, counts, "class", "calibrated", used_u_r=used_u_r)
    # (0, 1): u_r 0.3, trust 0.4 -> shrunk; (0, 2): u_r 0.2, trust 0.2 -> shrunk; (1, 0): u_r 0.2, trust 0.3 -> shrunk;
    # (2, 1): u_r 0.05 < 0.1 -> not; (2, 2): trust 0.49, u_r 0.45 -> shrunk; (1, 2) not verifiable -> not
    assert report["peer_check"]["shrunk"] == [(0, 1), (0, 2), (1, 0), (2, 2)]
    # a diagnostic only: without expel's decision (none here) the server did nothing
    assert report["server_action"] == "peer check made, nobody left out"
    assert report["peer_check"]["trust"] == check.trust.tolist() and report["score"] == result.score
    assert report["tracking"]["after_expel"] == fr.tracking(used_u_r, counts)
    assert report["tracking"]["mean_spearman"] == report["tracking"]["after_expel"]["mean_spearman"]
    assert report["tracking"]["ms"] == fr.tracking(result.u_r, counts)


def test_expel_report_names_the_clients_left_out_or_says_none_was():
    u = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
    u_r, u_c = normalise(u)
    result = Stratification(u=u, u_r=u_r, u_c=u_c, losses=torch.zeros(3, 2, 1))
    ones = torch.ones(2, 3)
    counts = [np.array([5, 0]), np.array([0, 5]), np.array([5, 5])]
    check = PeerCheck(agreement=ones, evidence=ones, trust=torch.tensor([[1.0, 0.0, 1.0], [1.0, 0.0, 1.0]]),
                      verifiable=ones.bool(), rejected_share=torch.tensor([0.1, 0.8123, 0.0]),
                      claim_recognition=torch.tensor([0.4, 0.0212, 0.3]), expelled=torch.tensor([False, True, False]))
    report = fr.stratification_report(result, check, counts, "class", "calibrated", used_u_r=u_r)
    assert report["server_action"] == (
        "left out of the teacher 1 client(s) the peers mostly reject and that do not recognise their images of "
        "the classes they claim (upload index, rejected share, claim recognition; median 0.3): [(1, 0.812, 0.021)]")
    assert report["peer_check"]["expelled"] == [False, True, False]
    assert report["peer_check"]["rejected_share"] == pytest.approx([0.1, 0.8123, 0.0])
    nobody = dataclasses.replace(check, expelled=torch.zeros(3, dtype=torch.bool))
    assert fr.stratification_report(result, nobody, counts, "class", "calibrated", used_u_r=u_r)[
        "server_action"] == "no client both mostly rejected and blind to its peers' images of its classes"
    # the check does not reweight U: the report states expel's decision, and the disputed pairs as a diagnostic
    assert report["server_action"].startswith("left out of the teacher 1 client(s) ")
    assert report["peer_check"]["shrunk"] == [(0, 1), (1, 1)]


PAPER_LINE = ("fedhydra paper mode: the published method (Eq. 2 scores, no peer check, SA on the logits routed by "
              "the synthetic label); the student: one student step per epoch on that epoch's synthetic batch, at a "
              "constant learning rate (distill.pool='paper', distill.lr-schedule='constant')")


@pytest.mark.parametrize("mode, score, says, first", [
    ("robust", "prob-auc", "FedHydra (robust): SA on calibrated, routed by class; ", []),
    ("paper", "paper", "FedHydra (paper): SA on logits, routed by label; ", [PAPER_LINE]),
])
def test_what_the_server_log_says(tmp_path, monkeypatch, caplog, mode, score, says, first):
    record_ms(monkeypatch)
    hydra, ctx = strategy(tmp_path, mode=mode, **{"ms-steps": 5})
    ensemble = ClientEnsemble(fleet(), ["lin"] * 3)
    with caplog.at_level("INFO", logger="oneshot_fl.strategy"):
        aggregator, _ = hydra.make_aggregator(ensemble, uploads(), ctx)
    report = json.loads((tmp_path / "stratification.json").read_text())
    top = [round(float(v), 3) for v in aggregator.u_r.max(dim=1).values]
    assert [r.getMessage() for r in caplog.records if r.module == "fedhydra"] == [
        *first,
        f"stratification: 3 clients x 3 classes, T_G=5, {score} score",
        f"stratification done in 1.5s (prob-auc score); U_r top weight per class: {top}; rank correlation of U_r "
        f"with the uploaded label shares (report only): mean {report['tracking']['mean_spearman']:.2f}",
        says + report["server_action"],
    ]


def test_paper_mode_trains_the_student_as_published_unless_the_run_config_sets_the_schedule(tmp_path):
    """FedHydra Alg. 1: one student step per epoch, on that epoch's synthetic batch, at a constant rate; the robust
    mode and the other methods keep the capped pool and the cosine decay; a value the run config sets wins."""
    def hydra(mode, method="fedhydra", **distill):
        cfg = from_run_config(merge_overrides({"method": method, "preset": "smoke", "fedhydra.mode": mode,
                                               **{f"distill.{k}": v for k, v in distill.items()}}))
        made = fh.FedHydra.__new__(fh.FedHydra)
        made.cfg, made.params = cfg, fh.FedHydra.parse_params(cfg.flat)
        made.ctx = SimpleNamespace(fast=SimpleNamespace(on=False))  # a CPU run: no fast path
        return made

    paper, robust = hydra("paper"), hydra("robust")
    assert distill_schedule(paper.cfg) == ("paper", "constant") and paper.distill_settings().lr_schedule == "constant"
    assert distill_schedule(robust.cfg) == ("capped", "cosine") and robust.distill_settings().lr_schedule == "cosine"
    assert distill_schedule(hydra("paper", method="dense").cfg) == ("capped", "cosine")  # only FedHydra's mode
    assert resolved_config(paper.cfg)[0]["distill.pool"] == "paper"  # result.json records what the run used
    own = hydra("paper", pool="capped")
    assert distill_schedule(own.cfg) == ("capped", "constant")
    assert own.paper_mode_line().endswith("the student: distill.pool='capped' as the run config sets it (the "
                                          "paper's: 'paper')")
    assert distill_schedule(hydra("robust", pool="paper", **{"lr-schedule": "constant"}).cfg) == ("paper", "constant")


def test_the_u_heatmaps_show_the_used_u_with_their_meaning(tmp_path, monkeypatch):
    record_ms(monkeypatch)
    drawn = []
    monkeypatch.setattr(fh.plots, "heatmap", lambda values, path, title, xlabel, ylabel, xticklabels: drawn.append(
        (values, path, title, xlabel, ylabel, xticklabels)))
    hydra, ctx = strategy(tmp_path)
    aggregator, _ = hydra.make_aggregator(ClientEnsemble(fleet(), ["lin"] * 3), uploads(), ctx)
    assert [d[1:] for d in drawn] == [
        (tmp_path / "stratification_u_r.png", "U_r: whom to trust for each class (rows sum to 1)", "client", "class",
         ["p0 lin", "p1 lin", "p2 lin"]),
        (tmp_path / "stratification_u_c.png", "U_c: what each client is good at (columns sum to 1)", "client", "class",
         ["p0 lin", "p1 lin", "p2 lin"])]
    assert np.array_equal(drawn[0][0], aggregator.u_r.numpy()) and np.array_equal(drawn[1][0], aggregator.u_c.numpy())


def test_the_unjudgeable_class_is_read_at_the_checked_top_client_and_every_action_is_listed():
    """(c=2, m=3). Class 0: MS's top client 0 (verifiable) loses to client 1 (not verifiable) after the check.
    One owner per class in the counts: the report's second action, after a '; '."""
    u = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    u_r, u_c = normalise(u)
    result = Stratification(u=u, u_r=u_r, u_c=u_c, losses=torch.zeros(3, 2, 1))
    trust = torch.tensor([[0.2, 1.0, 1.0], [1.0, 1.0, 1.0]])
    verifiable = torch.tensor([[True, False, True], [True, True, True]])
    check = PeerCheck(agreement=trust, evidence=torch.ones(2, 3), trust=trust, verifiable=verifiable)
    report = fr.stratification_report(result, check, [np.array([10, 0]), np.array([0, 10]), np.array([0, 0])],
                                      "class", "calibrated", used_u_r=u_r)
    assert report["server_action"] == (
        "one owner per class in the uploaded counts (report only): SA routes by "
        "output class on calibrated logits: each class is scored by its owner, on the owner's own scale, and an "
        "owner answers an input of a class it never saw less strongly than it answers its typical input")
    assert report["peer_check"]["shrunk"] == [(0, 0)]  # the disputed pair, a diagnostic


def test_halved_pairs_boundaries_on_a_non_square_fleet():
    # (c=2, m=3): trust exactly 0.5 is not halved; an MS weight of exactly 0.1 counts as carried
    trust = torch.tensor([[0.5, 0.49, 0.2], [0.1, 0.3, 1.0]])
    ms_u_r = torch.tensor([[0.1, 0.1, 0.8], [0.09, 0.1, 0.81]], dtype=torch.float64)  # 0.1 exactly the bound
    assert fr.halved_pairs(trust, ms_u_r) == [(0, 1), (0, 2), (1, 1)]


def test_a_peer_check_without_an_expel_decision_says_only_that_it_was_made():
    u = torch.tensor([[0.9, 0.1], [0.1, 0.9]])
    u_r, u_c = normalise(u)
    result = Stratification(u=u, u_r=u_r, u_c=u_c, losses=torch.zeros(2, 2, 1))
    ones = torch.ones(2, 2)
    check = PeerCheck(agreement=ones, evidence=ones, trust=ones, verifiable=ones.bool())
    report = fr.stratification_report(result, check, [np.array([5, 5]), np.array([5, 5])], "class", "calibrated",
                                      used_u_r=u_r)
    assert report["server_action"] == "peer check made, nobody left out"
    assert report["peer_check"]["shrunk"] == []


def test_owner_count_boundary_and_empty_class():
    # class 0: 5 of 100 (exactly the 5 % share: an owner) and 95; class 1: 4 of 100 (not) and 96; class 2: none held
    counts = [np.array([5, 4, 0]), np.array([95, 96, 0])]
    assert fr.owners_per_class(counts) == [2, 1, 0]
    assert fr.owners_per_class(counts, share=0.06) == [1, 1, 0]
    assert fr.owners_per_class([np.array([1, 0]), np.array([0, 0])]) == [1, 0]  # one example is a class held


def test_tracking_leaves_classes_without_a_ranking_undefined():
    counts = [np.array([10, 5, 0]), np.array([0, 5, 0]), np.array([5, 5, 0])]
    u_r = torch.tensor([[0.6, 0.1, 0.3], [0.2, 0.5, 0.3], [1 / 3, 1 / 3, 1 / 3]])
    out = fr.tracking(u_r, counts)
    # class 0 shares (2/3, 0, 1/3) rank like U_r's row: 1.0; class 1 shares are equal (no ranking);
    # class 2 nobody holds (shares 0) and its U_r row is constant
    assert out["spearman_per_class"] == [pytest.approx(1.0), None, None]
    assert out["mean_spearman"] == pytest.approx(1.0)
    flat = fr.tracking(torch.full((3, 3), 1 / 3), counts)
    assert flat["spearman_per_class"] == [None, None, None] and np.isnan(flat["mean_spearman"])
    reversed_row = fr.tracking(torch.tensor([[0.1, 0.6, 0.3]] * 3), counts)
    assert reversed_row["spearman_per_class"] == [pytest.approx(-1.0), None, None]
    assert reversed_row["mean_spearman"] == pytest.approx(-1.0)


def test_tracking_on_more_classes_than_clients_by_hand():
    counts = [np.array([10, 5, 0, 1]), np.array([0, 5, 3, 2]), np.array([5, 5, 9, 3])]  # (m=3, c=4)
    u_r = torch.tensor([[0.6, 0.1, 0.3], [0.2, 0.3, 0.5], [0.2, 0.3, 0.5], [0.5, 0.3, 0.2]])
    out = fr.tracking(u_r, counts)
    # class 0 ranks (2, 0, 1) both ways: 1; class 1 equal counts: none; class 2 ranks agree: 1; class 3 reversed: -1
    assert out["spearman_per_class"] == [pytest.approx(1.0), None, pytest.approx(1.0), pytest.approx(-1.0)]
    assert out["mean_spearman"] == pytest.approx(1 / 3)


def test_a_running_calibration_recipe_starts_from_the_ms_images_and_its_statistics_travel_with_the_synthesizer(
        tmp_path, monkeypatch):
    record_ms(monkeypatch)
    hydra, ctx = strategy(tmp_path)
    monkeypatch.setattr(type(hydra), "recipe", property(
        lambda self: dataclasses.replace(fh.RECIPES["robust"], calibration="running")))
    ensemble = ClientEnsemble(fleet(), ["lin"] * 3)
    aggregator, _ = hydra.make_aggregator(ensemble, uploads(), ctx)
    assert aggregator.adapts
    # MS's images are e_0, e_1, e_2 twice each for every client: clients 0, 1 answer with top logit 2 on each of
    # the 18 images (mean 2, spread 0), client 2 with 6
    start = aggregator.calibration.stats
    assert start.mean.tolist() == [2.0, 2.0, 6.0] and start.spread.tolist() == [0.0, 0.0, 0.0]
    batch = torch.randn(3, 4, C, generator=torch.Generator().manual_seed(0))
    with aggregator.frozen():  # evaluation: answers with the start, moves nothing ...
        frozen_answer = aggregator(batch)
        one_by_one = torch.cat([aggregator(batch[:, i:i + 1]) for i in range(batch.shape[1])])
    assert torch.allclose(one_by_one, frozen_answer, atol=1e-6)  # ... and an image's answer is its own at batch 1
    assert torch.equal(aggregator.calibration.stats.mean, start.mean)
    assert torch.equal(frozen_answer, aggregator(batch))  # the first batch is answered with the start too ...
    moved = aggregator.calibration.stats
    assert not torch.equal(moved.mean, start.mean)  # ... and folded in afterwards
    # the synthesizer's checkpoint carries the teacher's running statistics, and a restored one answers alike
    teacher = Teacher(ensemble, aggregator)
    state = teacher.state_dict()
    assert torch.equal(state["calibration"]["mean"], moved.mean)
    fresh, _ = hydra.make_aggregator(ClientEnsemble(fleet(), ["lin"] * 3), uploads(), ctx)
    Teacher(ensemble, fresh).load_state_dict(state)
    with aggregator.frozen(), fresh.frozen():
        assert torch.equal(fresh(batch), aggregator(batch))


def test_the_default_recipes_calibrate_as_their_mode_says(tmp_path, monkeypatch):
    record_ms(monkeypatch)
    for mode in ("robust", "paper"):
        hydra, ctx = strategy(tmp_path, mode=mode)
        aggregator, _ = hydra.make_aggregator(ClientEnsemble(fleet(), ["lin"] * 3), uploads(), ctx)
        assert aggregator.adapts == (fh.RECIPES[mode].sa_space == "calibrated"
                                     and fh.RECIPES[mode].calibration == "running")
        assert Teacher(None, aggregator).state_dict() == ({"calibration": aggregator.calibration.state_dict()}
                                                          if aggregator.adapts else {})
