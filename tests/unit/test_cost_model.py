"""benchmarks.cost_model: the counts of the paper preset, the extrapolation and the H100 estimate against
hand-computed values, and one real measurement of every stage on the CPU at toy sizes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import cost_model
from benchmarks.cost_model import H100_BF16_PEAK, Sizes, Stage, paper_preset, paper_sizes, stage_counts, summarise
from oneshot_fl.fastpath import FLOAT32
from oneshot_fl.models.registry import build


def test_the_paper_presets_counts_and_sizes():
    preset, sizes = paper_preset(), paper_sizes()
    assert (preset.local_epochs, preset.distill_epochs, preset.generator_steps, preset.kd_steps) == (200, 200, 30, 200)
    assert (sizes.local_batch, sizes.synth_batch, sizes.ms_batch, sizes.eval_images) == (128, 256, 16, 10_000)
    counts = stage_counts(["resnet18"] * 5, preset, sizes)
    assert counts["local"] == {"clients": 200 * 79}  # 10,000 images a client: 78 full batches and one of 16
    assert counts["generator"] == {"dense": 6_000, "fedhydra": 6_000}
    assert counts["kd"] == {"dense": 40_000, "fedhydra": 40_000}
    assert counts["ms"] == {"fedhydra": 30}
    assert counts["evaluation"] == {"dense": 2_000_000, "fedhydra": 2_000_000}  # test images x 200 evaluations
    assert counts["checkpoint"] == {"dense": 199, "fedhydra": 199}


def test_a_stage_measured_at_a_smaller_batch_scales_its_flops_and_time_by_the_batch_ratio():
    stage = Stage("kd", "", measured_batch=4, paper_batch=256, seconds=0.5, flops=1e9, steps={"dense": 10})
    assert stage.scale == 64 and stage.paper_flops == 64e9 and stage.here_seconds() == 32.0
    per_image = Stage("evaluation", "", None, None, seconds=0.001, flops=2e6, steps={"dense": 100})
    assert per_image.scale == 1.0 and per_image.here_seconds() == 0.001


def stages():
    return [Stage("local[a]", "", 2, 4, seconds=1.0, flops=2e12, steps={"clients": 100}),
            Stage("kd", "", 4, 4, seconds=0.5, flops=1e12, steps={"dense": 300, "fedhydra": 300}),
            Stage("ms", "", 2, 2, seconds=2.0, flops=5e12, steps={"fedhydra": 10}),
            Stage("checkpoint", "", None, None, seconds=3.0, flops=0.0, steps={"dense": 9, "fedhydra": 9})]


def test_summary_adds_parts_names_the_bottleneck_and_the_goals_distance():
    """By hand, utilisation 0.5 (rate = 0.5 x peak): local 100 x 4e12 = 4e14 FLOPs, 100 x 2 s here; kd 3e14 FLOPs
    and 150 s per method; ms 5e13 FLOPs, 20 s; checkpoints on the float32 path: 9 x 3 s per method."""
    out = summarise(stages(), 0.5, measured_at_paper_size=False, fast_on=False)
    rate = 0.5 * H100_BF16_PEAK
    parts = out["parts"]
    assert parts["clients"]["flops"] == pytest.approx(4e14) and parts["clients"]["here_s"] == pytest.approx(200)
    assert parts["dense"]["here_s"] == pytest.approx(150 + 27)
    assert parts["fedhydra"]["here_s"] == pytest.approx(150 + 20 + 27)
    assert parts["fedhydra"]["flops"] == pytest.approx(3e14 + 5e13)
    checkpoint = next(r for r in out["stages"] if r["name"] == "checkpoint")
    # an H100 runs the fast path: one checkpoint a minute of the method's time (3e14 / rate s: 1 of them)
    assert checkpoint["h100_steps"] == {"dense": math.ceil(3e14 / rate / 60), "fedhydra": math.ceil(3.5e14 / rate / 60)}
    h100 = (4e14 + 2 * 3e14 + 5e13) / rate + 3.0 * sum(checkpoint["h100_steps"].values())
    assert out["total"]["h100_s"] == pytest.approx(h100)
    assert out["goal"]["ratio"] == pytest.approx(h100 / 600)
    assert out["goal"]["utilisation_needed"] == pytest.approx((4e14 + 6e14 + 5e13) / (600 * H100_BF16_PEAK))
    assert out["bottleneck"] == {"stage": "kd", "share": pytest.approx(6e14 / 1.05e15), "by": "flops"}
    # measured at the preset's size (a GPU), the bottleneck is the stage with the most time
    timed = summarise(stages(), 0.5, measured_at_paper_size=True, fast_on=True)
    assert timed["bottleneck"]["stage"] == "kd" and timed["bottleneck"]["by"] == "here_s"
    fast_checkpoint = next(r for r in timed["stages"] if r["name"] == "checkpoint")
    assert fast_checkpoint["steps"] == {"dense": math.ceil(150 / 60), "fedhydra": math.ceil(170 / 60)}


def test_every_stage_is_measured_on_the_cpu_and_a_client_step_counts_one_sgd_steps_flops():
    sizes = Sizes(local_batch=2, synth_batch=2, ms_batch=2, eval_images=4, eval_batch=2, pool_batches=2)
    stages = cost_model.measure_fleet(["lenet", "lenet"], "lenet", torch.device("cpu"), sizes, 1, FLOAT32)
    names = [s.name for s in stages]
    assert names == ["local[lenet]", "generator", "kd", "ms", "evaluation", "teachers", "checkpoint"]
    assert all(s.seconds > 0 for s in stages)
    assert all(s.flops > 0 for s in stages if s.name != "checkpoint")
    with torch.device("meta"):
        model, x = build("lenet", (3, 32, 32), 10), torch.empty(2, 3, 32, 32)
    counter = FlopCounterMode(display=False)
    with counter:
        F.cross_entropy(model(x), torch.zeros(2, dtype=torch.long, device="meta")).backward()
    assert stages[0].flops == counter.get_total_flops()  # one forward + backward at batch 2: one step's
    local = stages[0]
    assert local.steps == {"clients": 2 * 200 * math.ceil(25_000 / 128)} and local.scale == 64
