"""Property tests of the upload validator (issue 13): whatever a client mutates in a valid upload
(bytes, shapes, dtypes, counts, ids, metadata), the server gets a well-formed Upload or an
InvalidUpload with a reason; never any other exception."""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest
import torch
from flwr.app import Array, ConfigRecord

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from oneshot_fl.models.registry import build  # noqa: E402
from oneshot_fl.uploads import Expectation, InvalidUpload, Upload, decode_and_check, encode  # noqa: E402

SHAPE = (1, 28, 28)
EXPECT = Expectation(num_partitions=5, max_examples=60_000, archs=lambda role, pid: {"cnn2", "lenet"})
# modest and database-free: fast in the default suite, and no .hypothesis/ folder in the checkout
PROPERTY = settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@lru_cache(maxsize=2)
def _state(arch: str) -> dict[str, torch.Tensor]:
    return build(arch, SHAPE, 10, seed=0).state_dict()


def fresh(arch="cnn2", counts=None, partition=2):
    counts = np.arange(1, 11) if counts is None else counts
    return encode("classifier", arch, _state(arch), counts, partition, {"local-test-accuracy": 0.5})


def outcome(content):
    """The validator's answer, asserting it is one of the two allowed shapes."""
    try:
        up = decode_and_check(content, node_id=7, num_classes=10, input_shape=SHAPE, expect=EXPECT)
    except InvalidUpload as exc:
        assert exc.reason and exc.node_id == 7
        return exc
    assert isinstance(up, Upload)
    assert set(up.state) == set(_state(up.arch))
    assert all(torch.isfinite(t).all() for t in up.state.values() if t.is_floating_point())
    assert up.label_counts.dtype == np.int64 and (up.label_counts >= 0).all()
    assert 0 < up.num_examples == int(up.label_counts.sum()) <= EXPECT.max_examples
    assert 0 <= up.partition_id < EXPECT.num_partitions
    return up


DTYPES = st.sampled_from(["int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64",
                          "bool", "complex64"])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=20), st.binary(max_size=20), st.lists(st.integers(-5, 5), max_size=4))


@PROPERTY
@given(data=st.binary(max_size=300), target=st.sampled_from(["values", "buffers", "counts"]),
       keep_header=st.booleans())
def test_arbitrary_bytes_in_any_payload(data, target, keep_header):
    content = fresh()
    record = content.array_records["label-counts" if target == "counts" else "model"]
    name = "counts" if target == "counts" else target
    old = record[name]
    payload = old.data[:128] + data if keep_header else data  # a valid .npy header, then junk
    record[name] = Array(dtype=old.dtype, shape=tuple(old.shape), stype=old.stype, data=payload)
    outcome(content)


@PROPERTY
@given(dtype=DTYPES, shape=st.lists(st.integers(0, 12), max_size=3),
       target=st.sampled_from(["values", "buffers", "counts"]), seed=st.integers(0, 2**16))
def test_arbitrary_dtypes_and_shapes(dtype, shape, target, seed):
    rng = np.random.default_rng(seed)
    array = (rng.standard_normal(shape) * 1e3).astype(dtype) if dtype != "bool" else rng.random(shape) > 0.5
    content = fresh()
    if target == "counts":
        content.array_records["label-counts"]["counts"] = Array(np.asarray(array))
    else:
        content.array_records["model"][target] = Array(np.asarray(array))
    outcome(content)


@PROPERTY
@given(counts=st.lists(st.integers(-2**63, 2**64 - 1), min_size=0, max_size=12),
       dtype=st.sampled_from(["int64", "uint64"]), claimed=st.one_of(st.none(), st.integers(-5, 2**62)))
def test_arbitrary_label_counts(counts, dtype, claimed):
    content = fresh()
    low = 0 if dtype == "uint64" else -2**63  # fold the drawn values into the dtype's range
    array = np.array([(c - low) % 2**64 + low for c in counts], dtype=dtype)
    content.array_records["label-counts"]["counts"] = Array(array)
    if claimed is not None:
        content.metric_records["metrics"]["num-examples"] = claimed
    else:
        total = sum(int(c) for c in array)
        if -2**63 <= total < 2**63:
            content.metric_records["metrics"]["num-examples"] = total
    up = outcome(content)
    if isinstance(up, Upload):
        assert [int(c) for c in up.label_counts] == [int(c) for c in array]


@PROPERTY
@given(key=st.sampled_from(["partition-id", "arch", "role", "format", "layout", "latent-dim", "junk"]),
       value=scalars)
def test_arbitrary_meta_values(key, value):
    content = fresh()
    if value is None:
        if key in content.config_records["meta"]:
            del content.config_records["meta"][key]
    else:
        try:
            content.config_records["meta"][key] = value
        except (TypeError, ValueError):
            return  # Flower's ConfigRecord refuses the type itself: it could never be sent
    outcome(content)


@PROPERTY
@given(key=st.sampled_from(["num-examples", "local-test-accuracy", "train-seconds", "x"]),
       value=st.one_of(st.integers(-2**63, 2**63 - 1), st.floats(allow_nan=True, allow_infinity=True),
                       st.lists(st.floats(allow_nan=True), max_size=3)))
def test_arbitrary_metric_values(key, value):
    content = fresh()
    try:
        content.metric_records["metrics"][key] = value
    except (TypeError, ValueError):
        return
    up = outcome(content)
    if isinstance(up, Upload):
        assert all(np.isfinite(v) for v in up.metrics.values())


@PROPERTY
@given(permutation=st.permutations(range(len(_state("cnn2")))), drop=st.integers(-1, 9),
       entry_edit=st.one_of(st.none(), st.text(max_size=30)))
def test_arbitrary_layouts(permutation, drop, entry_edit):
    keys = list(_state("cnn2"))
    state = {keys[i]: _state("cnn2")[keys[i]] for i in permutation}
    content = encode("classifier", "cnn2", state, np.arange(1, 11), 1, {})
    layout = list(content.config_records["meta"]["layout"])
    if 0 <= drop < len(layout):
        if entry_edit is None:
            del layout[drop]
        else:
            layout[drop] = entry_edit
    content.config_records["meta"]["layout"] = layout
    up = outcome(content)
    if isinstance(up, Upload) and drop < 0:
        assert all(torch.equal(up.state[k], v) for k, v in _state("cnn2").items())


@PROPERTY
@given(extra_records=st.lists(st.sampled_from(["meta", "metrics", "model", "label-counts", "other"]), max_size=3),
       arch=st.sampled_from(["cnn2", "lenet"]))
def test_arbitrary_missing_or_extra_records(extra_records, arch):
    content = fresh(arch=arch)
    for name in extra_records:
        if name == "other":
            content["other"] = ConfigRecord({"x": 1})
        elif name in content:
            del content[name]
    outcome(content)
