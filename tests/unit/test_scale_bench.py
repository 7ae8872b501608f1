"""The scale benchmark's measuring code on tiny sizes: record fields and the batched / sequential
Model Stratification agreement (no timing assertions: timings belong to benchmarks/results)."""

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
    assert record["seconds_sequential"] > 0 and record["seconds_batched"] > 0
    assert record["max_abs_dloss"] <= 1e-4 and record["max_abs_du"] <= 1e-4


def test_stacked_teachers_equal_the_loop():
    torch.manual_seed(0)
    metrics = teacher_times(m=3, batch=4, repeats=1)
    assert metrics["max_abs_dlogits"] <= 1e-5
    assert {"us_per_sample_loop", "us_per_sample_stacked", "speedup_forward", "speedup_fwd_bwd"} <= set(metrics)


def test_distillation_never_recomputes_pool_teacher_logits():
    metrics = pool_teacher_calls(m=2, epochs=2, steps=2, kd_steps=3)
    assert metrics["teacher_calls"] == metrics["generator_steps"]
    assert metrics["kd_steps"] > 0 and metrics["teacher_calls_per_kd_step"] == 0
