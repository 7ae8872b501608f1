"""Issue 13: hostile or malformed replies. Each one is built from a real `encode` of a real cnn2 on
MNIST's shape and then tampered with; each must end as that node's InvalidUpload naming the
problem, never as any other exception (which would cost the whole round)."""

from __future__ import annotations

import io
from functools import lru_cache

import numpy as np
import pytest
import torch
from flwr.app import Array, ConfigRecord

from oneshot_fl.models.registry import build
from oneshot_fl.uploads import (MAX_ABS_WEIGHT, SIZE_SLACK, SIZE_SLACK_BYTES, Expectation, InvalidUpload,
                                decode_and_check, encode, received_bytes)

SHAPE = (1, 28, 28)
NODE = 42
MNIST_TRAIN = 60_000
EXPECT = Expectation(num_partitions=5, max_examples=MNIST_TRAIN, archs=lambda role, pid: {"cnn2"})
COUNTS = np.arange(1, 11)  # 55 examples


@lru_cache(maxsize=4)
def _real_state(arch: str) -> dict[str, torch.Tensor]:
    model = build(arch, SHAPE, 10, seed=0).train()
    with torch.no_grad():  # non-trivial BN statistics, as a trained client has
        model(torch.rand(8, *SHAPE, generator=torch.Generator().manual_seed(0)))
    return model.state_dict()


def real_state(arch="cnn2") -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in _real_state(arch).items()}


def good_content(arch="cnn2", counts=COUNTS, partition=3, state=None):
    state = real_state(arch) if state is None else state
    return encode("classifier", arch, state, counts, partition, {"local-test-accuracy": 0.5, "train-seconds": 1.0})


def check(content, expect=EXPECT):
    return decode_and_check(content, node_id=NODE, num_classes=10, input_shape=SHAPE, expect=expect)


# --- tampering helpers --------------------------------------------------------------------------

def meta(c):
    return c.config_records["meta"]


def set_meta(key, value):
    def apply(c):
        meta(c)[key] = value
    return apply


def del_meta(key):
    def apply(c):
        del meta(c)[key]
    return apply


def edit_layout(fn):
    def apply(c):
        meta(c)["layout"] = fn(list(meta(c)["layout"]))
    return apply


def layout_index(c, key):
    return next(i for i, e in enumerate(meta(c)["layout"]) if e.startswith(key + "|"))


def values(c):
    return c.array_records["model"]["values"].numpy().copy()


def set_values(fn):
    def apply(c):
        c.array_records["model"]["values"] = Array(fn(values(c)))
    return apply


def set_tensor(key, fn):
    """Rewrite one float tensor inside the packed vector (located through the layout)."""
    def apply(c):
        vector, offset = values(c), 0
        for entry in meta(c)["layout"]:
            name, dims, kind = entry.split("|")
            if kind != "f":
                continue
            numel = int(np.prod([int(d) for d in dims.split(",") if d]))
            if name == key:
                vector[offset:offset + numel] = fn(vector[offset:offset + numel])
            offset += numel
        c.array_records["model"]["values"] = Array(vector)
    return apply


def set_counts(array):
    def apply(c):
        c.array_records["label-counts"]["counts"] = array
    return apply


def counts_and_examples(counts):
    """Counts plus a matching num-examples, so only the counts' own check can refuse them."""
    def apply(c):
        set_counts(Array(counts))(c)
        total = int(np.asarray(counts, dtype=object).sum())
        if total <= np.iinfo(np.int64).max:
            c.metric_records["metrics"]["num-examples"] = total
    return apply


def set_metric(key, value):
    def apply(c):
        c.metric_records["metrics"][key] = value
    return apply


def drop(record):
    def apply(c):
        del c[record]
    return apply


def drop_array(record, name):
    def apply(c):
        del c.array_records[record][name]
    return apply


def add_array(record, name, array):
    def apply(c):
        c.array_records[record][name] = array
    return apply


def npy_bytes(header: dict, body: bytes) -> bytes:
    """A .npy payload with a header of our choosing (what a hostile client can send)."""
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, header)
    return buffer.getvalue() + body


def raw_array(data: bytes, stype="numpy.ndarray", dtype="int64", shape=(10,)):
    return Array(dtype=dtype, shape=shape, stype=stype, data=data)


def replace_with_vgg9(c):
    """A whole, well-formed upload of another registry architecture for the same partition."""
    other = good_content(arch="vgg9")
    for key in list(c.keys()):
        del c[key]
    for key, record in other.items():
        c[key] = record


def claim_vgg9_with_cnn2_tensors(c):
    meta(c)["arch"] = "vgg9"


U64_MAX = np.iinfo(np.uint64).max

# (id, tamper, substring of the reason)
HOSTILE = [
    # --- issue 13's table -------------------------------------------------------------------
    ("partition-id-string", set_meta("partition-id", "abc"), "partition-id 'abc' is not an integer"),
    ("partition-id-nan", set_meta("partition-id", float("nan")), "is not an integer"),
    ("partition-id-float", set_meta("partition-id", 1.0), "is not an integer"),
    ("partition-id-bool", set_meta("partition-id", True), "is not an integer"),
    ("partition-id-missing", del_meta("partition-id"), "missing partition-id"),
    ("partition-id-out-of-range", set_meta("partition-id", 5), "partition-id 5 out of range [0, 5)"),
    ("partition-id-negative", set_meta("partition-id", -1), "out of range"),
    ("counts-garbage-bytes", set_counts(raw_array(b"\x00garbage-not-npy")), "label counts cannot be read"),
    ("counts-torch-raw-stype", set_counts(raw_array(np.arange(10).tobytes(), stype="torch.raw")),
     "label counts has serialization type 'torch.raw'"),
    ("counts-uint64-wraparound", counts_and_examples(np.array([U64_MAX, 2] + [0] * 8, dtype=np.uint64)),
     "exceed the int64 range"),
    ("counts-huge-1e17", counts_and_examples(np.full(10, 10**17, dtype=np.int64)),
     f"more than the {MNIST_TRAIN} examples"),
    ("counts-sum-overflows-int64", counts_and_examples(np.array([4_600_000_000_000_000_000] * 3 + [0] * 7)),
     f"more than the {MNIST_TRAIN} examples"),
    ("counts-just-above-train-size", counts_and_examples(np.array([MNIST_TRAIN - 8] + [1] * 9)),
     f"sum to {MNIST_TRAIN + 1}"),
    ("counts-forged-huge-header", set_counts(raw_array(npy_bytes(
        {"descr": "<i8", "fortran_order": False, "shape": (10**12,)}, b"\x01" * 80))),
     "label counts cannot be read"),
    ("counts-object-dtype", set_counts(raw_array(npy_bytes(
        {"descr": "|O", "fortran_order": False, "shape": (10,)}, b"\x00" * 80))), "label counts cannot be read"),
    ("bn-negative-running-var", set_tensor("features.1.running_var", lambda v: -np.abs(v) - 1.0),
     "negative BN running variance"),
    ("weights-all-1e30", set_values(lambda v: np.full_like(v, 1e30)), "above the bound"),
    ("one-weight-above-bound", set_tensor("classifier.weight", lambda v: np.where(np.arange(v.size) == 3,
                                                                                 MAX_ABS_WEIGHT * 10, v)),
     "'classifier.weight' holds |w| = 1e+07"),
    ("arch-vgg9-in-cnn2-fleet", replace_with_vgg9, "'vgg9' was not assigned to partition 3"),
    ("arch-claimed-without-its-tensors", claim_vgg9_with_cnn2_tensors, "was not assigned"),
    ("metric-inf", set_metric("train-seconds", float("inf")), "metric 'train-seconds' is not a finite number"),
    ("metric-nan-accuracy", set_metric("local-test-accuracy", float("nan")), "is not a finite number"),
    ("metric-list-with-nan", set_metric("losses", [1.0, float("nan")]), "metric 'losses' is not a finite"),
    # --- what was already rejected ----------------------------------------------------------
    ("nan-weight", set_tensor("features.0.weight", lambda v: np.where(np.arange(v.size) == 7, np.nan, v)),
     "tensor 'features.0.weight' contains NaN or Inf"),
    ("inf-weight", set_tensor("classifier.bias", lambda v: np.full_like(v, np.inf)), "contains NaN or Inf"),
    ("values-int32", set_values(lambda v: v.astype(np.int32)), "has dtype int32"),
    ("values-float64-oversized", set_values(lambda v: v.astype(np.float64)), "oversized upload"),
    ("values-too-short", set_values(lambda v: v[:-5]), "holds"),
    ("values-garbage-bytes", add_array("model", "values", raw_array(b"garbage", dtype="float32")),
     "packed array 'values' cannot be read"),
    ("values-torch-raw", add_array("model", "values", raw_array(b"\x00" * 16, stype="torch.raw")),
     "serialization type"),
    ("layout-wrong-shape", edit_layout(lambda ls: [ls[0].replace("16,1,5,5", "16,1,3,3")] + ls[1:]), "has shape"),
    ("layout-missing-bn-buffer",
     edit_layout(lambda ls: [e for e in ls if not e.startswith("features.1.running_mean|")]),
     "missing ['features.1.running_mean']"),
    ("layout-extra-tensor", edit_layout(lambda ls: ls + ["spy.weight|3|f"]), "unexpected ['spy.weight']"),
    ("layout-float-int-kind-mismatch", edit_layout(
        lambda ls: [e.replace("num_batches_tracked||i", "num_batches_tracked||f") for e in ls]), "is float"),
    ("layout-malformed-dims", edit_layout(lambda ls: [ls[0].replace("16,1,5,5", "16,x,5,5")] + ls[1:]),
     "malformed layout entry"),
    ("layout-negative-dim", edit_layout(lambda ls: [ls[0].replace("16,1,5,5", "-16,1,5,5")] + ls[1:]),
     "malformed layout entry"),
    ("layout-unknown-kind", edit_layout(lambda ls: [ls[0][:-1] + "z"] + ls[1:]), "malformed layout entry"),
    ("layout-duplicate-key", edit_layout(lambda ls: ls + [ls[0]]), "duplicate layout entry"),
    ("layout-not-a-list", set_meta("layout", "not a list"), "missing or malformed tensor layout"),
    ("layout-missing", del_meta("layout"), "missing or malformed tensor layout"),
    ("unknown-arch", set_meta("arch", "transformer"), "unknown architecture 'transformer'"),
    ("arch-not-a-string", set_meta("arch", ["cnn2"]), "unknown architecture"),
    ("oversized-meta-padding", set_meta("padding", "x" * 1_000_000), "oversized upload"),
    ("missing-meta", drop("meta"), "missing record 'meta'"),
    ("missing-metrics", drop("metrics"), "missing record 'metrics'"),
    ("missing-model-record", drop("model"), "missing array record 'model'"),
    ("missing-packed-values", drop_array("model", "values"), "missing packed array 'values'"),
    ("missing-packed-buffers", drop_array("model", "buffers"), "missing packed array 'buffers'"),
    ("unexpected-array-in-model", add_array("model", "extra", Array(np.zeros(4, np.float32))),
     "unexpected array(s) ['extra'] in 'model'"),
    ("unexpected-array-in-counts", add_array("label-counts", "extra", Array(np.zeros(2, np.int64))),
     "unexpected array(s) ['extra'] in 'label-counts'"),
    ("unexpected-record", lambda c: c.__setitem__("extra", ConfigRecord({"x": 1})), "unexpected record(s) extra"),
    ("wrong-format", set_meta("format", 99), "upload format 99"),
    ("format-bool", set_meta("format", True), "upload format True"),
    ("wrong-role", set_meta("role", "spy"), "role 'spy' not accepted"),
    ("accuracy-above-one", set_metric("local-test-accuracy", 3.0), "outside [0, 1]"),
    ("accuracy-a-list", set_metric("local-test-accuracy", [0.5, 0.6]), "local-test-accuracy [0.5, 0.6] outside"),
    ("num-examples-mismatch", set_metric("num-examples", 7), "does not equal the label counts' sum 55"),
    ("num-examples-float", set_metric("num-examples", 55.0), "does not equal"),
    ("num-examples-missing", lambda c: c.metric_records["metrics"].__delitem__("num-examples"), "num-examples None"),
    ("counts-float", counts_and_examples(COUNTS.astype(np.float32)), "expected integers"),
    ("counts-wrong-shape", counts_and_examples(np.arange(1, 12)), "label counts have shape (11,)"),
    ("counts-negative", counts_and_examples(np.array([-1, 2, 3, 4, 5, 6, 7, 8, 9, 11])), "negative"),
    ("counts-all-zero", counts_and_examples(np.zeros(10, np.int64)), "all zero"),
    ("counts-missing", drop("label-counts"), "missing label counts"),
]


@pytest.mark.parametrize("tamper, reason", [pytest.param(t, r, id=i) for i, t, r in HOSTILE])
def test_each_hostile_upload_is_that_nodes_rejection_with_its_reason(tamper, reason):
    content = good_content()
    tamper(content)
    with pytest.raises(InvalidUpload) as err:
        check(content)
    assert reason in err.value.reason, err.value.reason
    assert err.value.node_id == NODE


def test_the_corpus_is_large_and_its_ids_unique():
    ids = [i for i, _, _ in HOSTILE]
    assert len(ids) >= 30 and len(set(ids)) == len(ids)


def test_the_untampered_upload_passes():
    up = check(good_content())
    assert up.arch == "cnn2" and up.partition_id == 3 and up.num_examples == 55


def test_unexpected_arrays_are_refused_by_their_own_check_not_the_size_cap():
    content = good_content()
    add_array("model", "extra", Array(np.zeros(4, np.float32)))(content)
    raw = sum(t.numel() * t.element_size() for t in real_state().values())
    assert received_bytes(content) < raw * SIZE_SLACK + SIZE_SLACK_BYTES  # within the cap
    with pytest.raises(InvalidUpload, match="unexpected array"):
        check(content)


def test_a_reordered_upload_is_accepted_and_every_tensor_lands_in_its_slot():
    state = real_state()
    reordered = dict(reversed(list(state.items())))
    assert list(reordered) != list(state)
    up = check(good_content(state=reordered))
    assert list(up.state) == list(state)  # the architecture's order, whatever the client's
    for key, tensor in state.items():
        assert torch.equal(up.state[key], tensor), key


def test_a_shuffled_upload_lands_by_name_too():
    state = real_state()
    keys = list(state)
    shuffled = {k: state[k] for k in np.random.default_rng(0).permutation(keys)}
    up = check(good_content(state=shuffled))
    assert all(torch.equal(up.state[k], state[k]) for k in keys)


def test_the_assigned_architecture_follows_the_partition():
    archs = {0: {"cnn2"}, 1: {"lenet"}}
    expect = Expectation(num_partitions=2, max_examples=MNIST_TRAIN, archs=lambda role, pid: archs[pid])
    assert check(good_content(arch="lenet", partition=1), expect).arch == "lenet"
    with pytest.raises(InvalidUpload, match="'lenet' was not assigned to partition 0"):
        check(good_content(arch="lenet", partition=0), expect)


def test_long_parser_messages_are_clipped_in_the_reason():
    content = good_content()
    set_meta("arch", "x" * 5000)(content)
    with pytest.raises(InvalidUpload) as err:
        check(content)
    assert len(err.value.reason) < 400


def test_mnist_train_size_is_what_the_dataset_holds(mnist_dir):
    from oneshot_fl.data.datasets import DATASETS, load_split

    assert len(load_split("mnist", "train", str(mnist_dir), False)) == DATASETS["mnist"].train_size == MNIST_TRAIN
