"""The scale benchmark's measuring code on tiny sizes: record fields and the batched / sequential
Model Stratification agreement (no timing assertions: timings belong to benchmarks/results)."""

import pytest
import torch

from benchmarks.scale import (SIZES, compare_stratification, make_record, pool_teacher_calls,
                              stratify_settings, teacher_times)


def test_stratification_comparison_record_and_u_agreement():
    settings = stratify_settings(SIZES["quick"], m=2, c=3)
    metrics = compare_stratification(settings)
    record = make_record("stratify", "quick", {"m": 2, "c": 3}, metrics)
    for key in ("table", "part", "mode", "settings", "code_version", "machine", "recorded_at",
                "seconds_sequential", "seconds_batched", "speedup", "max_abs_du", "max_abs_du_r", "max_abs_dloss"):
        assert key in record, key
    # the derived fields are computed from the two timings, not typed in
    seq, bat = record["seconds_sequential"], record["seconds_batched"]
    assert record["speedup"] == pytest.approx(seq / bat, rel=1e-9)
    steps = 2 * 3 * settings["steps"]  # m x c x T_G generator steps
    assert record["ms_per_generator_step_sequential"] == pytest.approx(1e3 * seq / steps, rel=1e-9)
    assert record["ms_per_generator_step_batched"] == pytest.approx(1e3 * bat / steps, rel=1e-9)
    assert (record["part"], record["mode"], record["settings"]) == ("stratify", "quick", {"m": 2, "c": 3})
    assert record["max_abs_dloss"] <= 1e-4 and record["max_abs_du"] <= 1e-4


def test_stacked_teachers_equal_the_loop():
    torch.manual_seed(0)
    metrics = teacher_times(m=3, batch=4, repeats=1)
    assert metrics["max_abs_dlogits"] <= 1e-5
    assert {"us_per_sample_loop", "us_per_sample_stacked", "speedup_forward", "speedup_fwd_bwd"} <= set(metrics)


def test_distillation_never_recomputes_pool_teacher_logits():
    metrics = pool_teacher_calls(m=2, epochs=2, steps=2, kd_steps=3)
    assert metrics["teacher_calls"] == metrics["generator_steps"]
    assert metrics["generator_steps"] == 2 * 2  # epochs x generator steps
    assert metrics["kd_steps"] == 2 * 3 and metrics["teacher_calls_per_kd_step"] == 0  # capped pool: kd_steps per epoch
