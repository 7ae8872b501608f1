import pytest
import torch

from oneshot_fl.models.registry import ARCHITECTURES, build, expected_state, has_batchnorm

SHAPES = [(1, 28, 28), (3, 32, 32), (1, 32, 32), (3, 28, 28)]


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
@pytest.mark.parametrize("shape", SHAPES)
def test_every_architecture_takes_every_input_size(arch, shape):
    model = build(arch, shape, 10, seed=0).eval()
    with torch.no_grad():
        out = model(torch.rand(2, *shape))
    assert out.shape == (2, 10)
    expected = expected_state(arch, shape, 10)
    assert {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()} == expected


def test_parameter_counts_match_the_papers():
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    assert count(build("cnn2", (1, 28, 28), 10)) == 29_034  # FedHydra/DENSE CNNMnist
    assert count(build("vgg9", (1, 28, 28), 10)) == 69_166_346  # FedMHO Table (MNIST)
    # ResNet-8 by hand: stem 1*16*9 + BN 32; stage 1: 2 convs 16*16*9 + 2 BN 32 = 4,672; stage 2: 16*32*9 +
    # 32*32*9 + 2 BN 64 + shortcut 16*32 + BN 64 = 14,528; stage 3: 32*64*9 + 64*64*9 + 2 BN 128 + 32*64 +
    # BN 128 = 57,728; FC 64*10 + 10 = 650
    assert count(build("resnet8", (1, 28, 28), 10)) == 144 + 32 + 4_672 + 14_528 + 57_728 + 650 == 77_754


def test_batchnorm_presence():
    assert has_batchnorm(build("cnn2", (1, 28, 28), 10))
    assert has_batchnorm(build("cnn3-bn", (3, 32, 32), 10))
    assert has_batchnorm(build("resnet8", (1, 28, 28), 10))
    assert not has_batchnorm(build("cnn3", (3, 32, 32), 10))
    assert not has_batchnorm(build("lenet", (1, 28, 28), 10))


def test_seeded_init_is_reproducible():
    a = build("cnn2", (1, 28, 28), 10, seed=7).state_dict()
    b = build("cnn2", (1, 28, 28), 10, seed=7).state_dict()
    c = build("cnn2", (1, 28, 28), 10, seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_unsupported_input_size_is_a_clear_error():
    with pytest.raises(ValueError, match="28x28 or 32x32"):
        build("cnn2", (1, 64, 64), 10)


def test_models_are_built_channels_last_on_cpus_and_nchw_on_gpus(monkeypatch):
    def conv_weights(model):
        return [p for p in model.parameters() if p.dim() == 4]

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cpu = build("resnet8", (1, 28, 28), 10, seed=0)
    assert all(p.is_contiguous(memory_format=torch.channels_last) for p in conv_weights(cpu))
    # a weight with one input channel or a 1x1 kernel is both; the 3x3 ones over several channels are not NCHW
    assert any(not p.is_contiguous() for p in conv_weights(cpu))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # built on the CPU, but for a GPU process
    gpu = build("resnet8", (1, 28, 28), 10, seed=0)
    assert all(p.is_contiguous() for p in conv_weights(gpu))
    assert any(not p.is_contiguous(memory_format=torch.channels_last) for p in conv_weights(gpu))
    # the same values in either layout: the state dicts match key by key
    for (key, a), (_, b) in zip(cpu.state_dict().items(), gpu.state_dict().items()):
        assert torch.equal(a, b), key
