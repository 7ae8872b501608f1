"""Render every benchmark record into benchmarks/results/README.md (markdown tables).

  python -m benchmarks.render
For each table: one row per (dataset, cell), one column per method with mean +- std over seeds
(n = seeds), the latest record per (method, dataset, cell, seed) counting. Reference numbers from
the papers sit beside ours where a table defines them.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from benchmarks.records import RESULTS_DIR, load_records

# Best published number for FedHydra's cells (max over the FedHydra and DENSE papers), the target
# of the paper-table benchmark (issue 3), and the FedHydra paper's own numbers.
REFERENCES = {
    "paper_table": {
        "target (best published)": {
            ("mnist", "0.5"): 95.82, ("mnist", "0.3"): 85.16, ("mnist", "0.1"): 66.61, ("mnist", "0.01"): 38.83,
            ("fmnist", "0.5"): 85.94, ("fmnist", "0.3"): 83.96, ("fmnist", "0.1"): 50.48, ("fmnist", "0.01"): 46.02,
            ("mnist", "2c/c"): 40.81, ("fmnist", "2c/c"): 39.06,
        },
        "FedHydra paper": {
            ("mnist", "0.5"): 88.75, ("mnist", "0.3"): 85.16, ("mnist", "0.1"): 59.97, ("mnist", "0.01"): 38.83,
            ("fmnist", "0.5"): 77.20, ("fmnist", "0.3"): 76.39, ("fmnist", "0.1"): 50.48, ("fmnist", "0.01"): 46.02,
            ("mnist", "2c/c"): 40.81, ("fmnist", "2c/c"): 39.06,
        },
    },
}
METHOD_ORDER = ["fedavg", "ot", "feddf", "dense", "coboosting", "fedcvae", "fedmho", "fedmho-md", "fedmho-sd",
                "fedhydra"]


def _cell(record: dict) -> str:
    return record.get("cell") or ("2c/c" if record["partition"] == "2c/c" else f"{record['alpha']:g}")


def _stat(values: list[float], scale: float = 100.0, digits: int = 2) -> str:
    if not values:
        return "–"
    mean = statistics.fmean(values) * scale
    std = statistics.pstdev(values) * scale if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {std:.{digits}f} ({len(values)})"


def latest(records: list[dict]) -> list[dict]:
    keep: dict[tuple, dict] = {}
    for r in sorted(records, key=lambda r: r.get("recorded_at", "")):
        keep[(r["method"], r["dataset"], _cell(r), r["seed"], r.get("num_clients"))] = r
    return list(keep.values())


def render_table(name: str, records: list[dict]) -> str:
    records = latest(records)
    methods = sorted({r["method"] for r in records},
                     key=lambda m: (METHOD_ORDER.index(m) if m in METHOD_ORDER else 99, m))
    cells = sorted({(r["dataset"], _cell(r), r.get("num_clients")) for r in records},
                   key=lambda c: (c[0], c[1] == "2c/c", -float(c[1]) if c[1] != "2c/c" else 0, c[2] or 0))
    by = defaultdict(list)
    for r in records:
        by[(r["dataset"], _cell(r), r.get("num_clients"), r["method"])].append(r)
    refs = REFERENCES.get(name, {})
    lines = [f"## {name}", "",
             "Top-1 test accuracy (%) of the final global model, mean ± std over seeds (n). "
             "`ens` = the method's teacher ensemble on the test set (label-free).", ""]
    head = ["dataset", "cell", "K"] + methods + [f"{m} ens" for m in methods if m in ("dense", "fedhydra")] + list(refs)
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dataset, cell, k in cells:
        row = [dataset, cell, str(k)]
        row += [_stat([r["accuracy_final"] for r in by[(dataset, cell, k, m)]]) for m in methods]
        row += [_stat([r["ensemble_accuracy"] for r in by[(dataset, cell, k, m)] if r.get("ensemble_accuracy") is not None])
                for m in methods if m in ("dense", "fedhydra")]
        row += [f"{refs[label].get((dataset, cell), float('nan')):.2f}" for label in refs]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Best-epoch accuracy (optimistic: picked on the test set, reported, never used):", ""]
    head = ["dataset", "cell", "K"] + methods
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dataset, cell, k in cells:
        row = [dataset, cell, str(k)] + [_stat([r["accuracy_best"] for r in by[(dataset, cell, k, m)]]) for m in methods]
        lines.append("| " + " | ".join(row) + " |")
    lines += ["", "Wall time per phase (s, mean over seeds; local = sum over clients, trained one after "
              "another):", ""]
    phases = ["local", "stratification", "distillation", "evaluation", "server_total", "total"]
    head = ["dataset", "cell", "method"] + phases
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for dataset, cell, k in cells:
        for m in methods:
            rs = by[(dataset, cell, k, m)]
            if not rs:
                continue
            vals = [f"{statistics.fmean(r['wall_s'].get(p, 0.0) for r in rs):.1f}" for p in phases]
            lines.append("| " + " | ".join([dataset, cell, m] + vals) + " |")
    some = records[0]
    versions = sorted({r.get("code_version", "?") for r in records})
    lines += ["", f"Machine: {some['machine']['cpus']} CPUs ({some['machine']['processor']}), "
              f"GPU: {some['machine']['gpu'] or 'none'}; preset(s): {', '.join(sorted({r['preset'] for r in records}))}; "
              f"code: {', '.join(versions)}; records: `benchmarks/results/{name}.jsonl`.", ""]
    return "\n".join(lines)


def render(out: Path | None = None) -> Path:
    records = load_records()
    tables = defaultdict(list)
    for r in records:
        tables[r["table"]].append(r)
    parts = ["# Benchmark results", "",
             "Generated by `python -m benchmarks.render` from the JSON records in this folder; every record "
             "names the command's settings, code version and machine. Commands: see `benchmarks/README.md`.", ""]
    parts += [render_table(name, rs) for name, rs in sorted(tables.items())]
    out = out or RESULTS_DIR / "README.md"
    out.write_text("\n".join(parts))
    return out


if __name__ == "__main__":
    print(render())
