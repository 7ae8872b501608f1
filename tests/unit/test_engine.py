"""The data-free engine's pieces against hand-computed values."""

import pytest
import torch
import torch.nn.functional as F

from oneshot_fl.engine.hooks import bn_stats_loss
from oneshot_fl.engine.losses import adversarial_loss, hard_label_ce, kd_loss, kl_per_sample
from oneshot_fl.engine.pool import SyntheticPool
from oneshot_fl.engine.stratify import normalise, relative_range
from oneshot_fl.engine.synthesizer import balanced_labels
from oneshot_fl.engine.teachers import ClientEnsemble, MeanLogits, StratifiedAggregation, Teacher, WeightedLogits
from oneshot_fl.models.generator import Generator
from oneshot_fl.models.registry import build


def test_stratified_aggregation_matches_a_hand_computed_two_client_three_class_example():
    # U stored (c, m): rows = classes, columns = clients
    u_r = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]])  # rows sum to 1
    u_c = torch.tensor([[0.6, 0.1], [0.3, 0.7], [0.1, 0.2]])  # columns sum to 1
    p1 = torch.tensor([[2.0, -1.0, 0.5], [0.0, 3.0, 1.0]])  # client 1 logits, 2 samples
    p2 = torch.tensor([[1.0, 1.0, -2.0], [4.0, 0.0, 2.0]])  # client 2
    y = torch.tensor([0, 1])
    # P[i,j] = sum_k U_r[y_i,k] U_c[j,k] P_k[i,j], worked out by hand:
    expected = torch.tensor([
        [0.9 * 0.6 * 2.0 + 0.1 * 0.1 * 1.0, 0.9 * 0.3 * -1.0 + 0.1 * 0.7 * 1.0, 0.9 * 0.1 * 0.5 + 0.1 * 0.2 * -2.0],
        [0.2 * 0.6 * 0.0 + 0.8 * 0.1 * 4.0, 0.2 * 0.3 * 3.0 + 0.8 * 0.7 * 0.0, 0.2 * 0.1 * 1.0 + 0.8 * 0.2 * 2.0],
    ])
    assert torch.allclose(expected, torch.tensor([[1.09, -0.2, 0.005], [0.32, 0.18, 0.34]]))
    sa = StratifiedAggregation(u_r, u_c)
    assert torch.allclose(sa(torch.stack([p1, p2]), y), expected, atol=1e-6)
    # without labels (test data): the uniform-prior average of U_r's rows, never the true label
    v = u_r.mean(dim=0)
    no_label = torch.stack([v[0] * u_c[:, 0] * p1[i] + v[1] * u_c[:, 1] * p2[i] for i in range(2)])
    assert torch.allclose(sa(torch.stack([p1, p2])), no_label, atol=1e-6)


def test_sa_with_uniform_weights_is_the_mean_ensemble_scaled_by_one_over_c():
    logits = torch.randn(4, 8, 5)
    labels = torch.randint(0, 5, (8,))
    sa = StratifiedAggregation(torch.full((5, 4), 0.25), torch.full((5, 4), 0.2))
    assert torch.allclose(sa(logits, labels), MeanLogits()(logits) / 5, atol=1e-6)


def test_weighted_logits_normalise_by_the_weight_sum():
    logits = torch.randn(2, 3, 4)
    w = torch.tensor([1.0, 3.0])
    assert torch.allclose(WeightedLogits(w)(logits), 0.25 * logits[0] + 0.75 * logits[1])


def test_relative_range_and_normalisations():
    losses = torch.tensor([[[2.0, 1.0, 0.5], [1.0, 1.0, 1.0]], [[3.0, 2.0, 1.5], [4.0, 2.0, 1.0]]])  # (m=2, c=2, T=3)
    u = relative_range(losses).T  # (c, m)
    assert torch.allclose(u, torch.tensor([[3.0, 1.0], [0.0, 3.0]]), atol=1e-6)
    u_r, u_c = normalise(u)
    assert torch.allclose(u_r.sum(dim=1), torch.ones(2))
    assert torch.allclose(u_c.sum(dim=0), torch.ones(2))
    assert torch.allclose(u_r, torch.tensor([[0.75, 0.25], [0.0, 1.0]]))
    assert torch.allclose(u_c, torch.tensor([[1.0, 0.25], [0.0, 0.75]]))


def test_normalisation_falls_back_to_uniform_on_zero_losses_ranges():
    u = torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 3.0]])  # class 0: no client moved; client 1: nothing
    u_r, u_c = normalise(u)
    assert torch.allclose(u_r[0], torch.full((3,), 1 / 3))
    assert torch.allclose(u_c[:, 1], torch.full((2,), 1 / 2))
    assert torch.allclose(u_r.sum(dim=1), torch.ones(2)) and torch.allclose(u_c.sum(dim=0), torch.ones(3))
    assert torch.isfinite(u_r).all() and torch.isfinite(u_c).all()


def test_kl_losses_by_hand():
    t = torch.tensor([[2.0, 0.0]])
    s = torch.tensor([[0.0, 0.0]])
    p = F.softmax(t, 1)[0]
    expected = float(p[0] * torch.log(p[0] / 0.5) + p[1] * torch.log(p[1] / 0.5))
    assert kl_per_sample(t, s).item() == pytest.approx(expected, rel=1e-6)
    assert kd_loss(s, t).item() == pytest.approx(expected, rel=1e-6)
    assert kd_loss(s, t, temperature=2.0).item() == pytest.approx(4 * kl_per_sample(t, s, 2.0).item(), rel=1e-6)
    assert kd_loss(t, t).item() == pytest.approx(0.0, abs=1e-7)
    # DENSE's mask: rows where teacher and student agree contribute 0 but still count in the mean
    teacher = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    student = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    full = kl_per_sample(teacher, student)
    assert adversarial_loss(teacher, student, "none").item() == pytest.approx(-full.mean().item())
    assert adversarial_loss(teacher, student, "disagree").item() == pytest.approx(-full[0].item() / 2)
    # Co-Boosting's T=3 adversarial term carries T^2 as in its reference code: by hand, row 0 at T=3
    # has p = softmax([2/3, 0]), q = softmax([0, 1/3])
    p3, q3 = F.softmax(torch.tensor([2 / 3, 0.0]), 0), F.softmax(torch.tensor([0.0, 1 / 3]), 0)
    row0 = float((p3 * (p3 / q3).log()).sum())
    p3b, q3b = F.softmax(torch.tensor([0.0, 2 / 3]), 0), q3
    row1 = float((p3b * (p3b / q3b).log()).sum())
    assert adversarial_loss(teacher, student, "none", temperature=3.0).item() == pytest.approx(
        -9.0 * (row0 + row1) / 2, rel=1e-6)
    assert hard_label_ce(student, teacher).item() == pytest.approx(
        F.cross_entropy(student, torch.tensor([0, 1])).item())


def _trained_bn_model(seed):
    model = build("cnn2", (1, 28, 28), 10, seed=seed).train()
    with torch.no_grad():
        model(torch.rand(32, 1, 28, 28))  # running statistics move away from (0, 1)
    return model.eval()


def test_bn_loss_by_hand_and_hooks_are_removed():
    model = _trained_bn_model(0)
    x = torch.rand(16, 1, 28, 28)
    bn1 = model.features[1]
    h = model.features[0](x)
    expected_first = (torch.norm(h.mean(dim=(0, 2, 3)) - bn1.running_mean)
                      + torch.norm(h.var(dim=(0, 2, 3), unbiased=False) - bn1.running_var))
    with bn_stats_loss([model]) as loss:
        model(x)
        first = loss.per_model[0][0].loss
        assert torch.allclose(first, expected_first, atol=1e-5)
        assert loss.value() > first  # two BN layers summed
    assert all(len(m._forward_hooks) == 0 for m in model.modules())


@pytest.mark.parametrize("vectorize", [False, True])
def test_ensemble_bn_loss_averages_over_clients_with_bn_and_closes_cleanly(vectorize):
    models = [_trained_bn_model(i) for i in range(3)] + [build("lenet", (1, 28, 28), 10).eval()]
    ensemble = ClientEnsemble(models, ["cnn2"] * 3 + ["lenet"], vectorize=vectorize)
    x = torch.rand(8, 1, 28, 28, requires_grad=True)
    logits, bn = ensemble(x)
    assert logits.shape == (4, 8, 10)
    expected = []
    for m in models[:3]:
        with bn_stats_loss([m]) as single:
            m(x)
            expected.append(single.value())
    assert torch.allclose(bn, torch.stack(expected).mean(), atol=1e-4)  # the BN-less LeNet is left out
    bn.backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert ensemble.hook_count() > 0
    ensemble.close()
    assert ensemble.hook_count() == 0
    assert all(len(m._forward_hooks) == 0 for model in models for m in model.modules())


@pytest.mark.parametrize("vectorize", [False, True])
def test_ensemble_logits_equal_the_forward_and_skip_the_bn_statistics(vectorize, monkeypatch):
    models = [_trained_bn_model(i) for i in range(2)] + [build("lenet", (1, 28, 28), 10, seed=0).eval()]
    ensemble = ClientEnsemble(models, ["cnn2", "cnn2", "lenet"], vectorize=vectorize)
    variances = []  # the BN hooks' x.var calls: one per BN layer and forward
    var = torch.Tensor.var
    monkeypatch.setattr(torch.Tensor, "var", lambda self, *a, **k: variances.append(1) or var(self, *a, **k))
    x = torch.rand(5, 1, 28, 28, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        forward_logits, bn = ensemble(x)
    per_forward = len(variances)
    assert float(bn) > 0 and per_forward > 0
    logits = ensemble.logits(x)
    assert torch.allclose(logits, forward_logits, atol=1e-5)  # upload order kept across the two groups
    assert len(variances) == per_forward  # the statistics were not computed
    _, bn_again = ensemble(x)  # the hooks are back on for the generator's forwards
    assert len(variances) == 2 * per_forward and torch.allclose(bn_again, bn, atol=1e-5)
    ensemble.close()


def test_pool_policies():
    rng = torch.Generator().manual_seed(0)
    for policy, expected_batches in (("paper", 1), ("growing", 3), ("capped", 5)):
        pool = SyntheticPool(policy, max_batches=2, kd_steps=5, batch_size=4)
        for i in range(3):
            pool.add(torch.full((4, 1, 2, 2), float(i) / 3), torch.arange(4), torch.randn(4, 3))
        batches = list(pool.epoch_batches(rng))
        assert len(batches) == expected_batches, policy
        if policy == "capped":
            assert len(pool) == 8  # FIFO cap of 2 batches
            assert all(b[0].min() >= 1 / 3 - 1e-3 for b in batches)  # the oldest batch was dropped
        if policy == "paper":
            assert torch.allclose(batches[0][0], torch.full((4, 1, 2, 2), 2 / 3), atol=1e-3)


def test_balanced_labels_cover_every_class():
    labels = balanced_labels(64, 10, torch.Generator().manual_seed(0))
    counts = torch.bincount(labels, minlength=10)
    assert counts.sum() == 64 and counts.min() >= 6


@pytest.mark.parametrize("size, channels", [(28, 1), (32, 3)])
def test_generator_output_shape_range_and_paper_parameter_count(size, channels):
    gen = Generator(nz=256, ngf=64, image_size=size, channels=channels)
    out = gen(torch.randn(4, 256))
    assert out.shape == (4, channels, size, size) and out.min() >= 0 and out.max() <= 1
    if (size, channels) == (28, 1):
        assert sum(p.numel() for p in gen.parameters()) == 1_834_305


def test_bn_cap_limits_one_clients_bn_loss_to_a_multiple_of_the_median():
    ensemble = ClientEnsemble([build("cnn2", (1, 28, 28), 10, seed=0)], ["cnn2"])
    per_client = torch.tensor([1.0, 2.0, 3.0, 100.0, 2.0], requires_grad=True)
    assert float(ensemble.combine_bn(per_client)) == pytest.approx((1 + 2 + 3 + 100 + 2) / 5)  # bn_cap 0: the mean
    ensemble.bn_cap = 10.0
    capped = ensemble.combine_bn(per_client)  # median 2 -> the 100 counts as 20
    assert float(capped) == pytest.approx((1 + 2 + 3 + 20 + 2) / 5)
    capped.backward()
    assert per_client.grad.tolist() == pytest.approx([0.2, 0.2, 0.2, 0.0, 0.2])  # no pull from the capped client
    ensemble.close()


@pytest.mark.parametrize("vectorize", [False, True])
def test_keep_only_gives_the_forward_of_an_ensemble_of_the_kept_clients(vectorize):
    models = [build("cnn2", (1, 28, 28), 10, seed=s).eval() for s in (0, 1, 2)]
    x = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(3))
    per_client = []
    for m in models:  # each client's own BN loss, from an ensemble of one
        alone = ClientEnsemble([m], ["cnn2"])
        per_client.append(alone(x)[1])
        alone.close()
    per_client = torch.stack(per_client)
    ensemble = ClientEnsemble(models, ["cnn2"] * 3, vectorize=vectorize)
    logits, bn = ensemble(x)
    assert float(bn) == pytest.approx(float(per_client.mean()), rel=1e-5)
    ensemble.keep_only(torch.tensor([True, False, True]))
    assert len(ensemble) == 2 and ensemble.archs == ["cnn2", "cnn2"]
    assert sum(len(mod._forward_hooks) for mod in models[1].modules()) == 0  # the dropped client's hooks left
    kept_logits, kept_bn = ensemble(x)
    assert float(kept_bn) == pytest.approx(float(per_client[[0, 2]].mean()), rel=1e-5)
    assert torch.allclose(kept_logits, logits[[0, 2]], atol=1e-6)
    pair = ClientEnsemble([models[0], models[2]], ["cnn2"] * 2, vectorize=vectorize)
    pair_logits, pair_bn = pair(x)
    assert torch.equal(kept_logits, pair_logits) and torch.equal(kept_bn, pair_bn)  # to the bit
    pair.close()
    ensemble.close()
    assert ensemble.hook_count() == 0 and sum(len(mod._forward_hooks) for m in models for mod in m.modules()) == 0
    with pytest.raises(ValueError, match="at least one client"):
        ensemble.keep_only(torch.zeros(2, dtype=torch.bool))


def test_stacked_bn_less_group_returns_logits_equal_to_the_loop_and_a_zero_bn_loss():
    models = [build("lenet", (1, 28, 28), 10, seed=s).eval() for s in (0, 1)]
    x = torch.rand(4, 1, 28, 28, generator=torch.Generator().manual_seed(2))
    stacked = ClientEnsemble(models, ["lenet", "lenet"], vectorize=True)
    looped = ClientEnsemble(models, ["lenet", "lenet"], vectorize=False)
    (ls, bs), (ll, bl) = stacked(x), looped(x)
    assert torch.allclose(ls, ll, atol=1e-5) and float(bs) == 0.0 and float(bl) == 0.0
    stacked.close(), looped.close()


def test_ensemble_to_moves_and_returns_itself_and_still_answers():
    models = [_trained_bn_model(i) for i in range(2)]
    x = torch.rand(3, 1, 28, 28)
    for vectorize in (False, True):
        ensemble = ClientEnsemble(models, ["cnn2", "cnn2"], vectorize=vectorize)
        before = ensemble.logits(x)
        assert ensemble.to(torch.device("cpu")) is ensemble
        assert torch.allclose(ensemble.logits(x), before, atol=1e-6)
        ensemble.close()


def test_sa_knows_when_it_needs_labels_and_says_what_it_refuses():
    u = torch.full((3, 2), 0.5)
    assert StratifiedAggregation(u, u, route="label").needs_labels is True
    assert StratifiedAggregation(u, u, route="class").needs_labels is False
    for space in ("odds", "probs", "capped"):  # probabilities and capped logits were retired with their knob
        with pytest.raises(ValueError, match=rf"^sa space '{space}': use logits or calibrated$"):
            StratifiedAggregation(u, u, space=space)
    with pytest.raises(ValueError, match=r"^sa route 'nowhere': use label or class$"):
        StratifiedAggregation(u, u, route="nowhere")
    assert StratifiedAggregation.SPACES == ("logits", "calibrated")


def test_teacher_passes_the_ensembles_logits_and_the_labels_to_its_aggregator():
    models = [_trained_bn_model(i) for i in range(2)]
    ensemble = ClientEnsemble(models, ["cnn2", "cnn2"])
    u_r = torch.tensor([[0.9, 0.1], [0.2, 0.8]] + [[0.5, 0.5]] * 8)
    sa = StratifiedAggregation(u_r, u_r, "logits", "label")
    teacher = Teacher(ensemble, sa)
    x = torch.rand(2, 1, 28, 28, generator=torch.Generator().manual_seed(3))
    y = torch.tensor([0, 1])
    out, bn, client_logits = teacher(x, y)
    expected_logits, expected_bn = ensemble(x)
    assert torch.allclose(client_logits, expected_logits) and torch.allclose(bn, expected_bn)
    assert torch.allclose(out, sa(expected_logits, y))
    assert not torch.allclose(out, sa(expected_logits, None))  # the labels reached the label-routed SA
    assert torch.allclose(teacher.predict(x, y), out)
    ensemble.close()
