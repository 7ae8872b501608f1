import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord

from oneshot_fl.models.registry import build
from oneshot_fl.uploads import InvalidUpload, decode_and_check, encode

SHAPE = (1, 28, 28)


def good_content(arch="cnn2", counts=None, **kw):
    model = build(arch, SHAPE, 10, seed=0)
    counts = np.arange(1, 11) if counts is None else counts
    return encode("classifier", arch, model.state_dict(), counts, 3, {"local-test-accuracy": 0.5}, **kw), model


def check(content):
    return decode_and_check(content, node_id=42, num_classes=10, input_shape=SHAPE)


def test_a_good_upload_round_trips_exactly():
    content, model = good_content()
    up = check(content)
    assert up.arch == "cnn2" and up.partition_id == 3 and up.num_examples == 55
    for key, tensor in model.state_dict().items():
        assert torch.equal(up.state[key], tensor), key
    assert up.raw_bytes == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert up.raw_bytes < up.received_bytes <= 1.02 * up.raw_bytes


def test_half_precision_upload_halves_the_float_bytes():
    content, model = good_content(half_precision=True)
    up = check(content)
    assert up.raw_bytes < 0.55 * sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert torch.allclose(up.state["classifier.weight"], model.state_dict()["classifier.weight"], atol=1e-3)


def _meta(content):
    return content.config_records["meta"]


def _with_layout(content, fn):
    layout = list(_meta(content)["layout"])
    _meta(content)["layout"] = fn(layout)
    return content


def _values(content):
    return content.array_records["model"]["values"].numpy().copy()


def _set_values(content, values):
    content.array_records["model"]["values"] = Array(values)
    return content


def poison(value):
    def apply(content):
        values = _values(content)
        values[7] = value
        return _set_values(content, values)
    return apply


BAD = {
    "unknown architecture": lambda c: _meta(c).__setitem__("arch", "transformer") or c,
    "tensors do not match": lambda c: _with_layout(c, lambda layout: layout[:-1]),
    "has shape": lambda c: _with_layout(c, lambda layout: [layout[0].replace("16,1,5,5", "16,1,3,3")] + layout[1:]),
    "NaN or Inf": poison(np.nan),
    "NaN or Inf ": poison(np.inf),
    "has dtype int32": lambda c: _set_values(c, _values(c).astype(np.int32)),
    "oversized upload": lambda c: _set_values(c, _values(c).astype(np.float64)),  # 2x the bytes
    "holds": lambda c: _set_values(c, _values(c)[:-5]),
    "missing label counts": lambda c: c.__delitem__("label-counts") or c,
    "negative": lambda c: c.array_records["label-counts"].__setitem__(
        "counts", Array(np.array([-1, 2, 3, 4, 5, 6, 7, 8, 9, 11]))) or c,
    "label counts have shape": lambda c: c.array_records["label-counts"].__setitem__(
        "counts", Array(np.arange(1, 12))) or c,
    "expected integers": lambda c: c.array_records["label-counts"].__setitem__(
        "counts", Array(np.arange(1, 11).astype(np.float32))) or c,
    "does not equal the label counts": lambda c: c.metric_records["metrics"].__setitem__("num-examples", 7) or c,
    "role": lambda c: _meta(c).__setitem__("role", "spy") or c,
    "upload format": lambda c: _meta(c).__setitem__("format", 99) or c,
    "unexpected record": lambda c: c.__setitem__("extra", ConfigRecord({"x": 1})) or c,
    "unexpected array(s) ['padding']": lambda c: c.__setitem__("model", ArrayRecord({
        **{k: v for k, v in c.array_records["model"].items()},
        "padding": Array(np.zeros(1_000_000, dtype=np.float32))})) or c,
    "oversized": lambda c: _meta(c).__setitem__("padding", "x" * 1_000_000) or c,  # meta extras count too
    "missing record": lambda c: c.__delitem__("metrics") or c,
    "outside [0, 1]": lambda c: c.metric_records["metrics"].__setitem__("local-test-accuracy", 3.0) or c,
    "malformed": lambda c: _meta(c).__setitem__("layout", "not a list") or c,
}


@pytest.mark.parametrize("reason", list(BAD))
def test_each_bad_upload_is_rejected_with_its_reason(reason):
    content, _ = good_content()
    bad = BAD[reason](content)
    with pytest.raises(InvalidUpload) as err:
        check(bad)
    assert reason.strip() in err.value.reason
    assert err.value.node_id == 42


def test_nan_reason_names_the_tensor():
    content, _ = good_content()
    with pytest.raises(InvalidUpload, match="features.0.weight"):
        check(poison(np.nan)(content))


def test_all_zero_label_counts_are_rejected():
    content, _ = good_content(counts=np.zeros(10, dtype=np.int64))
    with pytest.raises(InvalidUpload, match="all zero"):
        check(content)


def test_wrong_input_shape_for_the_run_is_rejected():
    content, _ = good_content()
    with pytest.raises(InvalidUpload, match="shape"):
        decode_and_check(content, 1, 10, (3, 32, 32))


def test_large_models_still_fit_the_size_bound():
    content, _ = good_content(arch="resnet18")
    up = check(content)
    assert up.received_bytes <= 1.001 * up.raw_bytes
