"""benchmarks.teacher_sharpness: the statistics of one teacher's logits, by hand."""

import math

import pytest
import torch

from benchmarks.teacher_sharpness import teacher_stats


def test_teacher_stats_by_hand():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    labels = torch.tensor([1, 0])  # the first row's argmax is class 0: one of two right
    s = teacher_stats(logits, labels, temperature=1.0)
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert s["accuracy"] == pytest.approx(0.5)
    assert s["entropy"] == pytest.approx((math.log(2.0) + h) / 2)
    assert s["top_probability"] == pytest.approx((0.5 + 0.75) / 2)
    assert s["logit_spread"] == pytest.approx((0.0 + math.log(3.0) / math.sqrt(2.0)) / 2)
    # temperature 0.5 doubles the logits: the second row becomes 9:1
    sharp = teacher_stats(logits, labels, temperature=0.5)
    assert sharp["top_probability"] == pytest.approx((0.5 + 0.9) / 2)
    assert sharp["accuracy"] == s["accuracy"] and sharp["logit_spread"] == s["logit_spread"]
