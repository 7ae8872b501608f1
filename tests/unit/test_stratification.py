"""Model Stratification on real client models: on a 2c/c split each client's weight lands on its
own two classes (the paper's Fig. 5b), and the batched implementation equals the reference."""

import pytest
import torch

from client_app.task import load_shard
from oneshot_fl.config import from_run_config, merge_overrides
from oneshot_fl.data.datasets import DATASETS
from oneshot_fl.devices import pick_device
from oneshot_fl.engine.stratify import stratify, stratify_sequential
from oneshot_fl.engine.teachers import freeze
from oneshot_fl.local.train import train_local
from oneshot_fl.models.generator import GeneratorSpec
from oneshot_fl.models.registry import build
from oneshot_fl.seeding import torch_generator

SPEC = GeneratorSpec(nz=32, ngf=8, image_size=28, channels=1)


@pytest.fixture(scope="module")
def two_class_clients():
    from tests.conftest import data_dir

    data_dir()
    cfg = from_run_config(merge_overrides({"preset": "smoke", "partition": "2c/c", "num-clients": 5,
                                           "local.max-samples": 600, "local.epochs": 2}))
    models = []
    for pid in range(5):
        model = build("cnn2", DATASETS["mnist"].input_shape, 10, seed=pid)
        train_local(model, load_shard(cfg, pid), cfg.local, pick_device(), torch_generator(0, pid))
        models.append(freeze(model))
    return models


def test_two_class_split_puts_each_clients_weight_on_its_own_classes(two_class_clients):
    result = stratify_sequential(two_class_clients, 10, SPEC, steps=12, batch=16, lr=1e-3, seed=0,
                                 device=pick_device())
    owner = torch.arange(10) // 2
    assert torch.allclose(result.u_r.sum(dim=1), torch.ones(10), atol=1e-5)
    assert torch.allclose(result.u_c.sum(dim=0), torch.ones(5), atol=1e-5)
    # U_r: for every class, the client that owns it gets the largest weight
    assert (result.u_r.argmax(dim=1) == owner).all(), result.u_r
    assert result.u_r[torch.arange(10), owner].mean() > 0.6
    # U_c: each client's column puts most of its mass on its two classes
    own_mass = torch.stack([result.u_c[2 * k:2 * k + 2, k].sum() for k in range(5)])
    assert (own_mass > 0.5).all(), result.u_c


def test_batched_stratification_equals_the_sequential_reference(two_class_clients):
    models = two_class_clients[:2]
    a = stratify_sequential(models, 10, SPEC, steps=4, batch=8, lr=1e-3, seed=3, device=torch.device("cpu"))
    b = stratify(models, 10, SPEC, steps=4, batch=8, lr=1e-3, seed=3, device=torch.device("cpu"))
    # vmapped (grouped) convolutions round differently from plain (on CPUs channels-last) ones, and 4 Adam steps
    # carry the difference on: the loss curves agree to 1e-3 (a wrong class or client would be off by ~1) and u,
    # a ratio over a small minimum, to a relative 2e-3
    assert torch.allclose(a.losses, b.losses, atol=1e-3)
    assert torch.allclose(a.u, b.u, rtol=2e-3, atol=1e-4)
    assert torch.allclose(a.u_r, b.u_r, atol=1e-3) and torch.allclose(a.u_c, b.u_c, atol=1e-3)


def test_batched_stratification_in_chunks_of_clients_equals_one_call(two_class_clients):
    """clients_per_call splits the fleet into vmapped chunks; every client appears once, in order."""
    models = two_class_clients[:3]
    whole = stratify(models, 10, SPEC, steps=3, batch=4, lr=1e-3, seed=5, device=torch.device("cpu"))
    chunked = stratify(models, 10, SPEC, steps=3, batch=4, lr=1e-3, seed=5, device=torch.device("cpu"),
                       clients_per_call=2)
    assert chunked.losses.shape == whole.losses.shape == (3, 10, 3)
    assert torch.allclose(chunked.losses, whole.losses, atol=1e-5)
    # the published defaults: Eq. 2's score, every run takes T_G steps, no images kept
    assert whole.score == "paper" and whole.samples is None
    assert whole.steps_run.dtype == torch.long and whole.steps_run.tolist() == [[3] * 10] * 3
    d = whole.as_dict()
    assert set(d) == {"score", "u", "u_r", "u_c", "seconds", "steps_run"}
    assert (d["score"], d["u"], d["u_r"], d["u_c"], d["seconds"]) == (
        "paper", whole.u.tolist(), whole.u_r.tolist(), whole.u_c.tolist(), whole.seconds)
    assert d["steps_run"] == whole.steps_run.T.tolist()  # (c, m), as U
    whole.steps_run = None
    assert "steps_run" not in whole.as_dict()
