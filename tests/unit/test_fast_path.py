"""The fast GPU path (oneshot_fl/fastpath.py) run on the CPU: CPU autocast has bfloat16, and "device-held" data is
data held on the compute device whatever it is, so the same code the GPU runs is checked here.

Tolerances, stated once: bf16 keeps 8 significant bits (relative rounding 2^-8 = 0.4 % per operation). A forward
through a few layers therefore moves logits by up to a few percent of their scale: BF16_LOGITS below bounds the
largest logit difference relative to the largest logit; losses, computed in float32 from those logits, are
compared relatively with BF16_LOSS; one SGD step's parameter update, whose gradient went through a bf16
backward, within BF16_STEP of the float32 update (norm of the difference over the norm of the update). The
device-held data path is the float32 path on the same values: it is compared bit for bit."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from torch import nn

from oneshot_fl.config import ConfigError, GPUConfig, LocalConfig, from_run_config, merge_overrides
from oneshot_fl.data.augment import PAD, crop_flip, crop_flip_params
from oneshot_fl.data.datasets import Split, to_tensor
from oneshot_fl.engine.distill import DistillSettings, distill
from oneshot_fl.engine.losses import kd_loss
from oneshot_fl.engine.pool import SyntheticPool
from oneshot_fl.engine.synthesizer import GeneratorLoss, GeneratorSynthesizer
from oneshot_fl.engine.teachers import ClientEnsemble, MeanLogits, Teacher
from oneshot_fl.fastpath import FLOAT32, FastPath, HeldImages
from oneshot_fl.local.train import train_local
from oneshot_fl.models.generator import GeneratorSpec
from oneshot_fl.models.registry import build
from tests.conftest import FixedSource

CPU = torch.device("cpu")
BF16_LOGITS = 0.05  # max |logit difference| / max |logit|
BF16_LOSS = 0.03  # |loss difference| / |loss|
BF16_STEP = 0.15  # |update difference| / |update| of one SGD step (a wrong sign or loss is off by 100 % and more)
BF16 = FastPath(bf16=True)
DEVICE_DATA = FastPath(device_data=True)


def shard(n=48, seed=0, size=32, channels=3):
    rng = np.random.default_rng(seed)
    return Split(rng.integers(0, 256, (n, size, size, channels), dtype=np.uint8), rng.integers(0, 10, n))


def trained(fast, augment="none", epochs=2, arch="lenet"):
    model = build(arch, (3, 32, 32), 10, seed=0)
    stats = train_local(model, shard(32), LocalConfig(epochs=epochs, batch_size=8, lr=0.05, augment=augment), CPU,
                        torch.Generator().manual_seed(0), fast=fast)
    return model, stats


# --- which parts are on -------------------------------------------------------------------------------------


def test_a_cpu_runs_the_float32_path_whatever_the_knobs_and_a_cuda_device_follows_them():
    assert FastPath.for_device(CPU, GPUConfig()) == FLOAT32
    assert not FLOAT32.on
    some = GPUConfig(bf16=False, device_data=True, channels_last=False)
    assert FastPath.for_device(torch.device("cuda"), some) == FastPath(bf16=False, device_data=True,
                                                                       channels_last=False)
    assert FastPath.for_device(torch.device("cuda"), GPUConfig()) == FastPath(True, True, True)


def test_the_gpu_knobs_are_run_config_keys_that_a_user_can_turn_off():
    cfg = from_run_config(merge_overrides({"gpu.bf16": False, "gpu.channels-last": False}))
    assert cfg.gpu == GPUConfig(bf16=False, device_data=True, channels_last=False)
    with pytest.raises(ConfigError, match="gpu.device-data"):
        from_run_config(merge_overrides({"gpu.device-data": "yes"}))
    with pytest.raises(ConfigError, match="local.augment"):
        from_run_config(merge_overrides({"local.augment": "flip"}))


def test_held_images_give_the_host_conversion_bit_for_bit():
    images = shard(10).images
    held = HeldImages(images, CPU)
    index = torch.tensor([3, 0, 7])
    assert held.images.dtype == torch.uint8
    assert torch.equal(held.batch(index), to_tensor(images)[index])
    assert torch.equal(held.batch(slice(2, 6)), to_tensor(images[2:6]))


# --- augmentation ---------------------------------------------------------------------------------------------


def known_image(size=8, channels=1):
    """Every pixel a different positive value: padding (0) and positions can be read off an output."""
    return torch.arange(1, channels * size * size + 1, dtype=torch.float32).view(channels, size, size)


def test_crop_flip_pads_with_zeros_shifts_by_the_offset_and_mirrors_columns():
    img = known_image()
    corner = crop_flip(img[None], torch.tensor([[0, 0]]), torch.tensor([False]))[0, 0]
    assert torch.equal(corner[:PAD], torch.zeros(PAD, 8)) and torch.equal(corner[:, :PAD], torch.zeros(8, PAD))
    assert torch.equal(corner[PAD:, PAD:], img[0, :8 - PAD, :8 - PAD])
    centre = crop_flip(img[None], torch.tensor([[PAD, PAD]]), torch.tensor([False]))[0]
    assert torch.equal(centre, img)  # offset = padding: the image itself
    far = crop_flip(img[None], torch.tensor([[2 * PAD, 1]]), torch.tensor([False]))[0, 0]
    assert torch.equal(far[:8 - PAD, PAD - 1:], img[0, PAD:, :8 - PAD + 1]) and torch.equal(far[8 - PAD:],
                                                                                             torch.zeros(PAD, 8))
    flipped = crop_flip(img[None], torch.tensor([[PAD, PAD]]), torch.tensor([True]))[0]
    assert torch.equal(flipped, img.flip(-1))
    batch = torch.stack([img, img + 100])
    both = crop_flip(batch, torch.tensor([[PAD, PAD], [0, 0]]), torch.tensor([True, False]))
    assert torch.equal(both[0], img.flip(-1)) and both[1, 0, 0, 0] == 0  # each image its own crop and flip


def test_crop_flip_is_torchvisions_random_crop_and_flip_bit_for_bit_on_the_same_stream():
    transforms = pytest.importorskip("torchvision.transforms")
    host = transforms.Compose([transforms.RandomCrop(32, padding=PAD), transforms.RandomHorizontalFlip()])
    img = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(0))
    for seed in range(40):
        torch.manual_seed(seed)
        expected = host(img)
        offsets, flips = crop_flip_params(1, torch.Generator().manual_seed(seed))
        assert torch.equal(crop_flip(img[None], offsets, flips)[0], expected), seed


def _chi_square(counts: np.ndarray) -> float:
    expected = counts.sum() / len(counts)
    return float(((counts - expected) ** 2 / expected).sum())


def test_crop_flip_draws_every_crop_and_flip_as_often_as_torchvision_does():
    """All 9 x 9 offsets x 2 flips of a known 8x8 image are distinct outputs; 20 draws per outcome on average from
    the batched draw and from torchvision's per-image transforms, each read back by its output image, both
    uniform: chi-square on 161 degrees of freedom (mean 161, sd 18) under 250 for both."""
    transforms = pytest.importorskip("torchvision.transforms")
    img = known_image()
    grid = torch.tensor([(r, c) for r in range(2 * PAD + 1) for c in range(2 * PAD + 1)])
    outcomes = torch.cat([crop_flip(img.expand(len(grid), -1, -1, -1), grid, torch.full((len(grid),), f))
                          for f in (False, True)])
    index = {out.numpy().tobytes(): i for i, out in enumerate(outcomes)}
    assert len(index) == 2 * len(grid)
    draws = 20 * len(index)
    batched = crop_flip(img.expand(draws, -1, -1, -1), *crop_flip_params(draws, torch.Generator().manual_seed(1)))
    host = transforms.Compose([transforms.RandomCrop(8, padding=PAD), transforms.RandomHorizontalFlip()])
    torch.manual_seed(2)
    per_image = torch.stack([host(img) for _ in range(draws)])
    for outputs in (batched, per_image):
        counts = np.bincount([index[o.numpy().tobytes()] for o in outputs], minlength=len(index))
        assert counts.min() > 0 and _chi_square(counts) < 250


# --- client training ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("augment", ["none", "crop-flip"])
def test_device_held_shards_train_the_same_model_bit_for_bit(augment):
    host, host_stats = trained(FLOAT32, augment)
    held, held_stats = trained(DEVICE_DATA, augment)
    for key, value in host.state_dict().items():
        assert torch.equal(value, held.state_dict()[key]), key
    assert (host_stats.final_loss, host_stats.train_accuracy, host_stats.steps) == \
        (held_stats.final_loss, held_stats.train_accuracy, held_stats.steps)


def test_augmentation_changes_what_the_client_sees_and_leaves_the_batch_order():
    plain, _ = trained(FLOAT32, "none", epochs=1)
    cropped, _ = trained(FLOAT32, "crop-flip", epochs=1)
    assert any(not torch.equal(v, cropped.state_dict()[k]) for k, v in plain.state_dict().items())


def test_bf16_training_step_and_a_trained_models_logits_are_the_float32_ones_within_tolerance():
    """One SGD step from the same init: the loss within BF16_LOSS and the parameter update within BF16_STEP of the
    float32 update; parameters, BN statistics and the optimizer's work stay float32. A trained model's logits
    under autocast: within BF16_LOGITS."""
    data = shard(16)
    cfg = LocalConfig(epochs=1, batch_size=16, lr=0.05)
    runs = {}
    for name, fast in (("fp32", FLOAT32), ("bf16", BF16)):
        model = build("cnn3-bn", (3, 32, 32), 10, seed=0)
        start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
        stats = train_local(model, data, cfg, CPU, torch.Generator().manual_seed(0), fast=fast)
        assert {v.dtype for v in model.state_dict().values()} <= {torch.float32, torch.int64}
        runs[name] = (stats.final_loss, torch.cat([p.detach().flatten() for p in model.parameters()]) - start, model)
    assert runs["bf16"][0] == pytest.approx(runs["fp32"][0], rel=BF16_LOSS)
    step_fp32, step_bf16 = runs["fp32"][1], runs["bf16"][1]
    assert float((step_bf16 - step_fp32).norm()) <= BF16_STEP * float(step_fp32.norm())
    model = runs["fp32"][2].eval()
    x = to_tensor(shard(32, seed=1).images)
    with torch.no_grad():
        ref = model(x)
        with BF16.autocast(CPU):
            low = model(x)
    assert low.dtype == torch.bfloat16
    assert float((low.float() - ref).abs().max()) <= BF16_LOGITS * float(ref.abs().max())


def test_a_non_finite_loss_stops_local_training_with_its_epoch():
    model = build("cnn2", (1, 28, 28), 10, seed=0)
    with torch.no_grad():
        model.state_dict()[next(iter(model.state_dict()))].fill_(float("nan"))
    data = shard(8, size=28, channels=1)
    with pytest.raises(FloatingPointError, match="non-finite training loss at epoch 1"):
        train_local(model, data, LocalConfig(epochs=2, batch_size=4), CPU, torch.Generator().manual_seed(0),
                    fast=DEVICE_DATA)


# --- the server: teachers, synthesis, KD ---------------------------------------------------------------------


def teachers(vectorize):
    models = [build("cnn2", (3, 32, 32), 10, seed=s) for s in range(3)]
    for model in models:  # BN statistics away from init, so the BN loss is not ~0
        model.train()
        with torch.no_grad():
            model(torch.rand(32, 3, 32, 32, generator=torch.Generator().manual_seed(5)))
    return ClientEnsemble(models, ["cnn2"] * 3, vectorize=vectorize)


def test_stacked_teachers_under_bf16_give_the_float32_loops_logits_and_bn_loss_within_tolerance():
    x = torch.rand(8, 3, 32, 32, generator=torch.Generator().manual_seed(3))
    loop = Teacher(teachers(False), MeanLogits())
    ref, ref_bn, _ = loop(x)
    stacked = Teacher(teachers(True), MeanLogits())
    with BF16.autocast(CPU):
        out, bn, per_client = stacked(x)
    assert per_client.dtype == torch.bfloat16 and per_client.shape == (3, 8, 10)
    assert out.dtype == torch.float32 and bn.dtype == torch.float32  # aggregation and BN statistics in float32
    assert float((out - ref).abs().max()) <= BF16_LOGITS * float(ref.abs().max())
    assert float(bn) == pytest.approx(float(ref_bn), rel=BF16_LOSS)


def test_a_mixed_fleet_under_bf16_gives_one_logits_tensor_and_a_float32_teacher():
    models = [build(arch, (3, 32, 32), 10, seed=i) for i, arch in enumerate(("cnn2", "lenet", "cnn2"))]
    x = torch.rand(4, 3, 32, 32, generator=torch.Generator().manual_seed(6))
    ref, _, _ = Teacher(ClientEnsemble(models, ["cnn2", "lenet", "cnn2"], vectorize=True), MeanLogits())(x)
    with BF16.autocast(CPU):
        out, bn, per_client = Teacher(ClientEnsemble(models, ["cnn2", "lenet", "cnn2"], vectorize=True),
                                      MeanLogits())(x)
    assert per_client.shape == (3, 4, 10) and out.dtype == torch.float32 and bn.dtype == torch.float32
    assert float((out - ref).abs().max()) <= BF16_LOGITS * float(ref.abs().max())


def synthesizer(fast, steps=1):
    student = build("cnn2", (3, 32, 32), 10, seed=9)
    return GeneratorSynthesizer(Teacher(teachers(False), MeanLogits()), student, GeneratorSpec(16, 8, 32, 3),
                                GeneratorLoss(), 10, 8, steps, 1e-3, 0, CPU, fast=fast)


def test_a_bf16_generator_step_reports_the_float32_losses_within_tolerance():
    ref = synthesizer(FLOAT32).synthesize()
    out = synthesizer(BF16).synthesize()
    assert out.teacher_logits.dtype == torch.float32 and out.images.dtype == torch.float32
    for term in ("ce", "bn", "total"):
        assert out.losses[term] == pytest.approx(ref.losses[term], rel=BF16_LOSS), term
    assert out.losses["adv"] == pytest.approx(ref.losses["adv"], abs=BF16_LOSS * abs(ref.losses["total"]))
    assert float((out.images - ref.images).abs().max()) < 0.05  # generator outputs in [0, 1]


def kd_epoch(fast, pool_device="cpu"):
    g = torch.Generator().manual_seed(4)
    images, logits = torch.rand(16, 3, 32, 32, generator=g).half().float(), 3 * torch.randn(16, 10, generator=g)
    student = build("cnn2", (3, 32, 32), 10, seed=1)
    start = {k: v.clone() for k, v in student.state_dict().items()}
    pool = SyntheticPool("paper", 1, 1, 16, device=pool_device)
    history, _ = distill(student, FixedSource(images, logits), pool, DistillSettings(epochs=1, lr=0.01, eval_every=1),
                         lambda m: 0.0, seed=0, fast=fast)
    return history[0]["kd_loss"], student, start, images, logits


def test_one_bf16_kd_step_has_the_float32_loss_within_tolerance_and_the_float32_one_is_kd_loss():
    ref, _, start, images, logits = kd_epoch(FLOAT32)
    fresh = build("cnn2", (3, 32, 32), 10, seed=1)
    fresh.load_state_dict(start)
    fresh.train()
    assert ref == float(kd_loss(fresh(images), logits).detach())  # the recorded loss is the step's KD loss, to the bit
    low, student, _, _, _ = kd_epoch(BF16)
    assert low == pytest.approx(ref, rel=BF16_LOSS)
    assert all(p.dtype == torch.float32 for p in student.parameters())


def test_a_pool_keeps_its_batches_on_its_device_and_brings_a_checkpoints_there():
    pool = SyntheticPool("capped", 4, 2, 2, device="meta")
    pool.add(torch.rand(2, 3, 4, 4), torch.tensor([0, 1]), torch.rand(2, 10))
    assert {t.device.type for t in pool.images + pool.labels + pool.logits} == {"meta"}
    cpu = SyntheticPool("capped", 4, 2, 2)
    cpu.add(torch.rand(2, 3, 4, 4), torch.tensor([0, 1]), torch.rand(2, 10))
    pool.load_state_dict(cpu.state_dict())
    assert pool.images[0].device.type == "meta" and pool.images[0].dtype == torch.float16


# --- no host synchronisation per step -------------------------------------------------------------------------


class SyncCounter:
    """Counts the calls that make a GPU program wait for the device (item, float(), bool(), int(), tolist, cpu)
    made from oneshot_fl's own code (torch's optimizers read CPU step counters; those never wait for a GPU)."""

    NAMES = ("item", "__float__", "__bool__", "__int__", "tolist", "cpu")

    def __init__(self, monkeypatch):
        self.calls = 0
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._wrap(original))

    def _wrap(self, original):
        def counted(tensor, *args, **kwargs):
            if "oneshot_fl" in sys._getframe(1).f_code.co_filename:
                self.calls += 1
            return original(tensor, *args, **kwargs)
        return counted


def _syncs(monkeypatch, run) -> int:
    counter = SyncCounter(monkeypatch)
    run()
    monkeypatch.undo()
    return counter.calls


def test_client_sgd_waits_for_the_device_once_per_epoch_not_once_per_step(monkeypatch):
    def run(n):
        return lambda: train_local(build("lenet", (3, 32, 32), 10, seed=0), shard(n),
                                   LocalConfig(epochs=1, batch_size=4, augment="crop-flip"), CPU,
                                   torch.Generator().manual_seed(0), fast=FastPath(True, True, True))

    assert _syncs(monkeypatch, run(8)) == _syncs(monkeypatch, run(32))  # 2 steps and 8 steps


def test_synthesis_and_kd_wait_for_the_device_once_per_epoch_not_once_per_step(monkeypatch):
    assert _syncs(monkeypatch, lambda: synthesizer(BF16, steps=2).synthesize()) == \
        _syncs(monkeypatch, lambda: synthesizer(BF16, steps=6).synthesize())

    def kd(steps):
        def run():
            student = nn.Sequential(nn.Flatten(), nn.Linear(12, 10))
            pool = SyntheticPool("capped", 4, steps, 4)
            source = FixedSource(torch.rand(8, 3, 2, 2), torch.randn(8, 10))
            distill(student, source, pool, DistillSettings(epochs=1, lr=0.01), lambda m: 0.0, seed=0, fast=BF16)
        return run

    assert _syncs(monkeypatch, kd(2)) == _syncs(monkeypatch, kd(7))


def test_a_checkpoint_epoch_writes_only_once_the_minimum_interval_has_passed(tmp_path):
    """The fast path's distillation checkpoints at most once a minute (strategies/datafree.py); 0 = every
    checkpoint epoch, as the float32 path does."""
    from oneshot_fl.engine.distill import Checkpoint

    def run(interval, name):
        student = nn.Sequential(nn.Flatten(), nn.Linear(12, 10))
        checkpoint = Checkpoint(tmp_path / name, "fingerprint")
        settings = DistillSettings(epochs=3, lr=0.01, checkpoint_every=1, checkpoint_min_interval=interval)
        distill(student, FixedSource(torch.rand(4, 3, 2, 2), torch.randn(4, 10)), SyntheticPool("paper", 1, 1, 4),
                settings, lambda m: 0.0, seed=0, checkpoint=checkpoint)
        return checkpoint.path.is_file()

    assert run(0.0, "every.pt") and not run(3_600.0, "hourly.pt")
