"""FedMHO (-MD, -SD) and FedCVAE on fake replies: start model, teachers, edge cases, results."""

import json

import numpy as np
import pytest
import torch

from oneshot_fl.config import ConfigError, from_run_config, merge_overrides
from oneshot_fl.engine.teachers import MeanLogits
from oneshot_fl.models.cvae import build_cvae
from oneshot_fl.models.registry import build
from oneshot_fl.uploads import decode_and_check, encode
from strategies import build_strategy
from tests.conftest import reply_message

MNIST = (1, 28, 28)


def _strategy(tmp_path, method="fedmho-md", **over):
    flat = merge_overrides({"method": method, "preset": "smoke", "eval.test-samples": 200, **over})
    return build_strategy(from_run_config(flat), run_dir=tmp_path / "run")


def classifier_reply(node, seed, counts=(10,) * 10, fill=None):
    state = build("cnn2", MNIST, 10, seed=seed).state_dict()
    if fill is not None:
        state = {k: (v.fill_(fill) if v.is_floating_point() else v) for k, v in state.items()}
    return reply_message(encode("classifier", "cnn2", state, np.array(counts), node - 1,
                                {"local-test-accuracy": 0.5}), src_node_id=node)


def decoder_reply(node, seed, counts=(10,) * 10):
    decoder = build_cvae("cvae-mlp", MNIST, 10, seed=seed).decoder
    return reply_message(encode("decoder", "cvae-mlp", decoder.state_dict(), np.array(counts), node - 1,
                                {"train-loss": 1.0}, extra={"latent-dim": 2}), src_node_id=node)


def mixed_replies():
    return [classifier_reply(1, 0, fill=1.0), classifier_reply(2, 1, fill=3.0),
            decoder_reply(3, 2, counts=[20] * 5 + [0] * 5), decoder_reply(4, 3, counts=[0] * 5 + [20] * 5)]


def run(strategy, replies):
    strategy._sent = [r.metadata.src_node_id for r in replies]
    strategy.aggregate_train(1, replies)
    return json.loads((strategy.ctx.run_dir / "result.json").read_text())


def test_mixed_fleet_result_has_per_role_sizes_counts_and_sample_grids(tmp_path, mnist_dir):
    result = run(_strategy(tmp_path, **{"num-clients": 4}), mixed_replies())
    g = result["global"]
    assert g["classifier_clients"] == 2 and g["decoder_clients"] == 2
    assert g["init"].startswith("uniform average of 2 cnn2")
    assert g["synthetic"]["drawn"] == 200 and g["synthetic"]["kept"] == 160  # smoke N_syn, R_th = 0.8
    assert g["synthetic"]["plan"][0] == [20] * 5 + [0] * 5  # class p: only the decoder holding it draws it
    assert g["teacher"] == "mean logits of 2 classifier clients" and g["fusion_kd"] is True
    assert g["fusion_lr"] == 1e-5 and g["fusion_epochs"] == 1  # Table III lr for MNIST, smoke epochs
    roles = result["upload_bytes"]["per_role"]
    assert roles["classifier"]["clients"] == 2 and roles["decoder"]["clients"] == 2
    assert roles["decoder"]["raw_bytes"] == [204_816 * 4] * 2
    assert roles["decoder"]["max_ratio_to_raw_plus_counts"] <= 1.02
    assert [c["role"] for c in result["clients"]] == ["classifier", "classifier", "decoder", "decoder"]
    for name in ("synthetic_samples.png", "synthetic_dropped.png", "client_accuracy.png", "accuracy.png"):
        assert (tmp_path / "run" / name).is_file(), name
    assert set(result["timings"]) >= {"generation", "filtering", "teacher_logits", "fusion"}


def test_each_run_scores_the_decoder_samples_with_a_real_data_classifier(tmp_path, mnist_dir):
    # the real-data scorer is fitted on half the run's test split (200 images here) and judges the kept samples;
    # these decoders are untrained, so what it says is near chance, but every number must be there and in range
    result = run(_strategy(tmp_path, **{"num-clients": 4}), mixed_replies())
    scores = result["global"]["decoder_samples"]
    assert scores["scorer"]["arch"] == "cnn2" and scores["scorer"]["fitted_on"] == 100
    assert 0.0 <= scores["scorer"]["held_out_accuracy"] <= 1.0
    assert 0.0 <= scores["kept_accuracy"] <= 1.0 and 0.0 <= scores["drawn_accuracy"] <= 1.0
    assert len(scores["kept_per_class"]) == 10 and all(v is None or 0 <= v <= 1 for v in scores["kept_per_class"])
    assert len(scores["kept_per_decoder"]) == 2  # one score per decoder client, in upload order
    assert "sample_scoring" in result["timings"]
    assert (tmp_path / "run" / "synthetic_samples.png").is_file()


def test_start_model_is_the_uniform_average_of_the_classifiers(tmp_path, mnist_dir):
    strategy = _strategy(tmp_path, **{"num-clients": 4})
    uploads = [decode_and_check(r.content, r.metadata.src_node_id, 10, MNIST, strategy.roles) for r in mixed_replies()]
    # counts differ (sizes 100 and 100 here), but Eq. 4 is uniform whatever the sizes
    uploads[1].label_counts = uploads[1].label_counts * 9
    model, informed = strategy.start_model(uploads[:2], strategy.ctx, {})
    assert informed
    weight = model.state_dict()["features.0.weight"]
    assert torch.allclose(weight, torch.full_like(weight, 2.0))


def test_md_teacher_is_the_mean_of_client_logits_and_sd_teacher_the_frozen_start(tmp_path, mnist_dir):
    md = _strategy(tmp_path, method="fedmho-md", **{"num-clients": 4})
    uploads = [decode_and_check(r.content, r.metadata.src_node_id, 10, MNIST, md.roles)
               for r in (classifier_reply(1, 0), classifier_reply(2, 1))]
    images = torch.rand(6, *MNIST)
    clients = []
    for up in uploads:
        model = build("cnn2", MNIST, 10)
        model.load_state_dict(up.state)
        clients.append(model.eval()(images).detach())
    from oneshot_fl.engine.teachers import ClientEnsemble
    from strategies.datafree import client_models

    ensemble = ClientEnsemble(client_models(uploads, md.ctx), ["cnn2", "cnn2"])
    got = md.teacher_logits(images, ensemble, None, True, md.ctx, {})
    ensemble.close()
    assert torch.allclose(got, MeanLogits()(torch.stack(clients)), atol=1e-5)

    sd = _strategy(tmp_path, method="fedmho-sd", **{"num-clients": 4})
    start, _ = sd.start_model(uploads, sd.ctx, {})
    start.train()  # the student trains in train mode; the teacher copy must be in eval mode
    expected = build("cnn2", MNIST, 10)
    expected.load_state_dict(start.state_dict())
    got = sd.teacher_logits(images, None, start, True, sd.ctx, {})
    assert torch.allclose(got, expected.eval()(images).detach(), atol=1e-5)
    assert start.training  # untouched
    plain = _strategy(tmp_path, method="fedmho", **{"num-clients": 4})
    assert plain.teacher_logits(images, None, start, True, plain.ctx, {}) is None
    assert plain.supervised_settings().kd_weight == 0.0


def test_no_classifier_clients_train_from_scratch_with_ce_only(tmp_path, mnist_dir):
    result = run(_strategy(tmp_path, method="fedmho-sd", **{"num-clients": 2}),
                 [decoder_reply(1, 0), decoder_reply(2, 1)])
    g = result["global"]
    assert g["init"] == "fresh (no classifier clients)" and g["teacher"] == "none" and g["fusion_kd"] is False
    assert "ensemble_accuracy" not in g


def test_no_decoder_clients_return_the_start_model(tmp_path, mnist_dir):
    result = run(_strategy(tmp_path, **{"num-clients": 2}), [classifier_reply(1, 0), classifier_reply(2, 1)])
    g = result["global"]
    assert g["fusion"] == "skipped: no decoder uploads"
    assert g["accuracy"] == pytest.approx(g["init_accuracy"])


def test_fedcvae_trains_a_fresh_model_on_histogram_draws_and_rejects_classifiers(tmp_path, mnist_dir):
    strategy = _strategy(tmp_path, method="fedcvae", **{"num-clients": 3, "min-clients": 2})
    assert strategy.client_config() == {"role": "decoder"}
    result = run(strategy, [decoder_reply(1, 0, counts=[30] * 5 + [0] * 5),
                            decoder_reply(2, 1, counts=[0] * 9 + [50]), classifier_reply(3, 2)])
    g = result["global"]
    assert g["init_accuracy"] < 0.5 and "ensemble_accuracy" not in g  # a fresh model, no classifier teachers
    assert g["synthetic"]["plan"] == [[30] * 5 + [0] * 5, [0] * 9 + [50]]  # 200 by data size, own histograms
    assert g["synthetic"]["kept"] == 200  # no filtering
    assert g["fusion_kd"] is False
    assert "not accepted" in result["rejected"][0]["reason"]


def test_constrained_clients_rule_and_bad_settings(tmp_path, mnist_dir):
    assert _strategy(tmp_path, **{"num-clients": 10}).client_config() == {"constrained-clients": 5}
    assert _strategy(tmp_path, **{"num-clients": 10, "fedmho.constrained-clients": 3}).client_config() == \
        {"constrained-clients": 3}
    with pytest.raises(ConfigError, match="constrained-clients=7 is more than num-clients=4"):
        _strategy(tmp_path, **{"num-clients": 4, "fedmho.constrained-clients": 7})
    with pytest.raises(ConfigError, match=r"^fedmho\.kd-reduction: retired; .*KL / C.*docs/decisions\.md"):
        _strategy(tmp_path, **{"fedmho.kd-reduction": "batchmean"})
    with pytest.raises(ConfigError, match="fedmho.keep-ratio=0.0"):
        _strategy(tmp_path, method="fedmho-sd", **{"fedmho.keep-ratio": 0.0})
    with pytest.raises(ConfigError, match="cvae.arch='vae'"):
        _strategy(tmp_path, **{"cvae.arch": "vae"})


def test_the_fusion_plans_by_squared_counts_and_keeps_the_nearest_80_percent_per_class(tmp_path, mnist_dir):
    # two decoders sharing classes 0 and 1; N_syn 200 (smoke) -> 20 per class
    a = [30, 10] + [0] * 8
    b = [10, 20] + [0] * 8
    replies = [classifier_reply(1, 0), decoder_reply(2, 2, counts=a), decoder_reply(3, 3, counts=b)]
    result = run(_strategy(tmp_path, method="fedmho", **{"num-clients": 3, "fedmho.constrained-clients": 2}),
                 replies)
    plan = result["global"]["synthetic"]["plan"]
    # class 0: 30^2 : 10^2 = 900 : 100 -> 18 : 2; class 1: 100 : 400 -> 4 : 16;
    # classes 2..9: no decoder holds them -> split evenly (absent-classes = uniform)
    assert [row[0] for row in plan] == [18, 2]
    assert [row[1] for row in plan] == [4, 16]
    assert all([row[c] for row in plan] == [10, 10] for c in range(2, 10))
    synthetic = result["global"]["synthetic"]
    assert synthetic["drawn"] == 200 and synthetic["kept"] == 160
    assert synthetic["kept_per_class"] == [16] * 10  # int(0.8 x 20) nearest to each class mean
