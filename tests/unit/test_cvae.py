"""CVAE models, the decoder upload role and its checks, CVAE local training, client roles."""

import numpy as np
import pytest
import torch

from oneshot_fl.config import CVAESettings, from_run_config, merge_overrides, resolve_cvae_settings
from oneshot_fl.data.datasets import Split
from oneshot_fl.local.cvae import train_cvae
from oneshot_fl.models.cvae import (CVAE_ARCHITECTURES, build_cvae, build_decoder, elbo_loss, elbo_per_example,
                                    expected_decoder_state)
from oneshot_fl.uploads import InvalidUpload, decode_and_check, encode

MNIST = (1, 28, 28)


def count(module):
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("arch, shape, classes, latent, decoder_params, full_params", [
    ("cvae-mlp", (1, 28, 28), 10, 2, 204_816, 409_364),  # FedMHO code's CVAE-small on MNIST
    ("cvae-conv", (3, 32, 32), 10, 20, 150_171, 302_859),  # SVHN CVAE-small
    ("cvae-conv", (1, 28, 28), 47, 20, 221_081, 436_401),  # EMNIST CVAE-small
    ("cvae-large", (1, 28, 28), 10, 20, 3_601_153, None),  # FEDCVAE's CVAE-large decoder
])
def test_parameter_counts_match_the_spec(arch, shape, classes, latent, decoder_params, full_params):
    with torch.device("meta"):
        model = build_cvae(arch, shape, classes, latent)
    assert model.latent_dim == latent  # the architecture's default latent size
    assert count(model.decoder) == decoder_params
    if full_params:
        assert count(model) == full_params


@pytest.mark.parametrize("arch", list(CVAE_ARCHITECTURES))
@pytest.mark.parametrize("shape", [(1, 28, 28), (3, 32, 32)])
def test_every_cvae_takes_both_input_sizes_and_outputs_pixels_in_0_1(arch, shape):
    model = build_cvae(arch, shape, 10, latent_dim=3, seed=0)
    with torch.no_grad():
        recon, mu, logvar = model(torch.rand(2, *shape), torch.tensor([0, 9]))
    assert recon.shape == (2, *shape) and mu.shape == logvar.shape == (2, 3)
    assert 0.0 <= float(recon.min()) and float(recon.max()) <= 1.0
    decoder = build_decoder(arch, shape, 10, 3)
    assert {k: (tuple(v.shape), v.dtype) for k, v in decoder.state_dict().items()} == \
        expected_decoder_state(arch, shape, 10, 3)


def test_elbo_against_a_hand_computed_value():
    x = torch.tensor([[1.0, 0.0]])
    recon = torch.tensor([[0.5, 0.5]])
    mu, logvar = torch.tensor([[1.0]]), torch.tensor([[0.0]])
    loss, bce, kld = elbo_loss(recon, x, mu, logvar, kl_weight=2.0)
    assert bce.item() == pytest.approx(2 * np.log(2))
    assert kld.item() == pytest.approx(0.5)  # -0.5 * (1 + 0 - 1 - 1)
    assert loss.item() == pytest.approx(2 * np.log(2) + 1.0)


def test_the_per_example_elbo_is_each_examples_own_and_the_batch_loss_their_mean():
    # DP-SGD clips each example's gradient, so it needs each example's loss, not the batch's
    x = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    recon = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    mu, logvar = torch.tensor([[1.0], [0.0]]), torch.tensor([[0.0], [0.0]])
    loss, bce, kld = elbo_per_example(recon, x, mu, logvar, kl_weight=2.0)
    assert bce.tolist() == pytest.approx([2 * np.log(2)] * 2)
    assert kld.tolist() == pytest.approx([0.5, 0.0])  # mu 1: -0.5 * (1 + 0 - 1 - 1); mu 0: 0
    assert loss.tolist() == pytest.approx([2 * np.log(2) + 1.0, 2 * np.log(2)])
    assert elbo_loss(recon, x, mu, logvar, kl_weight=2.0)[0].item() == pytest.approx(2 * np.log(2) + 0.5)


def test_an_exploded_log_variance_is_clamped_and_the_loss_stays_finite():
    """An encoder whose log-variance head has run off (Adam at the paper's lr on a skewed MNIST shard reached
    124) gives exp overflow and an inf KL without the clamp; the clamp is the identity inside +-20."""
    model = build_cvae("cvae-mlp", MNIST, 10, seed=0)
    with torch.no_grad():
        model.encoder.logvar.bias.copy_(torch.tensor([124.0, -3.0]))
        model.encoder.logvar.weight.zero_()
        x, y = torch.rand(4, *MNIST), torch.tensor([0, 1, 2, 3])
        recon, mu, logvar = model(x, y, generator=torch.Generator().manual_seed(0))
        assert logvar[:, 0].tolist() == [20.0] * 4 and logvar[:, 1].tolist() == [-3.0] * 4
        loss, _, kld = elbo_loss(recon, x, mu, logvar)
        assert torch.isfinite(loss) and torch.isfinite(recon).all()
        # -0.5 * sum(1 + logvar - mu^2 - e^logvar) / batch, with mu from the same forward
        expected = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).sum() / 4
        assert kld.item() == pytest.approx(expected.item()) and kld.item() > 2e8  # e^20 / 2 per sample


def test_cvae_training_lowers_the_loss_on_a_tiny_set():
    rng = np.random.default_rng(0)
    images = (rng.random((64, 28, 28, 1)) > 0.7).astype(np.uint8) * 255
    shard = Split(images, rng.integers(0, 10, 64))
    model = build_cvae("cvae-mlp", MNIST, 10, seed=0)
    settings = CVAESettings("cvae-mlp", 2, 1.0, epochs=1, lr=1e-2, batch_size=16)
    first = train_cvae(model, shard, settings, torch.device("cpu"), torch.Generator().manual_seed(0))
    later = train_cvae(model, shard, settings, torch.device("cpu"), torch.Generator().manual_seed(1))
    assert np.isfinite(first.final_loss) and later.final_loss < first.final_loss


def test_paper_settings_are_resolved_per_dataset():
    cfg = from_run_config(merge_overrides({"preset": "cpu", "dataset": "fmnist"})).cvae
    s = resolve_cvae_settings(cfg, "fmnist", MNIST)
    assert (s.arch, s.latent_dim, s.epochs, s.lr) == ("cvae-mlp", 2, 40, 5e-2)
    s = resolve_cvae_settings(cfg, "svhn", (3, 32, 32))
    assert (s.arch, s.latent_dim, s.epochs, s.lr) == ("cvae-conv", 20, 40, 1e-3)



def test_a_dp_decoder_client_gets_the_private_recipe_unless_the_run_sets_its_own():
    from oneshot_fl.config import PRIVATE_CVAE
    from oneshot_fl.paper_settings import PAPER_BATCH

    cfg = from_run_config(merge_overrides({"preset": "cpu"})).cvae
    plain = resolve_cvae_settings(cfg, "mnist", MNIST)
    assert (plain.lr, plain.batch_size, plain.epochs) == (5e-2, PAPER_BATCH, 30) and PAPER_BATCH == 64
    private = resolve_cvae_settings(cfg, "mnist", MNIST, private=True)
    assert (private.lr, private.batch_size, private.epochs) == (PRIVATE_CVAE["lr"], PRIVATE_CVAE["batch_size"], 30)
    assert PRIVATE_CVAE["batch_size"] > PAPER_BATCH
    own = from_run_config(merge_overrides({"preset": "cpu", "cvae.lr": 1e-3, "cvae.batch-size": 32})).cvae
    assert (resolve_cvae_settings(own, "mnist", MNIST, private=True).lr,
            resolve_cvae_settings(own, "mnist", MNIST, private=True).batch_size) == (1e-3, 32)

# --- the decoder upload -----------------------------------------------------------------------

def decoder_content(counts=None, latent=2, arch="cvae-mlp", **extra):
    model = build_cvae(arch, MNIST, 10, latent, seed=0)
    counts = np.arange(1, 11) if counts is None else counts
    meta = {"latent-dim": latent, **extra}
    return encode("decoder", arch, model.decoder.state_dict(), counts, 7, {"train-loss": 1.0}, extra=meta), model


def check(content, roles=("decoder",)):
    return decode_and_check(content, node_id=3, num_classes=10, input_shape=MNIST, roles=roles)


def test_a_decoder_upload_round_trips_and_stays_within_2_percent_of_raw_plus_histogram():
    content, model = decoder_content()
    up = check(content)
    assert (up.role, up.arch, up.extra["latent-dim"], up.num_examples) == ("decoder", "cvae-mlp", 2, 55)
    for key, tensor in model.decoder.state_dict().items():
        assert torch.equal(up.state[key], tensor)
    assert up.raw_bytes == 204_816 * 4
    assert up.received_bytes <= 1.02 * (up.raw_bytes + up.label_counts.nbytes)


def _set_counts(values):
    def apply(content):
        from flwr.app import Array

        content.array_records["label-counts"]["counts"] = Array(values)
        return content
    return apply


BAD_DECODERS = {
    "negative": _set_counts(np.array([-1, 2, 3, 4, 5, 6, 7, 8, 9, 11])),
    "label counts have shape": _set_counts(np.arange(1, 12)),
    "expected integers": _set_counts(np.arange(1, 11).astype(np.float32)),
    "all zero": _set_counts(np.zeros(10, dtype=np.int64)),
    "missing label counts": lambda c: c.__delitem__("label-counts") or c,
    "latent-dim in 1..": lambda c: c.config_records["meta"].__setitem__("latent-dim", "two") or c,
    "latent-dim in 1.. ": lambda c: c.config_records["meta"].__delitem__("latent-dim") or c,
}


@pytest.mark.parametrize("reason", list(BAD_DECODERS))
def test_bad_decoder_histograms_and_settings_are_rejected(reason):
    content, _ = decoder_content()
    with pytest.raises(InvalidUpload) as err:
        check(BAD_DECODERS[reason](content))
    assert reason.strip() in err.value.reason


def test_decoder_upload_checks_latent_size_role_and_architecture():
    content, _ = decoder_content(latent=2)
    content.config_records["meta"]["latent-dim"] = 3  # claims another latent size than its tensors have
    with pytest.raises(InvalidUpload, match="fc1.weight.*shape"):
        check(content)
    content, _ = decoder_content()
    with pytest.raises(InvalidUpload, match="role 'decoder' not accepted"):
        check(content, roles=("classifier",))
    content, _ = decoder_content()
    content.config_records["meta"]["arch"] = "cnn2"
    with pytest.raises(InvalidUpload, match="unknown architecture 'cnn2' for role decoder"):
        check(content)
    content, _ = decoder_content()
    content.metric_records["metrics"]["num-examples"] = 54
    with pytest.raises(InvalidUpload, match="does not equal the label counts"):
        check(content)


# --- client roles and the decoder task ---------------------------------------------------------

def test_role_rule_node_config_and_aliases():
    from client_app.task import role_for

    cfg = from_run_config(merge_overrides({"num-clients": 10}))
    rule = {"constrained-clients": 5}
    assert [role_for(cfg, pid, {}, rule) for pid in range(10)] == ["classifier"] * 5 + ["decoder"] * 5
    assert role_for(cfg, 9, {"role": "sufficient"}, rule) == "classifier"  # node config wins
    assert role_for(cfg, 0, {"role": "constrained"}, rule) == "decoder"
    assert role_for(cfg, 0, {}, {"role": "decoder"}) == "decoder"
    assert role_for(cfg, 0, {}, {}) == "classifier"
    with pytest.raises(ValueError, match="unknown client role 'tiny'.*constrained"):
        role_for(cfg, 0, {"role": "tiny"}, rule)


def test_the_decoder_task_uploads_the_decoder_and_never_the_encoder(mnist_dir):
    from client_app.task import run_client

    cfg = from_run_config(merge_overrides({"preset": "smoke", "num-clients": 4, "local.max-samples": 128}))
    content = run_client(cfg, {"partition-id": 3, "num-partitions": 4}, {"constrained-clients": 2})
    assert set(content.keys()) == {"decoder", "label-counts", "meta", "metrics"}
    layout = content.config_records["meta"]["layout"]
    keys = [entry.split("|")[0] for entry in layout]
    expected = expected_decoder_state("cvae-mlp", MNIST, 10, 2)
    assert keys == list(expected)  # exactly the decoder's tensors ...
    assert not any("encoder" in k or k.startswith(("mu", "logvar")) for k in keys)
    values = content.array_records["decoder"]["values"].numpy()
    assert values.size == sum(int(np.prod(s)) for s, _ in expected.values())  # ... and nothing else
    up = check(content)
    assert up.partition_id == 3 and up.num_examples == 128
    # the reported loss is the negative ELBO: reconstruction + kl-weight (1) x KL, each per sample
    m = up.metrics
    assert m["train-loss"] == pytest.approx(m["train-recon"] + cfg.cvae.kl_weight * m["train-kl"], rel=1e-5)
    assert m["train-recon"] > 0 and m["train-kl"] >= 0  # BCE over 784 pixels and a KL: neither can be negative
    assert m["train-loss"] != pytest.approx(m["train-recon"], rel=1e-6)  # the KL term is in it
