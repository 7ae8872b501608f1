"""Expel audit: which clients the default FedHydra leaves out of its teacher on an uploads archive.

Model Stratification and the peer check run exactly as in a replay of `fedhydra` (its `make_aggregator`
steps: `stratify`, then `check_peers`, whose robust default ends with `engine.trust.expel`); nothing is
distilled and no accuracy is measured, so an archive takes seconds. Where no client is left out, a replay
of the default computes what it computed before `expel` existed (same seeds, same check), so the records
of the default on those uploads stand. One JSON record per archive in `results/expel_audit.jsonl`, table in
`results/expel_audit.md`. For reported and tuning archives alike: it chooses nothing.

  python -m benchmarks.expel_audit benchmarks/runs/paper_table/*/uploads
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from benchmarks.records import RESULTS_DIR, append_record, code_version, load_records, machine, repo_relative
from oneshot_fl.logs import setup_logging

log = logging.getLogger("oneshot_fl.bench")
TABLE = "expel_audit"


def audit(uploads: Path, sets: list[str], run_dir: Path) -> dict:
    """The default's expel decision on one archive: per client, its rejected share and claim recognition."""
    from benchmarks.teacher_probe import fedhydra_fleet

    strategy, ups, ensemble = fedhydra_fleet(uploads, sets, run_dir)
    ctx, params = strategy.ctx, strategy.params
    try:
        check = strategy.check_peers(ensemble, strategy.stratify(ensemble, ctx), ctx)
    finally:
        ensemble.close()
    row = {"archive": repo_relative(uploads) or str(uploads), "sets": sets,
           "clients": [up.partition_id for up in ups],
           "peer_expel": params.resolved("peer_expel"), "peer_expel_recognition": params.peer_expel_recognition}
    if getattr(check, "expelled", None) is None:  # expel off, or the round trip
        return {**row, "expelled": None}
    return {**row, "expelled": [up.partition_id for up, out in zip(ups, check.expelled.tolist()) if out],
            "rejected_share": [round(float(v), 4) for v in check.rejected_share],
            "claim_recognition": [round(float(v), 4) for v in check.claim_recognition]}


def render() -> Path:
    """results/expel_audit.md: the latest decision per (archive, overrides)."""
    latest = {}
    for row in load_records(TABLE):
        latest[(row["archive"], " ".join(row["sets"]))] = row
    lines = ["# Expel audit", "",
             "Whom the default FedHydra (`engine/trust.expel`) leaves out of its teacher on each archive: MS and the "
             "peer check as in a replay, no distillation. `rejected share` = the share of a client's judged MS "
             "weight its peers reject; `claim recognition` = how well it recognises its peers' images of the classes "
             "it claims (left out: share >= the bar and recognition < the recognition bar x the median client's). "
             "Command: `python -m benchmarks.expel_audit` (benchmarks/README.md); records: `expel_audit.jsonl`.", "",
             "| archive | overrides | left out | rejected share (per client) | claim recognition (per client) |",
             "|---|---|---|---|---|"]
    for (archive, sets), row in sorted(latest.items()):
        name = Path(archive).parent.name
        if row["expelled"] is None:
            lines.append(f"| {name} | {sets} | expel off | - | - |")
            continue
        out = ", ".join(f"p{k}" for k in row["expelled"]) or "none"
        lines.append(f"| {name} | {sets} | {out} | {' '.join(f'{v:.2f}' for v in row['rejected_share'])} | "
                     f"{' '.join(f'{v:.2f}' for v in row['claim_recognition'])} |")
    out_path = RESULTS_DIR / f"{TABLE}.md"
    out_path.write_text("\n".join(lines) + "\n")
    return out_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("archives", nargs="+", type=Path, help="uploads archives (folders with manifest.json)")
    parser.add_argument("--set", nargs="*", default=["threads=1"], help="run-config overrides (server side)")
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/oneshot-fl-expel-audit"),
                        help="the strategy's run folder (nothing is kept there)")
    args = parser.parse_args(argv)
    setup_logging()
    for archive in args.archives:
        row = audit(archive, args.set, args.scratch)
        row.update({"table": TABLE, "code": code_version(), "machine": machine()})
        append_record(row)
        log.info("%s: left out %s", archive.parent.name, row["expelled"])
    render()
    return 0


if __name__ == "__main__":
    sys.exit(main())
