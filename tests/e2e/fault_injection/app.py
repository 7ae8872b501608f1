"""TEST ONLY: the project's ClientApp plus upload corruption, switched on per SuperNode with
--node-config 'corrupt-upload="nan"' (modes: CORRUPTIONS, or "hang"). It is shipped only in the app bundle
the deployment tests build (see `fault_app_dir` in tests/e2e/test_deployment.py), never in the project's own app.
"""

from __future__ import annotations

import time

import numpy as np
from flwr.app import Array, Context, Message
from flwr.clientapp import ClientApp

from client_app.app import train as honest_train


def _values(content):
    return content.array_records["model"]["values"].numpy().copy()


def _set_values(content, values):
    content.array_records["model"]["values"] = Array(values)


def _nan(content):
    values = _values(content)
    values[0] = np.nan
    _set_values(content, values)


def _counts(content):
    counts = content.array_records["label-counts"]["counts"].numpy().copy()
    counts[0] = -5
    content.array_records["label-counts"]["counts"] = Array(counts)


def _arch(content):
    content.config_records["meta"]["arch"] = "no-such-net"


def _shape(content):
    _set_values(content, _values(content)[:-1])


def _dtype(content):
    _set_values(content, _values(content).view(np.int32))  # same bytes, integer dtype


def _oversized(content):
    # 4 MiB of padding in the meta record: every byte received counts against the size cap, and an
    # extra array would be refused earlier, as an unexpected array
    content.config_records["meta"]["padding"] = "x" * (4 * 1024 * 1024)


CORRUPTIONS = {"nan": _nan, "counts": _counts, "arch": _arch, "shape": _shape, "dtype": _dtype,
               "oversized": _oversized}

app = ClientApp()


@app.train()
def train(msg: Message, context: Context) -> Message:
    mode = str(context.node_config.get("corrupt-upload", ""))
    if mode == "hang":  # alive (heartbeats go on) but never answers
        time.sleep(24 * 3600)
    reply = honest_train(msg, context)
    if mode:
        CORRUPTIONS[mode](reply.content)
    return reply
