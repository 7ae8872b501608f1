"""Client uploads trained in this process and cached: fleets for probes that vary one client or server setting.

The clients train through the ClientApp's own training functions (client_app.task) and their uploads pass the
server's checks (decode_and_check) exactly as over gRPC, without a SuperLink: a tuning probe that varies one
client or server setting does not pay a simulation per variant. Each fleet is one upload archive
(oneshot_fl.archive); each client's wall seconds live in its manifest, not in the uploads, because a
differentially private upload carries no metric of its client's data.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

log = logging.getLogger("oneshot_fl.bench")


def cached_uploads(folder: Path, cfg, jobs: list[tuple[int, str, str]]) -> tuple[list, list[float]]:
    """The uploads of `jobs` [(partition id, role, arch)] under the run config `cfg`, trained once and cached in
    `folder`; returns them (node id 1000 + partition id) and each client's training wall seconds."""
    from client_app.task import ClientJob, train_classifier, train_decoder
    from oneshot_fl.archive import load_uploads, save_uploads
    from oneshot_fl.data.datasets import DATASETS
    from oneshot_fl.uploads import decode_and_check

    info = DATASETS[cfg.dataset]
    roles = tuple(sorted({role for _, role, _ in jobs}))
    folder = Path(folder)
    if (folder / "manifest.json").is_file():
        uploads = load_uploads(folder, info.num_classes, info.input_shape, roles)
        return uploads, list(json.loads((folder / "manifest.json").read_text())["context"].get("client_seconds", []))
    tasks = {"classifier": train_classifier, "decoder": train_decoder}
    uploads, seconds = [], []
    for pid, role, arch in jobs:
        log.info("training client p%d (%s%s) for %s", pid, role, f", {arch}" if arch else "", folder.name)
        start = time.perf_counter()
        content = tasks[role](ClientJob(cfg, pid, arch, {"role": role}))
        uploads.append(decode_and_check(content, 1000 + pid, info.num_classes, info.input_shape, roles))
        seconds.append(time.perf_counter() - start)
    # the context a server's archive carries (poisoning and replays read the input shape and classes from it)
    save_uploads(folder, uploads, {"run_config": cfg.flat, "client_seconds": seconds, "num_classes": info.num_classes,
                                   "input_shape": list(info.input_shape)})
    return uploads, seconds
