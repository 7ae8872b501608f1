"""What a client uploads, how it travels in a Flower RecordDict, and how the server checks it.

An upload is one artefact per client, sent once: a model (role "classifier") or another
artefact kind registered in UPLOAD_ROLES (e.g. FedMHO's CVAE decoder), plus the client's
integer label counts and a few metrics. `decode_and_check` turns a received RecordDict into an
`Upload` or raises `InvalidUpload` with the reason; nothing unchecked reaches a server method.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from oneshot_fl.models.registry import ARCHITECTURES, expected_state

UPLOAD_FORMAT = 1
GLOBAL_MODEL_KEY = "global-model"  # multi-round mode: the ArrayRecord of the global model sent down
FLOAT_DTYPES = (np.float32, np.float16)  # float16 = optional half-precision upload
SIZE_SLACK = 1.02  # received bytes may exceed raw parameter bytes by 2 % (npy headers, keys)
SIZE_SLACK_BYTES = 64 * 1024

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
}


def register_role(role: UploadRole) -> None:
    UPLOAD_ROLES[role.name] = role


class InvalidUpload(ValueError):
    """A client's reply cannot be used; `reason` says why (logged with the node id, then dropped)."""

    def __init__(self, node_id: int, reason: str):
        super().__init__(f"node {node_id}: {reason}")
        self.node_id = node_id
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
    extra: dict[str, object] = field(default_factory=dict)  # role-specific settings (e.g. latent size)


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


def _first_nonfinite(vector: np.ndarray, expected: ExpectedState) -> str:
    """The name of the first float tensor holding the first NaN/Inf of a packed vector."""
    position = int(np.flatnonzero(~np.isfinite(vector))[0])
    for key, (shape, dtype) in expected.items():
        if dtype.is_floating_point:
            position -= int(np.prod(shape))
            if position < 0:
                return key
    return "?"


def decode_and_check(content: RecordDict, node_id: int, num_classes: int,
                     input_shape: tuple[int, int, int], roles: tuple[str, ...] = ("classifier",)) -> Upload:
    """Server side: RecordDict -> Upload, or InvalidUpload naming the first problem found."""

    def bad(reason: str) -> InvalidUpload:
        return InvalidUpload(node_id, reason)

    try:
        meta = content.config_records["meta"]
        metrics = content.metric_records["metrics"]
    except KeyError as exc:
        raise bad(f"missing record {exc.args[0]!r}") from None
    if meta.get("format") != UPLOAD_FORMAT:
        raise bad(f"upload format {meta.get('format')!r}, this server reads format {UPLOAD_FORMAT}")
    role_name = meta.get("role")
    if role_name not in roles:
        raise bad(f"role {role_name!r} not accepted by this method (accepts: {', '.join(roles)})")
    role = UPLOAD_ROLES[role_name]
    arch = meta.get("arch")
    known = role.architectures()
    if arch not in known:
        raise bad(f"unknown architecture {arch!r} for role {role_name} (known: {', '.join(known)})")

    allowed_records = {role.record_key, "label-counts", "meta", "metrics"}
    extra_records = sorted(set(content.keys()) - allowed_records)
    if extra_records:
        raise bad(f"unexpected record(s) {', '.join(extra_records)}")
    if role.record_key not in content.array_records:
        raise bad(f"missing array record {role.record_key!r}")

    extra = {k: v for k, v in meta.items() if k not in ("format", "role", "arch", "partition-id", "layout")}
    try:
        settings = role.settings(extra) if role.settings else {}
    except ValueError as exc:
        raise bad(str(exc)) from None
    expected = role.expected(arch, tuple(input_shape), num_classes, **settings)
    layout = meta.get("layout")
    if not isinstance(layout, list) or not all(isinstance(e, str) and e.count("|") == 2 for e in layout):
        raise bad("missing or malformed tensor layout")
    received = {}
    for entry in layout:
        key, dims, kind = entry.split("|")
        try:
            received[key] = (tuple(int(d) for d in dims.split(",") if d), kind)
        except ValueError:
            raise bad(f"malformed layout entry {entry!r}") from None
    missing = [k for k in expected if k not in received]
    unexpected = [k for k in received if k not in expected]
    if missing or unexpected:
        raise bad(f"{arch} tensors do not match: missing {missing[:5]}, unexpected {unexpected[:5]}")
    for key, (shape, dtype) in expected.items():
        got_shape, kind = received[key]
        if got_shape != shape:
            raise bad(f"tensor {key!r} has shape {got_shape}, {arch} expects {shape}")
        if kind != ("f" if dtype.is_floating_point else "i"):
            raise bad(f"tensor {key!r} is {'float' if kind == 'f' else 'integer'}, {arch} expects {dtype}")

    raw_expected = sum(int(np.prod(shape)) * torch.empty((), dtype=dt).element_size()
                       for shape, dt in expected.values())
    size = received_bytes(content)
    if size > raw_expected * SIZE_SLACK + SIZE_SLACK_BYTES:
        raise bad(f"oversized upload: {size} bytes for {raw_expected} bytes of {arch} parameters")

    arrays = content.array_records[role.record_key]
    vectors = {}
    for name, kinds, want in (("values", FLOAT_DTYPES, "f"), ("buffers", (np.int64,), "i")):
        numel = sum(int(np.prod(shape)) for shape, dt in expected.values()
                    if ("f" if dt.is_floating_point else "i") == want)
        if name not in arrays:
            if numel:
                raise bad(f"missing packed array {name!r}")
            continue
        try:
            vector = arrays[name].numpy()
        except Exception as exc:  # malformed .npy payloads raise many kinds of errors
            raise bad(f"packed array {name!r} cannot be read: {exc}") from None
        if vector.dtype not in kinds:
            raise bad(f"packed array {name!r} has dtype {vector.dtype}, expected "
                      f"{' or '.join(np.dtype(k).name for k in kinds)}")
        if vector.shape != (numel,):
            raise bad(f"packed array {name!r} holds {vector.size} values, {arch} has {numel}")
        if want == "f" and not np.isfinite(vector).all():
            bad_key = _first_nonfinite(vector, expected)
            raise bad(f"tensor {bad_key!r} contains NaN or Inf")
        vectors[want] = vector
    unknown_arrays = sorted(set(arrays.keys()) - {"values", "buffers"})
    if unknown_arrays:
        raise bad(f"unexpected array(s) {unknown_arrays} in {role.record_key!r}")

    state: dict[str, torch.Tensor] = {}
    offsets = {"f": 0, "i": 0}
    raw_bytes = 0
    for key, (shape, dtype) in expected.items():
        kind = "f" if dtype.is_floating_point else "i"
        numel = int(np.prod(shape))
        piece = vectors[kind][offsets[kind]:offsets[kind] + numel]
        offsets[kind] += numel
        raw_bytes += piece.nbytes
        tensor = torch.from_numpy(np.array(piece)).reshape(shape)  # copy: the buffer is read-only
        state[key] = tensor.float() if kind == "f" else tensor

    if "label-counts" not in content.array_records or "counts" not in content.array_records["label-counts"]:
        raise bad("missing label counts")
    counts = content.array_records["label-counts"]["counts"].numpy()
    if counts.dtype.kind not in "iu":
        raise bad(f"label counts have dtype {counts.dtype}, expected integers")
    if counts.shape != (num_classes,):
        raise bad(f"label counts have shape {counts.shape}, expected ({num_classes},)")
    if (counts < 0).any():
        raise bad("label counts contain negative values")
    if counts.sum() <= 0:
        raise bad("label counts are all zero")
    num_examples = metrics.get("num-examples")
    if not isinstance(num_examples, int) or num_examples != int(counts.sum()):
        raise bad(f"num-examples {num_examples!r} does not equal the label counts' sum {int(counts.sum())}")
    accuracy = metrics.get("local-test-accuracy")
    if accuracy is not None and not (isinstance(accuracy, (int, float)) and 0.0 <= accuracy <= 1.0):
        raise bad(f"local-test-accuracy {accuracy!r} outside [0, 1]")

    return Upload(
        node_id=node_id,
        partition_id=int(meta.get("partition-id", -1)),
        role=role_name,
        arch=arch,
        state=state,
        label_counts=counts.astype(np.int64),
        num_examples=num_examples,
        metrics={k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))},
        received_bytes=size,
        raw_bytes=raw_bytes,
        extra=extra,
    )
