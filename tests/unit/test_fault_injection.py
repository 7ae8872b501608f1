"""The deployment tests' fault-injection ClientApp (tests/e2e/fault_injection/app.py), called
directly: every corruption mode turns an honest upload into one the server rejects for the reason
the mode is named after, and "hang" never replies."""

from types import SimpleNamespace

import numpy as np
import pytest

from oneshot_fl.models.registry import build
from oneshot_fl.uploads import InvalidUpload, decode_and_check, encode, received_bytes
from tests.e2e.fault_injection import app as fault

SHAPE = (1, 28, 28)


def honest_content():
    model = build("cnn2", SHAPE, 10, seed=0)
    return encode("classifier", "cnn2", model.state_dict(), np.arange(1, 11), 2, {"local-test-accuracy": 0.5})


def reason(content):
    with pytest.raises(InvalidUpload) as info:
        decode_and_check(content, node_id=7, num_classes=10, input_shape=SHAPE)
    return info.value.reason


def test_the_honest_upload_is_accepted():
    assert decode_and_check(honest_content(), 7, 10, SHAPE).arch == "cnn2"


N_VALUES = sum(p.numel() for p in build("cnn2", SHAPE, 10).state_dict().values() if p.is_floating_point())

EXPECTED = {
    "nan": "tensor 'features.0.weight' contains NaN or Inf",  # the first value of the first float tensor
    "counts": "label counts contain negative values",
    "arch": "unknown architecture 'no-such-net' for role classifier",
    "shape": f"packed array 'values' holds {N_VALUES - 1} values, cnn2 has {N_VALUES}",
    "dtype": "packed array 'values' has dtype int32, expected float32 or float16",
    "oversized": "oversized upload",
}


def test_every_corruption_mode_is_covered():
    assert set(fault.CORRUPTIONS) == set(EXPECTED)


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_each_corruption_is_rejected_for_its_own_reason(mode):
    content = honest_content()
    fault.CORRUPTIONS[mode](content)
    assert reason(content).startswith(EXPECTED[mode])


def test_dtype_corruption_keeps_the_bytes_and_changes_only_the_dtype():
    content = honest_content()
    before = fault._values(content)
    fault.CORRUPTIONS["dtype"](content)
    after = fault._values(content)
    assert after.dtype == np.int32 and after.tobytes() == before.tobytes()


def test_oversized_adds_four_mebibytes():
    content = honest_content()
    before = received_bytes(content)
    fault.CORRUPTIONS["oversized"](content)
    assert received_bytes(content) - before >= 4 * 1024 * 1024


def _context(mode):
    return SimpleNamespace(node_config={"corrupt-upload": mode} if mode is not None else {})


@pytest.mark.parametrize("mode", [None, "", "nan", "arch"])
def test_train_wraps_the_honest_reply_and_corrupts_it_only_when_asked(monkeypatch, mode):
    reply = SimpleNamespace(content=honest_content())
    monkeypatch.setattr(fault, "honest_train", lambda msg, ctx: reply)
    out = fault.train("instruction", _context(mode))
    assert out is reply
    if mode:
        assert reason(out.content).startswith(EXPECTED[mode])
    else:
        assert decode_and_check(out.content, 7, 10, SHAPE).arch == "cnn2"


class _Slept(Exception):
    pass


def test_hang_sleeps_a_day_and_never_trains(monkeypatch):
    slept, trained = [], []

    def sleep(seconds):
        slept.append(seconds)
        raise _Slept  # stands for "never returns"

    monkeypatch.setattr(fault.time, "sleep", sleep)
    monkeypatch.setattr(fault, "honest_train", lambda msg, ctx: trained.append(msg))
    with pytest.raises(_Slept):
        fault.train("instruction", _context("hang"))
    assert slept == [24 * 3600] and trained == []
