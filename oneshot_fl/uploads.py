"""What a client uploads, how it travels in a Flower RecordDict, and how the server checks it.

An upload is one artefact per client, sent once: a model (role "classifier") or another
artefact kind registered in UPLOAD_ROLES (e.g. FedMHO's CVAE decoder), plus the client's
integer label counts and a few metrics. A differentially private client's upload also carries its
guarantee in the meta record (`dp-*` entries: epsilon, delta and its mechanisms' parameters,
oneshot_fl.local.dp.DPGuarantee), its label counts are the noised histogram, and it has no BN
statistics; the server recomputes the claimed epsilon and, in a DP run, requires the claim.
`decode_and_check` turns a received RecordDict into an `Upload` or raises `InvalidUpload` with
the reason; nothing unchecked reaches a server method.
A reply is hostile until checked: any error while reading it, expected or not, becomes that
node's rejection, never the round's failure.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field
from typing import Callable, Collection

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.constant import SType

from oneshot_fl.local.dp import META_PREFIX as DP_META_PREFIX
from oneshot_fl.local.dp import DPGuarantee, check_upload_is_private
from oneshot_fl.models.cvae import CVAE_ARCHITECTURES, decoder_settings, expected_decoder_state
from oneshot_fl.models.registry import ARCHITECTURES, expected_state

UPLOAD_FORMAT = 1
GLOBAL_MODEL_KEY = "global-model"  # multi-round mode: the ArrayRecord of the global model sent down
FLOAT_DTYPES = (np.float32, np.float16)  # float16 = optional half-precision upload
SIZE_SLACK = 1.02  # received bytes may exceed raw parameter bytes by 2 % (npy headers, keys)
SIZE_SLACK_BYTES = 64 * 1024
# Magnitude bound on float weights and BN statistics. Honest uploads sit far below it (the cnn2
# uploads of this project's MNIST/FMNIST benchmark runs: |w| < 5, BN running_var included), so it
# costs no honest client, while 1e30-style weights, whose outputs overflow to Inf once averaged
# or used as a teacher, never pass.
MAX_ABS_WEIGHT = 1e6
# No dataset this app knows has a billion training images; the bound used when the run's training
# set size is not known, so that label counts can never claim int64-overflowing sums.
MAX_EXAMPLES_ANY = 10**9
REASON_LIMIT = 300  # characters of a rejection reason (parser messages may quote whole payloads)
META_KEYS = ("format", "role", "arch", "partition-id", "layout")

ExpectedState = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass(frozen=True)
class UploadRole:
    """One kind of upload: the record key its tensors travel under and their expected layout.

    `settings` (optional) validates the role's own settings sent in the meta record (e.g. a
    decoder's latent size) and returns them as keyword arguments for `expected`; it raises
    ValueError with the reason when they are missing or bad.
    """

    name: str
    record_key: str
    architectures: Callable[[], list[str]]
    expected: Callable[..., ExpectedState]  # (arch, input_shape, num_classes, **settings)
    settings: Callable[[dict], dict] | None = None


UPLOAD_ROLES: dict[str, UploadRole] = {
    "classifier": UploadRole("classifier", "model", lambda: list(ARCHITECTURES), expected_state),
    # FedMHO's resource-constrained clients and FedCVAE's: a CVAE decoder, of the latent size its meta record names
    "decoder": UploadRole("decoder", "decoder", lambda: list(CVAE_ARCHITECTURES), expected_decoder_state,
                          settings=decoder_settings),
}


def register_role(role: UploadRole) -> None:
    UPLOAD_ROLES[role.name] = role


class InvalidUpload(ValueError):
    """A client's reply cannot be used; `reason` says why (logged with the node id, then dropped)."""

    def __init__(self, node_id: int, reason: str):
        super().__init__(f"node {node_id}: {reason}")
        self.node_id = node_id
        self.reason = reason


@dataclass(frozen=True)
class Expectation:
    """What this run expects of an upload beyond its role's tensor layout: the server's view of
    its own fleet (strategies.base builds it from the run config). None = not checked."""

    num_partitions: int | None = None  # partition ids must lie in [0, num_partitions)
    max_examples: int | None = None  # the training-set size: no client can hold more examples
    archs: Callable[[str, int], Collection[str] | None] | None = None  # (role, partition id) -> archs assigned
    dp: tuple[float, float] | None = None  # a DP run's (epsilon, delta): every upload must claim at most these


class _Bad(Exception):
    """Internal: one check failed; decode_and_check turns it into InvalidUpload for the node."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class Upload:
    node_id: int
    partition_id: int
    role: str
    arch: str
    state: dict[str, torch.Tensor]
    label_counts: np.ndarray
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)
    received_bytes: int = 0  # everything the server received for this reply
    raw_bytes: int = 0  # the tensors' raw bytes as uploaded (float16 uploads: 2 per value)
    extra: dict[str, object] = field(default_factory=dict)  # role-specific settings (e.g. latent size), DP claim
    dp: DPGuarantee | None = None  # a DP client's verified guarantee (None: no claim)


def _layout_entry(key: str, tensor: torch.Tensor) -> str:
    return f"{key}|{','.join(map(str, tensor.shape))}|{'f' if tensor.is_floating_point() else 'i'}"


def encode(role: str, arch: str, state: dict[str, torch.Tensor], label_counts: np.ndarray,
           partition_id: int, metrics: dict[str, float], half_precision: bool = False,
           extra: dict[str, object] | None = None) -> RecordDict:
    """Client side: the reply content for one upload.

    Tensors travel packed: one flat float vector ("values") and one int64 vector ("buffers",
    e.g. BN's num_batches_tracked), with the key/shape layout in the meta record. A per-tensor
    ArrayRecord pays a .npy header and an object id per tensor (2-3 % of a 29 k-parameter CNN);
    packed, the overhead stays far below 1 %, and the layout still lets the server check every
    tensor's name and shape.
    """
    floats, ints, layout = [], [], []
    for key, tensor in state.items():
        tensor = tensor.detach().cpu()
        layout.append(_layout_entry(key, tensor))
        (floats if tensor.is_floating_point() else ints).append(tensor.reshape(-1))
    values = torch.cat([t.float() for t in floats]) if floats else torch.empty(0)
    arrays = {"values": Array((values.half() if half_precision else values).numpy())}
    if ints:
        arrays["buffers"] = Array(torch.cat([t.long() for t in ints]).numpy())
    counts = np.asarray(label_counts, dtype=np.int64)
    meta = {"format": UPLOAD_FORMAT, "role": role, "arch": arch, "partition-id": int(partition_id),
            "layout": layout}
    meta.update(extra or {})
    return RecordDict({
        UPLOAD_ROLES[role].record_key: ArrayRecord(arrays),
        "label-counts": ArrayRecord({"counts": Array(counts)}),
        "meta": ConfigRecord(meta),
        "metrics": MetricRecord({**metrics, "num-examples": int(counts.sum())}),
    })


def received_bytes(content: RecordDict) -> int:
    """Bytes the server received for this reply: every record's payload plus key names."""
    return sum(record.count_bytes() for record in content.values())


def decode_and_check(content: RecordDict, node_id: int, num_classes: int,
                     input_shape: tuple[int, int, int], roles: tuple[str, ...] = ("classifier",),
                     expect: Expectation | None = None) -> Upload:
    """Server side: RecordDict -> Upload, or InvalidUpload naming the first problem found.

    Never raises anything else: a reply that breaks a parser in a way no check foresaw is still
    only that node's rejection.
    """
    try:
        return _decode(content, node_id, num_classes, tuple(input_shape), roles, expect or Expectation())
    except _Bad as exc:
        raise InvalidUpload(node_id, _clip(exc.reason)) from None
    except Exception as exc:  # noqa: BLE001 - hostile input may raise anything; it costs the node only
        raise InvalidUpload(node_id, _clip(f"unreadable upload ({type(exc).__name__}: {exc})")) from None


def _clip(reason: str) -> str:
    return reason if len(reason) <= REASON_LIMIT else reason[:REASON_LIMIT] + "..."


def _kind(dtype: torch.dtype) -> str:
    return "f" if dtype.is_floating_point else "i"


def _decode(content: RecordDict, node_id: int, num_classes: int, input_shape: tuple[int, int, int],
            roles: tuple[str, ...], expect: Expectation) -> Upload:
    meta, metrics = _records(content)
    role_name, arch = _role_and_arch(meta, roles)
    role = UPLOAD_ROLES[role_name]
    partition_id = _partition_id(meta, expect)
    _check_assigned_arch(role_name, arch, partition_id, expect)
    arrays = _arrays(content, role)

    extra = {k: v for k, v in meta.items() if k not in META_KEYS}
    try:
        settings = role.settings(extra) if role.settings else {}
    except ValueError as exc:
        raise _Bad(str(exc)) from None
    expected = role.expected(arch, input_shape, num_classes, **settings)
    layout = _layout(meta)
    _match_layout(layout, expected, arch)

    raw_expected = sum(int(np.prod(shape)) * torch.empty((), dtype=dt).element_size()
                       for shape, dt in expected.values())
    size = received_bytes(content)
    if size > raw_expected * SIZE_SLACK + SIZE_SLACK_BYTES:
        raise _Bad(f"oversized upload: {size} bytes for {raw_expected} bytes of {arch} parameters")

    vectors = _packed_vectors(arrays, expected, arch)
    state = _unpack(layout, vectors, expected)
    _check_values(state)
    counts, total = _label_counts(content, num_classes, expect)
    num_examples, scalar_metrics = _metrics(metrics, total)
    guarantee = _dp_claim(extra, state, metrics, expect)

    return Upload(
        node_id=node_id,
        partition_id=partition_id,
        role=role_name,
        arch=arch,
        state=state,
        label_counts=counts,
        num_examples=num_examples,
        metrics=scalar_metrics,
        received_bytes=size,
        raw_bytes=sum(vector.nbytes for vector in vectors.values()),
        extra=extra,
        dp=guarantee,
    )


def _records(content: RecordDict) -> tuple[ConfigRecord, MetricRecord]:
    try:
        return content.config_records["meta"], content.metric_records["metrics"]
    except KeyError as exc:
        raise _Bad(f"missing record {exc.args[0]!r}") from None


def _role_and_arch(meta: ConfigRecord, roles: tuple[str, ...]) -> tuple[str, str]:
    upload_format = meta.get("format")
    if type(upload_format) is not int or upload_format != UPLOAD_FORMAT:  # True == 1 must not pass
        raise _Bad(f"upload format {upload_format!r}, this server reads format {UPLOAD_FORMAT}")
    role_name = meta.get("role")
    if not isinstance(role_name, str) or role_name not in roles:
        raise _Bad(f"role {role_name!r} not accepted by this method (accepts: {', '.join(roles)})")
    arch = meta.get("arch")
    known = UPLOAD_ROLES[role_name].architectures()
    if not isinstance(arch, str) or arch not in known:
        raise _Bad(f"unknown architecture {arch!r} for role {role_name} (known: {', '.join(known)})")
    return role_name, arch


def _partition_id(meta: ConfigRecord, expect: Expectation) -> int:
    """An integer in [0, num-partitions): anything else cannot be placed in the run's partition."""
    value = meta.get("partition-id")
    if value is None:
        raise _Bad("missing partition-id")
    if type(value) is not int:
        raise _Bad(f"partition-id {value!r} is not an integer")
    if value < 0 or (expect.num_partitions is not None and value >= expect.num_partitions):
        bound = f"[0, {expect.num_partitions})" if expect.num_partitions is not None else ">= 0"
        raise _Bad(f"partition-id {value} out of range {bound}")
    return value


def _check_assigned_arch(role: str, arch: str, partition_id: int, expect: Expectation) -> None:
    """A client trains what the run assigned its partition; any other registry architecture is a
    lie that would fail fusion after the quorum (or move the size cap to a bigger model)."""
    assigned = expect.archs(role, partition_id) if expect.archs else None
    if assigned is not None and arch not in assigned:
        raise _Bad(f"architecture {arch!r} was not assigned to partition {partition_id} in this run "
                   f"(assigned: {', '.join(sorted(assigned))})")


def _arrays(content: RecordDict, role: UploadRole) -> ArrayRecord:
    allowed_records = {role.record_key, "label-counts", "meta", "metrics"}
    extra_records = sorted(set(content.keys()) - allowed_records)
    if extra_records:
        raise _Bad(f"unexpected record(s) {', '.join(extra_records)}")
    if role.record_key not in content.array_records:
        raise _Bad(f"missing array record {role.record_key!r}")
    arrays = content.array_records[role.record_key]
    unknown_arrays = sorted(set(arrays.keys()) - {"values", "buffers"})
    if unknown_arrays:
        raise _Bad(f"unexpected array(s) {unknown_arrays} in {role.record_key!r}")
    return arrays


Layout = list[tuple[str, tuple[int, ...], str]]  # (state_dict key, shape, "f" | "i") in the client's order


def _layout(meta: ConfigRecord) -> Layout:
    layout = meta.get("layout")
    if not isinstance(layout, list) or not all(isinstance(e, str) and e.count("|") == 2 for e in layout):
        raise _Bad("missing or malformed tensor layout")
    parsed, seen = [], set()
    for entry in layout:
        key, dims, kind = entry.split("|")
        try:
            shape = tuple(int(d) for d in dims.split(",") if d)
        except ValueError:
            raise _Bad(f"malformed layout entry {entry!r}") from None
        if kind not in ("f", "i") or any(d < 0 for d in shape):
            raise _Bad(f"malformed layout entry {entry!r}")
        if key in seen:
            raise _Bad(f"duplicate layout entry for tensor {key!r}")
        seen.add(key)
        parsed.append((key, shape, kind))
    return parsed


def _match_layout(layout: Layout, expected: ExpectedState, arch: str) -> None:
    """Every expected tensor once, by name, with its shape and kind; nothing else."""
    received = {key: (shape, kind) for key, shape, kind in layout}
    missing = [k for k in expected if k not in received]
    unexpected = [k for k in received if k not in expected]
    if missing or unexpected:
        raise _Bad(f"{arch} tensors do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for key, (shape, dtype) in expected.items():
        got_shape, kind = received[key]
        if got_shape != shape:
            raise _Bad(f"tensor {key!r} has shape {got_shape}, {arch} expects {shape}")
        if kind != _kind(dtype):
            raise _Bad(f"tensor {key!r} is {'float' if kind == 'f' else 'integer'}, {arch} expects {dtype}")


def _npy(array: Array, what: str) -> np.ndarray:
    """One .npy payload as an array, after checking that its header describes exactly the bytes
    received: a forged header must not make np.load allocate more than was sent."""
    if not isinstance(array, Array) or array.stype != SType.NUMPY:
        raise _Bad(f"{what} has serialization type {getattr(array, 'stype', None)!r}, expected {SType.NUMPY}")
    try:
        buffer = io.BytesIO(array.data)
        version = np.lib.format.read_magic(buffer)
        read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                       (2, 0): np.lib.format.read_array_header_2_0}.get(version)
        if read_header is None:
            raise ValueError(f"unsupported .npy version {version}")
        shape, _, dtype = read_header(buffer)
        if dtype.hasobject:
            raise ValueError("object arrays are not accepted")
        body = len(array.data) - buffer.tell()
        if body != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"header says {shape} {dtype}, payload holds {body} bytes")
        return np.load(io.BytesIO(array.data), allow_pickle=False)
    except _Bad:
        raise
    except Exception as exc:  # noqa: BLE001 - malformed .npy payloads raise many kinds of errors
        raise _Bad(f"{what} cannot be read: {type(exc).__name__}: {exc}") from None


def _packed_vectors(arrays: ArrayRecord, expected: ExpectedState, arch: str) -> dict[str, np.ndarray]:
    """The flat float ("values") and integer ("buffers") vectors, dtype and length checked."""
    vectors = {}
    for name, kinds, want in (("values", FLOAT_DTYPES, "f"), ("buffers", (np.int64,), "i")):
        numel = sum(int(np.prod(shape)) for shape, dt in expected.values() if _kind(dt) == want)
        if name not in arrays:
            if numel:
                raise _Bad(f"missing packed array {name!r}")
            vectors[want] = np.empty(0, dtype=kinds[0])
            continue
        vector = _npy(arrays[name], f"packed array {name!r}")
        if vector.dtype not in kinds:
            raise _Bad(f"packed array {name!r} has dtype {vector.dtype}, expected "
                       f"{' or '.join(np.dtype(k).name for k in kinds)}")
        if vector.shape != (numel,):
            raise _Bad(f"packed array {name!r} holds {vector.size} values, {arch} has {numel}")
        vectors[want] = vector
    return vectors


def _unpack(layout: Layout, vectors: dict[str, np.ndarray], expected: ExpectedState) -> dict[str, torch.Tensor]:
    """Slice the packed vectors in the CLIENT's layout order (the order it packed them in), then
    key every tensor by name in the architecture's order: a reordered upload lands right."""
    offsets = {"f": 0, "i": 0}
    pieces = {}
    for key, shape, kind in layout:
        numel = math.prod(shape)
        pieces[key] = vectors[kind][offsets[kind]:offsets[kind] + numel]
        offsets[kind] += numel
    state = {}
    for key, (shape, dtype) in expected.items():
        tensor = torch.from_numpy(np.array(pieces[key])).reshape(shape)  # copy: the buffer is read-only
        state[key] = tensor.float() if dtype.is_floating_point else tensor
    return state


def _check_values(state: dict[str, torch.Tensor]) -> None:
    """Finite, bounded float weights and non-negative BN variances (the BN layer takes their
    square root, so a negative one turns every output into NaN)."""
    for key, tensor in state.items():
        if not tensor.is_floating_point():
            continue
        if not torch.isfinite(tensor).all():
            raise _Bad(f"tensor {key!r} contains NaN or Inf")
        largest = float(tensor.abs().max()) if tensor.numel() else 0.0
        if largest > MAX_ABS_WEIGHT:
            raise _Bad(f"tensor {key!r} holds |w| = {largest:.3g}, above the bound {MAX_ABS_WEIGHT:g}")
        if key.endswith("running_var") and tensor.numel() and float(tensor.min()) < 0:
            raise _Bad(f"tensor {key!r} holds a negative BN running variance ({float(tensor.min()):.3g})")


def _label_counts(content: RecordDict, num_classes: int, expect: Expectation) -> tuple[np.ndarray, int]:
    """Non-negative int64 counts whose exact sum no training set this run knows could exceed."""
    if "label-counts" not in content.array_records or "counts" not in content.array_records["label-counts"]:
        raise _Bad("missing label counts")
    unknown_arrays = sorted(set(content.array_records["label-counts"].keys()) - {"counts"})
    if unknown_arrays:
        raise _Bad(f"unexpected array(s) {unknown_arrays} in 'label-counts'")
    counts = _npy(content.array_records["label-counts"]["counts"], "label counts")
    if counts.dtype.kind not in "iu":
        raise _Bad(f"label counts have dtype {counts.dtype}, expected integers")
    if counts.shape != (num_classes,):
        raise _Bad(f"label counts have shape {counts.shape}, expected ({num_classes},)")
    values = [int(c) for c in counts]  # exact Python ints: no wrap-around of uint64 or of the sum
    if any(c > np.iinfo(np.int64).max for c in values):
        raise _Bad("label counts exceed the int64 range")
    if any(c < 0 for c in values):
        raise _Bad("label counts contain negative values")
    total = sum(values)
    if total <= 0:
        raise _Bad("label counts are all zero")
    limit = expect.max_examples if expect.max_examples is not None else MAX_EXAMPLES_ANY
    if total > limit:
        raise _Bad(f"label counts sum to {total}, more than the {limit} examples of the training set")
    return np.asarray(values, dtype=np.int64), total


def _finite(value) -> bool:
    items = value if isinstance(value, list) else [value]
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in items)


def _metrics(metrics: MetricRecord, total: int) -> tuple[int, dict[str, float]]:
    """num-examples equal to the counts' sum; every metric finite; the accuracy a fraction."""
    for key, value in metrics.items():
        if not _finite(value):
            raise _Bad(f"metric {key!r} is not a finite number: {value!r}")
    num_examples = metrics.get("num-examples")
    if type(num_examples) is not int or num_examples != total:
        raise _Bad(f"num-examples {num_examples!r} does not equal the label counts' sum {total}")
    accuracy = metrics.get("local-test-accuracy")
    if accuracy is not None and not (isinstance(accuracy, (int, float)) and 0.0 <= accuracy <= 1.0):
        raise _Bad(f"local-test-accuracy {accuracy!r} outside [0, 1]")
    return num_examples, {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}


def _dp_claim(extra: dict, state: dict[str, torch.Tensor], metrics: MetricRecord,
              expect: Expectation) -> DPGuarantee | None:
    """The upload's differential-privacy guarantee, checked: in a DP run it must be there and within the run's
    (epsilon, delta); anywhere, a claim must be complete, its epsilon what its mechanisms' parameters give under
    the accountant (recomputed here), and the upload free of what the guarantee does not cover (BN statistics,
    metrics of the client's data). None for an upload without a claim in a run without DP."""
    if not any(key.startswith(DP_META_PREFIX) for key in extra):
        if expect.dp is not None:
            raise _Bad(f"no differential-privacy claim, and this run requires one (local.dp.epsilon={expect.dp[0]:g}, "
                       f"delta={expect.dp[1]:g})")
        return None
    try:
        claim = DPGuarantee.from_meta(extra)
    except ValueError as exc:
        raise _Bad(f"invalid DP claim: {exc}") from None
    if expect.dp is not None:
        epsilon, delta = expect.dp
        if claim.epsilon > epsilon:
            raise _Bad(f"DP claim epsilon {claim.epsilon:.4g} exceeds this run's local.dp.epsilon={epsilon:g}")
        if claim.delta > delta:
            raise _Bad(f"DP claim delta {claim.delta:g} exceeds this run's local.dp.delta={delta:g}")
    try:
        check_upload_is_private(state, dict(metrics))
    except ValueError as exc:
        raise _Bad(str(exc)) from None
    return claim
