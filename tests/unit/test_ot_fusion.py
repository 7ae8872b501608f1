"""OT fusion: alignment recovers a permuted copy exactly; unsupported models and fleets are refused."""

import numpy as np
import pytest
import torch

from oneshot_fl.fusion.averaging import HeterogeneousFleetError
from oneshot_fl.fusion.ot import UnsupportedModelError, align, layer_chain, ot_fuse, transport_map
from oneshot_fl.models.registry import build


def permuted_copy(state, chain, seed=0):
    """The same function with every hidden layer's neurons shuffled (BN and next layer's inputs too)."""
    gen = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in state.items()}
    prev = None
    for i, layer in enumerate(chain):
        w = out[layer.weight]
        if prev is not None:
            if w.dim() == 4:
                w = w[:, prev]
            elif w.shape[1] == len(prev):
                w = w[:, prev]
            else:
                w = w.reshape(len(w), len(prev), -1)[:, prev].reshape(w.shape)
        if i == len(chain) - 1:
            out[layer.weight] = w
            break
        perm = torch.randperm(layer.out_features, generator=gen)
        out[layer.weight] = w[perm]
        if layer.bias:
            out[layer.bias] = out[layer.bias][perm]
        for key in layer.bn:
            out[key] = out[key][perm]
        prev = perm
    return out


def randomise_bn(model, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=gen))
            m.running_var.copy_(torch.rand(m.num_features, generator=gen) + 0.5)
            m.weight.data.copy_(torch.randn(m.num_features, generator=gen))


@pytest.mark.parametrize("arch, shape", [("cnn2", (1, 28, 28)), ("lenet", (1, 28, 28)), ("cnn3-bn", (3, 32, 32)),
                                         ("vgg9-small", (1, 28, 28))])
def test_alignment_recovers_a_permuted_copy_exactly(arch, shape):
    model = build(arch, shape, 10, seed=0).eval()
    randomise_bn(model)
    reference = model.state_dict()
    chain = layer_chain(model, arch)
    shuffled = permuted_copy(reference, chain)
    assert any(not torch.equal(shuffled[k], reference[k]) for k in reference)
    x = torch.rand(4, *shape)
    copy = build(arch, shape, 10).eval()
    copy.load_state_dict(shuffled)
    assert torch.allclose(copy(x), model(x), atol=1e-5)  # a permutation keeps the function
    aligned = align(shuffled, reference, chain)
    for key in reference:
        assert torch.allclose(aligned[key].float(), reference[key].float(), atol=1e-6), key
    fused = ot_fuse([reference, shuffled], [1.0, 3.0], build(arch, shape, 10), probe=x, arch=arch)
    for key in reference:  # the average of two aligned copies is the model itself
        if reference[key].is_floating_point():
            assert torch.allclose(fused[key], reference[key], atol=1e-5), key


def test_transport_map_is_the_permutation_for_a_hand_made_cost():
    cost = np.array([[5.0, 0.0, 9.0], [0.0, 5.0, 9.0], [9.0, 9.0, 0.0]])  # neuron 0 <-> 1, 1 <-> 0, 2 <-> 2
    perm = transport_map(cost)
    assert torch.equal(perm, torch.tensor([[0.0, 1, 0], [1, 0, 0], [0, 0, 1]], dtype=torch.float64))
    soft = transport_map(cost, "sinkhorn", 0.5)
    assert torch.allclose(soft.sum(0), torch.ones(3, dtype=torch.float64), atol=1e-3)
    assert torch.allclose(soft.sum(1), torch.ones(3, dtype=torch.float64), atol=1e-3)


@pytest.mark.parametrize("arch", ["resnet18", "googlenet"])
def test_residual_and_branching_models_are_refused(arch):
    with pytest.raises(UnsupportedModelError, match="residual or branching"):
        layer_chain(build(arch, (3, 32, 32), 10), arch)


def test_different_architectures_are_refused():
    a, b = build("cnn2", (1, 28, 28), 10).state_dict(), build("lenet", (1, 28, 28), 10).state_dict()
    with pytest.raises(HeterogeneousFleetError, match="one architecture"):
        ot_fuse([a, b], [1, 1], build("cnn2", (1, 28, 28), 10))


def test_ot_strategy_refuses_heterogeneous_fleets_and_resnets_before_any_work(tmp_path, mnist_dir):
    from oneshot_fl.config import ConfigError, from_run_config, merge_overrides
    from strategies import build_strategy

    hetero = from_run_config(merge_overrides({"method": "ot", "preset": "smoke", "client-models": "cnn2,lenet",
                                              "server-model": "cnn2"}))
    with pytest.raises(ConfigError, match="heterogeneous fleet"):
        build_strategy(hetero, run_dir=tmp_path / "a")
    resnet = from_run_config(merge_overrides({"method": "ot", "preset": "smoke", "model": "resnet18"}))
    with pytest.raises(ConfigError, match="ot cannot fuse resnet18"):
        build_strategy(resnet, run_dir=tmp_path / "b")
