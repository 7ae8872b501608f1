"""The upload validator's accepted values and exact reasons: every field of a decoded Upload, the
bounds that are inclusive, and the reason strings a client operator reads in the server log."""

import io

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord

import oneshot_fl.uploads as uploads
from oneshot_fl.models.registry import build
from oneshot_fl.uploads import (MAX_ABS_WEIGHT, REASON_LIMIT, Expectation, InvalidUpload, UploadRole, decode_and_check,
                                encode, received_bytes)

SHAPE = (1, 28, 28)


def content_for(counts=(1, 2, 3, 4, 5, 6, 7, 8, 9, 10), metrics=None, extra=None, state=None):
    state = build("cnn2", SHAPE, 10, seed=0).state_dict() if state is None else state
    return encode("classifier", "cnn2", state, np.array(counts), 3,
                  {"local-test-accuracy": 0.5} if metrics is None else metrics, extra=extra)


def reason(content, **kw):
    with pytest.raises(InvalidUpload) as err:
        decode_and_check(content, node_id=42, num_classes=10, input_shape=SHAPE, **kw)
    assert err.value.node_id == 42
    return err.value.reason


def test_every_field_of_a_decoded_upload():
    state = build("cnn2", SHAPE, 10, seed=0).state_dict()
    content = content_for(extra={"note": "kept"}, state=state)
    up = decode_and_check(content, node_id=42, num_classes=10, input_shape=SHAPE)
    assert (up.node_id, up.partition_id, up.role, up.arch) == (42, 3, "classifier", "cnn2")
    assert up.label_counts.dtype == np.int64 and up.label_counts.tolist() == list(range(1, 11))
    assert up.num_examples == 55
    assert up.metrics == {"local-test-accuracy": 0.5, "num-examples": 55.0}
    assert up.extra == {"note": "kept"}  # meta keys beyond the format's own
    assert up.received_bytes == received_bytes(content)
    floats = sum(t.numel() for t in state.values() if t.is_floating_point())
    ints = sum(t.numel() for t in state.values() if not t.is_floating_point())
    assert ints > 0 and up.raw_bytes == 4 * floats + 8 * ints
    for key, tensor in state.items():  # BN's num_batches_tracked stays an integer tensor
        assert up.state[key].dtype == (torch.float32 if tensor.is_floating_point() else torch.int64), key


@pytest.mark.parametrize("accuracy", [0.0, 1.0])
def test_accuracy_bounds_are_inclusive(accuracy):
    up = decode_and_check(content_for(metrics={"local-test-accuracy": accuracy}), 1, 10, SHAPE)
    assert up.metrics["local-test-accuracy"] == accuracy


@pytest.mark.parametrize("accuracy", [-0.01, 1.01])
def test_accuracy_outside_the_unit_interval_is_refused(accuracy):
    assert reason(content_for(metrics={"local-test-accuracy": accuracy})) == \
        f"local-test-accuracy {accuracy!r} outside [0, 1]"


def test_a_weight_of_exactly_the_bound_passes_and_just_above_does_not():
    state = build("cnn2", SHAPE, 10, seed=0).state_dict()
    state["classifier.bias"][0] = MAX_ABS_WEIGHT
    decode_and_check(content_for(state=state), 1, 10, SHAPE)
    state["classifier.bias"][0] = 2 * MAX_ABS_WEIGHT
    assert reason(content_for(state=state)) == \
        f"tensor 'classifier.bias' holds |w| = {2 * MAX_ABS_WEIGHT:.3g}, above the bound {MAX_ABS_WEIGHT:g}"


def test_label_count_totals_of_one_and_of_exactly_the_training_set_pass():
    one = [1] + [0] * 9
    assert decode_and_check(content_for(counts=one, metrics={}), 1, 10, SHAPE).num_examples == 1
    up = decode_and_check(content_for(), 1, 10, SHAPE, expect=Expectation(max_examples=55))
    assert up.num_examples == 55
    assert reason(content_for(), expect=Expectation(max_examples=54)) == \
        "label counts sum to 55, more than the 54 examples of the training set"


def replace_counts(content, counts):
    content.array_records["label-counts"] = ArrayRecord({"counts": Array(counts)})
    return content


def test_label_count_reasons():
    assert reason(replace_counts(content_for(), np.full(10, -1, dtype=np.int64))) == \
        "label counts contain negative values"
    assert reason(replace_counts(content_for(), np.full(10, 2**63, dtype=np.uint64))) == \
        "label counts exceed the int64 range"
    assert reason(replace_counts(content_for(), np.zeros(10, dtype=np.int64))) == "label counts are all zero"
    assert reason(replace_counts(content_for(), np.ones(10, dtype=np.float32))) == \
        "label counts have dtype float32, expected integers"
    missing = content_for()
    del missing["label-counts"]
    assert reason(missing) == "missing label counts"


def test_meta_reasons():
    content = content_for()
    del content.config_records["meta"]["partition-id"]
    assert reason(content) == "missing partition-id"
    content = content_for()
    content["zz"] = ConfigRecord({"a": 1})
    content["aa"] = ConfigRecord({"a": 1})
    assert reason(content) == "unexpected record(s) aa, zz"
    assert reason(content_for(), roles=("decoder", "other")) == \
        "role 'classifier' not accepted by this method (accepts: decoder, other)"
    content = content_for()
    content.config_records["meta"]["arch"] = "nope"
    known = ", ".join(uploads.UPLOAD_ROLES["classifier"].architectures())
    assert reason(content) == f"unknown architecture 'nope' for role classifier (known: {known})"
    content = content_for()
    content.config_records["meta"]["partition-id"] = 9
    assert reason(content, expect=Expectation(num_partitions=5)) == "partition-id 9 out of range [0, 5)"
    content.config_records["meta"]["partition-id"] = -1
    assert reason(content) == "partition-id -1 out of range >= 0"


def test_assigned_architecture_is_asked_per_role_and_partition():
    asked = []

    def archs(role, partition_id):
        asked.append((role, partition_id))
        return {"lenet", "cnn3"}
    assert reason(content_for(), expect=Expectation(archs=archs)) == \
        "architecture 'cnn2' was not assigned to partition 3 in this run (assigned: cnn3, lenet)"
    assert asked == [("classifier", 3)]


def test_layout_and_packed_array_reasons():
    content = content_for()
    layout = list(content.config_records["meta"]["layout"])
    key, dims, _ = layout[0].split("|")
    content.config_records["meta"]["layout"] = [f"{key}|{dims}|i"] + layout[1:]
    assert reason(content) == f"tensor {key!r} is integer, cnn2 expects torch.float32"
    content = content_for()
    keys = list(build("cnn2", SHAPE, 10, seed=0).state_dict())
    assert len(keys) > 5
    content.config_records["meta"]["layout"] = [f"x{i}|1|f" for i in range(7)]
    assert reason(content) == (f"cnn2 tensors do not match: missing {keys[:5]}, unexpected "
                               f"{['x0', 'x1', 'x2', 'x3', 'x4']}")  # the first five of each
    content = content_for()
    content.config_records["meta"]["layout"] = [1, 2]
    assert reason(content) == "missing or malformed tensor layout"
    content = content_for()
    content.array_records["model"]["values"] = Array(np.zeros(3, dtype=np.float32))
    floats = sum(t.numel() for t in build("cnn2", SHAPE, 10, seed=0).state_dict().values() if t.is_floating_point())
    assert reason(content) == f"packed array 'values' holds 3 values, cnn2 has {floats}"
    content = content_for()
    content.array_records["model"]["values"] = Array(np.zeros(3, dtype=np.float64))
    assert reason(content) == "packed array 'values' has dtype float64, expected float32 or float16"


def test_a_zero_sized_dimension_is_a_well_formed_layout_entry():
    meta = ConfigRecord({"layout": ["w|0,3|f", "b||f"]})
    assert uploads._layout(meta) == [("w", (0, 3), "f"), ("b", (), "f")]


def npy_bytes(array, version):
    buffer = io.BytesIO()
    np.lib.format.write_array(buffer, array, version=version, allow_pickle=True)
    return buffer.getvalue()


def test_npy_versions_one_and_two_are_read_three_and_objects_are_not():
    data = np.arange(4, dtype=np.int64)
    for version in ((1, 0), (2, 0)):
        arr = Array(dtype="int64", shape=(4,), stype="numpy.ndarray", data=npy_bytes(data, version))
        assert uploads._npy(arr, "x").tolist() == [0, 1, 2, 3]
    arr = Array(dtype="int64", shape=(4,), stype="numpy.ndarray", data=npy_bytes(data, (3, 0)))
    with pytest.raises(uploads._Bad, match=r"^x cannot be read: ValueError: unsupported .npy version \(3, 0\)$"):
        uploads._npy(arr, "x")
    obj = Array(dtype="object", shape=(1,), stype="numpy.ndarray", data=npy_bytes(np.array([{}], dtype=object), (1, 0)))
    with pytest.raises(uploads._Bad, match=r"^x cannot be read: ValueError: object arrays are not accepted$"):
        uploads._npy(obj, "x")
    short = Array(dtype="int64", shape=(4,), stype="numpy.ndarray", data=npy_bytes(data, (1, 0))[:-8])
    with pytest.raises(uploads._Bad, match=r"^x cannot be read: ValueError: header says \(4,\) int64, payload holds "
                                           r"24 bytes$"):
        uploads._npy(short, "x")


def test_unreadable_content_keeps_the_node_and_names_the_error():
    with pytest.raises(InvalidUpload) as err:
        decode_and_check(None, node_id=7, num_classes=10, input_shape=SHAPE)
    assert err.value.node_id == 7
    assert err.value.reason.startswith("unreadable upload (AttributeError: ")
    assert str(err.value) == f"node 7: {err.value.reason}"


def test_reasons_are_clipped_at_the_limit():
    assert uploads._clip("x" * REASON_LIMIT) == "x" * REASON_LIMIT
    assert uploads._clip("x" * (REASON_LIMIT + 1)) == "x" * REASON_LIMIT + "..."


def test_registered_roles_are_found_by_name():
    role = UploadRole("test-role", "test", lambda: ["cnn2"], uploads.expected_state)
    try:
        uploads.register_role(role)
        assert uploads.UPLOAD_ROLES["test-role"] is role
    finally:
        uploads.UPLOAD_ROLES.pop("test-role", None)


def test_a_roles_own_settings_are_read_from_the_extra_meta_keys_and_reach_its_layout():
    seen = []

    def settings(extra):
        if "width" not in extra:
            raise ValueError("width missing")
        return {"width": int(extra["width"])}

    def expected(arch, input_shape, num_classes, width):
        seen.append(width)
        return uploads.expected_state(arch, input_shape, num_classes)
    role = UploadRole("test-role", "test", lambda: ["cnn2"], expected, settings)
    state = build("cnn2", SHAPE, 10, seed=0).state_dict()
    try:
        uploads.register_role(role)
        good = encode("test-role", "cnn2", state, np.ones(10), 0, {}, extra={"width": 3})
        up = decode_and_check(good, 1, 10, SHAPE, roles=("test-role",))
        assert seen == [3] and up.extra == {"width": 3} and up.role == "test-role"
        bad = encode("test-role", "cnn2", state, np.ones(10), 0, {})
        assert reason(bad, roles=("test-role",)) == "width missing"
    finally:
        uploads.UPLOAD_ROLES.pop("test-role", None)


def test_a_zero_bn_running_variance_is_accepted_and_a_negative_one_is_not():
    state = build("cnn2", SHAPE, 10, seed=0).state_dict()
    key = next(k for k in state if k.endswith("running_var"))
    state[key][0] = 0.0  # a channel that never varied: legitimate
    decode_and_check(content_for(state=state), 1, 10, SHAPE)
    state[key][0] = -0.5
    assert reason(content_for(state=state)) == f"tensor {key!r} holds a negative BN running variance (-0.5)"


def test_a_count_of_exactly_the_int64_maximum_is_judged_by_the_training_set_size():
    counts = np.zeros(10, dtype=np.int64)
    counts[0] = np.iinfo(np.int64).max
    assert reason(replace_counts(content_for(), counts)) == \
        f"label counts sum to {np.iinfo(np.int64).max}, more than the 1000000000 examples of the training set"
