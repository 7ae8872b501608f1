"""Issue 37: differentially private clients. The accountant end to end (the noise multipliers a client uses give
at most its epsilon under Opacus's RDP accountant, and published values come out to 2 decimals), what a DP
upload carries (no BN statistics, a noised integer histogram, its guarantee) and what the server refuses, the
DP variants of the BatchNorm architectures, and a smoke-size DP client that learns."""

from __future__ import annotations

import json
import math
from functools import lru_cache

import numpy as np
import pytest
import torch
from torch import nn
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import rdp as opacus_rdp
from opacus.data_loader import DPDataLoader
from torch.utils.data import DataLoader, TensorDataset

from oneshot_fl.config import ConfigError, DPConfig, LocalConfig, from_run_config, merge_overrides
from oneshot_fl.data.partition import label_counts
from oneshot_fl.local import dp
from oneshot_fl.models.registry import DP_VARIANTS, build, dp_problems, has_batchnorm
from oneshot_fl.uploads import Expectation, InvalidUpload, decode_and_check, encode
from tests.conftest import reply_message

SHAPE = (1, 28, 28)
DELTA = 1e-5


@pytest.fixture
def one_thread():
    """DP-SGD on small batches runs one torch thread (two, on a busy 2-core machine, measured 6x slower)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def dp_cfg(**over):
    return from_run_config(merge_overrides({"preset": "smoke", "model": "cnn2-gn", "local.dp.epsilon": 8.0, **over}))


@lru_cache(maxsize=4)
def guarantee(epsilon: float = 8.0) -> dp.DPGuarantee:
    """A client's real plan: 100 examples, batch 10, one epoch."""
    return dp.plan(100, 10, 1, DPConfig(epsilon=epsilon))


# --- the accountant -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n, batch, epochs, epsilon", [(12_000, 128, 10, 8.0), (512, 32, 1, 3.0), (930, 10, 2, 1.0)])
def test_the_noise_multipliers_give_at_most_the_target_epsilon_under_opacus(n, batch, epochs, epsilon):
    planned = dp.plan(n, batch, epochs, DPConfig(epsilon=epsilon, delta=DELTA))
    # the schedule is the one Opacus's Poisson loader runs for this sample count and batch size (930 / 10: 93
    # batches, but int(1 / (1 / 93)) = 92 steps per epoch in floating point), at the rate PrivacyEngine accounts
    # them: 1 / len(loader) (1/92, above the loader's own 1/93)
    loader = DPDataLoader.from_data_loader(DataLoader(TensorDataset(torch.zeros(n, 1)), batch_size=batch))
    assert planned.sample_rate == 1 / len(loader) >= loader.sample_rate and planned.steps == epochs * len(loader)
    # Opacus's own accountant, stepped as the optimizer steps it, then the histogram release as one more step
    accountant = RDPAccountant()
    for _ in range(planned.steps):
        accountant.step(noise_multiplier=planned.sgd_noise_multiplier, sample_rate=planned.sample_rate)
    accountant.step(noise_multiplier=planned.histogram_noise_multiplier, sample_rate=1.0)
    composed = accountant.get_epsilon(delta=DELTA, alphas=list(dp.ALPHAS))
    assert composed == pytest.approx(planned.epsilon, rel=1e-9)  # the claim is the composition, histogram included
    assert 0.95 * epsilon <= composed <= epsilon
    # Opacus's default orders (up to 63) cannot give a smaller epsilon than the pinned superset
    assert accountant.get_epsilon(delta=DELTA) >= composed - 1e-9


def test_the_histogram_takes_its_share_alone_and_costs_training_under_one_percent():
    planned = guarantee(8.0)
    alone = dp.epsilon_of([(planned.histogram_noise_multiplier, 1.0, 1)], DELTA)
    assert alone <= dp.HISTOGRAM_SHARE * 8.0 and alone >= 0.95 * dp.HISTOGRAM_SHARE * 8.0
    sgd_alone = dp.epsilon_of([planned.history()[0]], DELTA)
    assert sgd_alone < planned.epsilon  # composing the histogram costs something ...
    # ... but little: the noise multiplier the whole budget would buy training alone is within 1 %
    sigma_alone = dp._smallest_sigma(lambda s: dp.epsilon_of([(s, planned.sample_rate, planned.steps)], DELTA),
                                     8.0, "sgd")
    assert planned.sgd_noise_multiplier <= 1.01 * sigma_alone


def test_a_published_rdp_accountant_value_matches_to_two_decimals():
    # Opacus's repository, opacus/tests/accountants_test.py, AccountingTest.test_rdp_accountant: noise multiplier
    # 1.5, sample rate 0.04, int(90 / 0.04) = 2250 steps, delta 1e-5 -> epsilon 7.32911117143 (RDPAccountant)
    assert round(dp.epsilon_of([(1.5, 0.04, 2250)], 1e-5), 2) == 7.33


@pytest.mark.parametrize("sigma, epochs, published", [(0.7, 45, 6.86), (1.1, 60, 2.91), (1.3, 15, 1.16)])
def test_the_opacus_mnist_example_epsilons_match_to_two_decimals(sigma, epochs, published):
    # Opacus's MNIST example (pytorch/opacus, examples/mnist_README.md, "Sample parameter sets"): 60,000 images,
    # sample rate 0.004 (batch 240), delta 1e-5: (6.86, 1e-5)-DP, (2.91, 1e-5)-DP, (1.16, 1e-5)-DP. Those were
    # printed with the classic RDP -> (epsilon, delta) conversion, min over alpha of RDP(alpha) +
    # log(1 / delta) / (alpha - 1) (Mironov, "Renyi Differential Privacy", Prop. 3); the accountant's
    # conversion today is tighter.
    sample_rate, steps = dp.poisson_schedule(60_000, 240, epochs)
    assert sample_rate == 0.004 and steps == epochs * 250
    orders = np.array(dp.ALPHAS)
    curve = opacus_rdp.compute_rdp(q=sample_rate, noise_multiplier=sigma, steps=steps, orders=orders)
    classic = float(np.min(curve - math.log(DELTA) / (orders - 1)))
    assert round(classic, 2) == published
    assert dp.epsilon_of([(sigma, sample_rate, steps)], DELTA) < classic  # what a client claims: never looser


# --- the histogram ------------------------------------------------------------------------------------

def test_the_released_histogram_is_noised_integer_and_non_negative():
    exact = np.array([40, 20, 2, 93, 31, 91, 23, 0, 0, 0])
    released = dp.release_histogram(exact, 5.0, torch.Generator().manual_seed(0))
    assert released.dtype == np.int64 and (released >= 0).all()
    assert not np.array_equal(released, exact)
    assert np.abs(released - exact).max() <= 30  # noise std 5
    # clipped at 0, and a release that rounds to nothing is post-processed into ones, not an empty client
    zero = dp.release_histogram(np.zeros(10, dtype=np.int64), 1e-9, torch.Generator().manual_seed(0))
    assert zero.tolist() == [1] * 10


# --- the upload ---------------------------------------------------------------------------------------

def _dp_content(arch="cnn2-gn", claim=None, counts=(10,) * 10, partition=0, metrics=None):
    state = build(arch, SHAPE, 10, seed=0).state_dict()
    meta = (claim or guarantee()).to_meta()
    return encode("classifier", arch, state, np.array(counts), partition,
                  metrics or {"local-test-accuracy": 0.5, "train-seconds": 1.0}, extra=meta)


def _check(content, run_epsilon=8.0, archs=("cnn2-gn",)):
    expect = Expectation(num_partitions=5, max_examples=60_000, archs=lambda role, pid: set(archs),
                         dp=(run_epsilon, DELTA) if run_epsilon else None)
    return decode_and_check(content, node_id=3, num_classes=10, input_shape=SHAPE, expect=expect)


def test_a_dp_client_upload_has_no_bn_statistics_and_no_exact_counts(mnist_dir, one_thread):
    from client_app.task import load_shard, run_client

    cfg = dp_cfg(**{"local.max-samples": 200, "num-clients": 3})
    content = run_client(cfg, {"partition-id": 1}, {})
    upload = _check(content)
    assert upload.arch == "cnn2-gn" and not any(k.endswith(dp.BN_STATISTICS) for k in upload.state)
    exact = label_counts(load_shard(cfg, 1).labels, 10)
    assert upload.label_counts.dtype == np.int64 and (upload.label_counts >= 0).all()
    assert not np.array_equal(upload.label_counts, exact)  # (fresh OS noise: equal with probability ~0)
    assert upload.num_examples == int(upload.label_counts.sum())
    assert set(upload.metrics) <= dp.PUBLIC_METRICS  # no training loss / accuracy of the client's data
    assert upload.dp is not None and upload.dp.epsilon <= 8.0 and upload.dp.delta == DELTA
    assert (upload.dp.sample_rate, upload.dp.steps) == dp.poisson_schedule(200, 32, 1) == (1 / 7, 7)


def test_the_gn_variants_have_no_buffers_and_pass_opacus_validation():
    for arch, variant in DP_VARIANTS.items():
        bn, gn = build(arch, SHAPE, 10), build(variant, SHAPE, 10)
        assert has_batchnorm(bn) and dp_problems(bn)
        assert not has_batchnorm(gn) and dp_problems(gn) == [] and list(gn.buffers()) == []
        assert sum(p.numel() for p in gn.parameters()) == sum(p.numel() for p in bn.parameters())


def test_a_valid_dp_upload_is_accepted_with_its_guarantee():
    upload = _check(_dp_content())
    assert upload.dp == guarantee()


def test_the_server_rejects_a_claim_above_the_runs_epsilon():
    with pytest.raises(InvalidUpload, match=r"DP claim epsilon 7\.\d+ exceeds this run's local.dp.epsilon=3"):
        _check(_dp_content(), run_epsilon=3.0)


def test_the_server_rejects_a_missing_claim_in_a_dp_run():
    content = encode("classifier", "cnn2-gn", build("cnn2-gn", SHAPE, 10).state_dict(), np.array([10] * 10), 0,
                     {"local-test-accuracy": 0.5})
    with pytest.raises(InvalidUpload, match="no differential-privacy claim, and this run requires one"):
        _check(content)
    assert _check(content, run_epsilon=0.0).dp is None  # a run without DP takes it


def test_the_server_recomputes_the_claimed_epsilon():
    honest = guarantee()
    lie = dp.DPGuarantee(**{**honest.__dict__, "epsilon": honest.epsilon / 2})  # parameters unchanged
    with pytest.raises(InvalidUpload, match=r"the claimed mechanisms give epsilon 7\.\d+ .* not the claimed 3\.\d+"):
        _check(_dp_content(claim=lie))
    weaker = dp.DPGuarantee(**{**honest.__dict__, "sgd_noise_multiplier": honest.sgd_noise_multiplier / 2})
    with pytest.raises(InvalidUpload, match="give epsilon"):
        _check(_dp_content(claim=weaker))


@pytest.mark.parametrize("tamper, reason", [
    (lambda m: m.pop("dp-histogram-noise-multiplier"), "incomplete DP claim: missing"),
    (lambda m: m.update({"dp-mechanisms": ["dp-sgd"]}), "a DP upload releases"),
    (lambda m: m.update({"dp-sgd-steps": 1.5}), "dp-sgd-steps 1.5 is not an integer"),
    (lambda m: m.update({"dp-sgd-sample-rate": 2.0}), "outside"),
    (lambda m: m.update({"dp-accountant": "prv"}), "this server verifies 'rdp'"),
    (lambda m: m.update({"dp-extra": 1}), "unknown DP claim field"),
])
def test_a_malformed_claim_is_that_nodes_rejection(tamper, reason):
    content = _dp_content()
    tamper(content.config_records["meta"])
    with pytest.raises(InvalidUpload, match=reason):
        _check(content)


def test_the_server_rejects_a_claim_above_the_runs_delta():
    at_larger_delta = dp.DPGuarantee(**{**guarantee().__dict__, "delta": 1e-3})
    claim = dp.DPGuarantee(**{**at_larger_delta.__dict__, "epsilon": at_larger_delta.recompute()})  # consistent
    with pytest.raises(InvalidUpload, match="DP claim delta 0.001 exceeds this run's local.dp.delta=1e-05"):
        _check(_dp_content(claim=claim))


def test_a_dp_claim_never_covers_bn_statistics_or_training_metrics():
    with pytest.raises(InvalidUpload, match="DP upload carries BN running statistics"):
        _check(_dp_content(arch="cnn2"), archs=("cnn2",))
    with pytest.raises(InvalidUpload, match=r"metric\(s\) \['train-loss'\] computed on the client's data"):
        _check(_dp_content(metrics={"local-test-accuracy": 0.5, "train-loss": 0.3}))


def test_the_round_rejects_with_the_reason_and_reports_the_guarantees(tmp_path, mnist_dir):
    from oneshot_fl.archive import load_uploads
    from strategies import build_strategy

    strategy = build_strategy(dp_cfg(method="fedavg", **{"local.dp.epsilon": 3.0, "num-clients": 4,
                                                         "min-clients": 2}), run_dir=tmp_path / "run")
    strategy._sent = [1, 2, 3, 4]
    no_claim = encode("classifier", "cnn2-gn", build("cnn2-gn", SHAPE, 10).state_dict(), np.array([10] * 10), 3,
                      {"local-test-accuracy": 0.5})
    replies = [reply_message(_dp_content(claim=guarantee(3.0), partition=0), 1),
               reply_message(_dp_content(claim=guarantee(1.0), partition=1), 2),
               reply_message(_dp_content(claim=guarantee(8.0), partition=2), 3),
               reply_message(no_claim, 4)]
    strategy.aggregate_train(1, replies)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    reasons = {r["node_id"]: r["reason"] for r in result["rejected"]}
    assert set(reasons) == {3, 4}
    assert "exceeds this run's local.dp.epsilon=3" in reasons[3]
    assert "no differential-privacy claim" in reasons[4]
    claims = {c["partition_id"]: c["dp"] for c in result["clients"]}
    assert claims[0]["epsilon"] == pytest.approx(guarantee(3.0).epsilon)
    assert claims[1]["epsilon"] == pytest.approx(guarantee(1.0).epsilon)
    assert [m["name"] for m in claims[0]["mechanisms"]] == list(dp.MECHANISMS)
    assert claims[0]["mechanisms"][0]["noise_multiplier"] == guarantee(3.0).sgd_noise_multiplier
    privacy = result["privacy"]
    assert privacy["dp"] and privacy["target_epsilon"] == 3.0 and privacy["clients_without_guarantee"] == []
    assert privacy["worst_epsilon"] == pytest.approx(guarantee(3.0).epsilon)  # the largest, not the mean
    # the archive keeps the claims: a replay re-verifies them like live replies
    archived = load_uploads(tmp_path / "run" / "uploads", 10, SHAPE, ("classifier",), expect=strategy.expectation())
    assert [up.dp for up in archived] == [guarantee(3.0), guarantee(1.0)]


# --- the run config -----------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", sorted(DP_VARIANTS))
def test_a_bn_architecture_in_a_dp_run_fails_naming_its_variant(arch):
    with pytest.raises(ConfigError, match=f"model '{arch}' cannot train with differential privacy.*"
                                          f"use its DP variant '{DP_VARIANTS[arch]}'"):
        dp_cfg(model=arch)
    assert dp_cfg(model=DP_VARIANTS[arch]).model == DP_VARIANTS[arch]  # the variant itself runs
    assert dp_cfg(model=arch, **{"local.dp.epsilon": 0.0}).model == arch  # without DP nothing changes


def test_bn_architectures_are_refused_wherever_a_dp_run_takes_them():
    with pytest.raises(ConfigError, match="model 'cnn2' \\(the default for mnist\\).*'cnn2-gn'"):
        from_run_config(merge_overrides({"local.dp.epsilon": 8.0}))
    with pytest.raises(ConfigError, match="client-models entry 'resnet8'.*'resnet8-gn'"):
        dp_cfg(**{"client-models": "cnn2-gn,resnet8", "server-model": "cnn2"})
    with pytest.raises(ConfigError, match="node-archs entry 'cnn3-bn'.*'cnn3-gn'"):
        dp_cfg(**{"node-archs": "cnn3-bn"})
    with pytest.raises(ConfigError, match="no DP variant of 'resnet18' is registered"):
        dp_cfg(model="resnet18")
    with pytest.raises(ValueError, match="cannot train with DP-SGD"):  # the client checks again
        dp.train_private(build("cnn2", SHAPE, 10), None, LocalConfig(), DPConfig(epsilon=1.0), None, "cpu")


@pytest.mark.parametrize("over, message", [
    ({"local.dp.epsilon": -1.0}, "local.dp.epsilon=-1.0: the privacy budget must be >= 0"),
    ({"local.dp.delta": 0.0}, r"local.dp.delta=0.0: must lie in \(0, 1\)"),
    ({"local.dp.delta": 1.0}, r"local.dp.delta=1.0: must lie in \(0, 1\)"),
    ({"local.dp.max-grad-norm": 0.0}, "local.dp.max-grad-norm=0.0: the per-example gradient clipping norm must be > 0"),
    ({"rounds": 2}, "DP runs are one-shot"),
    ({"local.loss": "fedlmd-tf"}, "use local.loss='ce'"),
])
def test_dp_settings_are_validated_before_any_work(over, message):
    with pytest.raises(ConfigError, match=message):
        dp_cfg(**over)


@pytest.mark.parametrize("method", ["fedmho-md", "fedcvae", "fedhydra"])
def test_a_dp_run_of_a_decoder_method_is_accepted(method):
    from strategies import check_method_params

    check_method_params(dp_cfg(method=method))


def test_dp_is_off_by_default():
    cfg = from_run_config(merge_overrides({}))
    assert not cfg.dp.enabled and cfg.dp.delta == 1e-5 and cfg.dp.max_grad_norm == 1.0


# --- a smoke-size DP client ---------------------------------------------------------------------------

@pytest.mark.parametrize("num_examples, batch_size, schedule", [
    (60_000, 240, (1 / 250, 250)),  # 250 batches: q0 = 0.004, int(1 / 0.004) = 250
    (13_422, 128, (1 / 104, 104)),  # 105 batches, but int(1 / (1 / 105)) = 104 in floating point
    (93, 1, (1 / 92, 92)), (99, 1, (1 / 98, 98)), (94, 1, (1 / 94, 94)),
    (5, 64, (1.0, 1)),  # fewer examples than a batch: one batch of all of them
])
def test_the_poisson_schedule_is_the_steps_opacus_runs_at_the_rate_its_accountant_counts(
        num_examples, batch_size, schedule):
    from opacus.data_loader import DPDataLoader
    from torch.utils.data import DataLoader, TensorDataset

    assert dp.poisson_schedule(num_examples, batch_size, 1) == schedule
    assert dp.poisson_schedule(num_examples, batch_size, 3) == (schedule[0], 3 * schedule[1])
    loader = DataLoader(TensorDataset(torch.zeros(num_examples)), batch_size=min(batch_size, num_examples))
    poisson = DPDataLoader.from_data_loader(loader)
    assert len(poisson) == schedule[1] and 1 / len(poisson) == schedule[0]  # what PrivacyEngine accounts


def test_a_dp_client_whose_size_hits_opacus_rounding_trains_and_its_claim_is_the_accountants(one_thread):
    # 93 examples at batch 1: Opacus's loader runs 92 batches and its accountant counts q = 1/92; dp_sgd stops a
    # client whose plan says otherwise ("Opacus's accountant counted ..., the plan was ...")
    from oneshot_fl.data.datasets import Split

    g = torch.Generator().manual_seed(0)
    shard = Split(torch.randint(256, (93, 28, 28, 1), generator=g, dtype=torch.uint8).numpy(),
                  torch.randint(10, (93,), generator=g).numpy())
    local, privacy = LocalConfig(epochs=1, batch_size=1, lr=0.01), DPConfig(epsilon=8.0)
    result = dp.train_private(build("cnn2-gn", SHAPE, 10, seed=0), shard, local, privacy,
                              label_counts(shard.labels, 10), torch.device("cpu"),
                              sampler_generator=torch.Generator().manual_seed(0),
                              noise_generator=torch.Generator().manual_seed(1))
    assert (result.guarantee.sample_rate, result.guarantee.steps) == (1 / 92, 92)
    assert result.guarantee.epsilon <= 8.0 and result.guarantee.recompute() == pytest.approx(result.guarantee.epsilon)


@pytest.mark.parametrize("layer", ["linear", "conv"])
def test_a_dp_step_is_the_hand_computed_clipped_mean_gradient(layer):
    # loss = w . x per example, so each example's gradient is its x: (3, 4) has norm 5 and is clipped to C = 1,
    # (0.3, 0.4) has norm 0.5 and stays; both are in every Poisson batch (rate 1), noise 0, and the mean divides the
    # clipped sum by the expected batch 2: w = 0 - lr * ((0.6, 0.8) + (0.3, 0.4)) / 2. Linear layers get their norms
    # from ghost clipping, others from per-example gradients: both must clip the same.
    model = nn.Linear(2, 1, bias=False) if layer == "linear" else nn.Conv2d(1, 1, (1, 2), bias=False)
    nn.init.zeros_(model.weight)
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
    x = x if layer == "linear" else x.view(2, 1, 1, 2)
    loader = DataLoader(TensorDataset(x), batch_size=2)
    _, private, optimizer, criterion, poisson = dp.make_private(
        model, torch.optim.SGD(model.parameters(), lr=1.0), loader, noise_multiplier=0.0, max_grad_norm=1.0,
        noise_generator=torch.Generator().manual_seed(0))
    (batch,) = next(iter(poisson))
    assert len(batch) == 2
    optimizer.zero_grad()
    criterion(private(batch).flatten()).backward()
    optimizer.step()
    assert model.weight.flatten().tolist() == pytest.approx([-0.45, -0.6], abs=1e-6)
    private._close()


def test_a_smoke_size_dp_client_learns_and_reports_its_epsilon(mnist_dir, one_thread):
    from oneshot_fl.data.datasets import load_split, to_tensor

    shard = load_split("mnist", "train", str(mnist_dir)).subset(np.arange(300))
    model = build("cnn2-gn", SHAPE, 10, seed=0)
    # the passes are local.dp.epochs (5), not local.epochs (1): 5 x 10 Poisson batches of expected size 32
    local, privacy = LocalConfig(epochs=1, batch_size=32, lr=0.01), DPConfig(epsilon=8.0, epochs=5)
    result = dp.train_private(model, shard, local, privacy, label_counts(shard.labels, 10), torch.device("cpu"),
                              sampler_generator=torch.Generator().manual_seed(0),
                              noise_generator=torch.Generator().manual_seed(1))
    assert 0.95 * 8.0 <= result.guarantee.epsilon <= 8.0
    assert result.guarantee.steps == 5 * 10 and result.guarantee.sample_rate == 0.1
    assert result.guarantee.recompute() == pytest.approx(result.guarantee.epsilon)
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())  # Opacus's hooks are gone
    assert all(not m._forward_hooks and not m._backward_hooks for m in model.modules())
    model.eval()
    with torch.no_grad():
        accuracy = float((model(to_tensor(shard.images)).argmax(1).numpy() == shard.labels).mean())
    assert accuracy > 0.3  # chance is 0.1 (0.66 measured)


def test_a_dp_decoder_client_uploads_only_its_decoder_with_noised_counts_and_its_claim(mnist_dir, one_thread):
    from client_app.task import ClientJob, load_shard, train_decoder

    cfg = dp_cfg(method="fedmho-md", **{"data-dir": str(mnist_dir), "num-clients": 10})
    pid = 7  # a constrained client of the mixed fleet
    shard = load_shard(cfg, pid)
    exact = label_counts(shard.labels, 10)
    content = train_decoder(ClientJob(cfg, pid, "", {"role": "decoder"}))
    upload = decode_and_check(content, 3, 10, SHAPE, ("decoder",), Expectation(dp=(8.0, DELTA)))
    # the smoke preset: 512 examples at most, 1 epoch; a DP decoder client's batch 4096 takes the whole shard per
    # step -> q = 1, one step
    assert len(shard) == 512 and upload.dp.sample_rate == 1.0 and upload.dp.steps == 1
    assert 0.99 * 8.0 <= upload.dp.epsilon <= 8.0
    assert upload.dp.recompute() == pytest.approx(upload.dp.epsilon)
    assert all(not k.startswith("encoder") for k in upload.state)  # the encoder stays on the client
    assert set(upload.metrics) <= {"train-seconds", "num-examples"}  # no ELBO terms of the client's data
    # sigma_h = 5 at epsilon 8: ten noised counts all equal to the exact ones has probability ~0.08^10
    assert upload.label_counts.tolist() != exact.tolist() and (upload.label_counts >= 0).all()
    # the same upload in a run of a smaller budget is refused with the reason
    with pytest.raises(InvalidUpload, match="exceeds this run's local.dp.epsilon=3"):
        decode_and_check(content, 3, 10, SHAPE, ("decoder",), Expectation(dp=(3.0, DELTA)))
