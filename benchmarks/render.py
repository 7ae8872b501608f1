"""Render every benchmark record into benchmarks/results/README.md (markdown tables).

  python -m benchmarks.render
For each table: one row per (dataset, cell, K[, round T]), one column per method with mean +- std
over seeds (n = seeds), the latest record per (method, dataset, cell, seed, K, T) counting, and a `best`
column (benchmarks.cells: a winner only beyond the pooled standard error). A method that cannot run on a
cell's fleet shows "n/a" with the reason under the table; a cell nobody ran shows "not run" (never a
blank); a row whose methods ran on different uploads is refused in one line; a cell used to choose a
setting carries † (conf/tuned_cells.toml). Heterogeneous fleets get one column per client model.
Reference numbers from the papers sit beside ours where a table defines them. Cost: seconds (reads
every records file).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from benchmarks.cells import best, dagger, tuned_notes, uploads_refusal
from benchmarks.records import RESULTS_DIR, load_records

def _per_method(rows: dict[tuple, list[float]], methods: list[str]) -> dict[str, dict[tuple, float]]:
    return {m: {key: values[i] for key, values in rows.items()} for i, m in enumerate(methods)}


_T1_METHODS = ["fedavg", "ot", "feddf", "dense", "coboosting", "fedhydra"]
# Every method of the FedHydra paper (NEWER version) as published, per table shape: the setups differ
# from ours (E = 200 local epochs, 200 KD epochs, best-over-epochs accuracy), see the FedHydra paper, Sec. 4.1.
PUBLISHED = {
    "paper_table": ("FedHydra paper, NEWER Tables 1-2", _per_method({
        ("mnist", "0.5"): [81.89, 77.45, 78.23, 77.86, 86.76, 88.75],
        ("mnist", "0.3"): [69.89, 77.32, 73.59, 76.78, 83.47, 85.16],
        ("mnist", "0.1"): [25.96, 50.18, 31.52, 36.73, 44.76, 59.97],
        ("mnist", "0.01"): [10.10, 25.63, 10.10, 11.17, 29.11, 38.83],
        ("fmnist", "0.5"): [75.76, 74.88, 73.44, 74.20, 75.89, 77.20],
        ("fmnist", "0.3"): [74.81, 66.91, 65.61, 72.79, 72.91, 76.39],
        ("fmnist", "0.1"): [35.35, 41.10, 46.68, 43.26, 47.20, 50.48],
        ("fmnist", "0.01"): [33.71, 39.56, 40.36, 41.65, 42.38, 46.02],
        ("mnist", "2c/c"): [20.50, 8.92, 13.38, 15.58, 26.05, 40.81],
        ("fmnist", "2c/c"): [32.73, 16.98, 15.33, 22.31, 18.22, 39.06],
        ("cifar10", "0.5"): [38.26, 52.88, 54.81, 58.48, 62.88, 63.15],
        ("cifar10", "0.3"): [25.54, 47.10, 50.82, 51.57, 54.74, 57.66],
        ("cifar10", "0.1"): [23.87, 36.19, 33.06, 42.56, 45.83, 48.12],
        ("cifar10", "0.01"): [14.96, 30.12, 19.91, 32.69, 35.10, 40.63],
        ("cifar10", "2c/c"): [9.22, 12.15, 24.28, 31.36, 33.84, 39.09],
    }, _T1_METHODS)),
    # Table 3: CIFAR-10, clients GoogLeNet / ResNet-18 / CNN / CNN / LeNet, server ResNet-18
    "hetero_cifar10": ("FedHydra paper, NEWER Table 3 (clients: 49.33/61.08/47.65/54.14/48.25 at 0.5)", _per_method({
        ("cifar10", "0.5"): [56.27, 51.29, 53.76, 59.23],
        ("cifar10", "0.3"): [46.96, 44.54, 45.61, 48.80],
        ("cifar10", "0.1"): [27.39, 26.43, 26.82, 30.90],
        ("cifar10", "0.01"): [22.25, 18.67, 25.63, 30.51],
    }, ["feddf", "dense", "coboosting", "fedhydra"])),
    # Table 5: CIFAR-10, alpha = 0.1, T global rounds (local E = 50)
    "multiround": ("FedHydra paper, NEWER Table 5 (CIFAR-10, alpha 0.1, E = 50)", _per_method({
        ("cifar10", "0.1", 1): [22.72, 18.33, 21.33, 29.60, 31.68, 37.95],
        ("cifar10", "0.1", 2): [37.32, 26.38, 28.63, 32.39, 37.93, 46.52],
        ("cifar10", "0.1", 3): [35.95, 39.54, 30.36, 36.42, 46.23, 48.75],
        ("cifar10", "0.1", 4): [43.86, 36.88, 30.71, 38.85, 46.84, 50.17],
        ("cifar10", "0.1", 5): [41.99, 39.96, 28.82, 37.27, 45.20, 49.34],
    }, _T1_METHODS)),
}
# Best published number for FedHydra's cells (max over the FedHydra and DENSE papers), the target
# of the paper table, and the FedHydra paper's own numbers (its Tables 1-2 above).
REFERENCES = {
    "paper_table": {
        "target (best published)": {
            ("mnist", "0.5"): 95.82, ("mnist", "0.3"): 85.16, ("mnist", "0.1"): 66.61, ("mnist", "0.01"): 38.83,
            ("fmnist", "0.5"): 85.94, ("fmnist", "0.3"): 83.96, ("fmnist", "0.1"): 50.48, ("fmnist", "0.01"): 46.02,
            ("mnist", "2c/c"): 40.81, ("fmnist", "2c/c"): 39.06,
            ("cifar10", "0.5"): 63.15, ("cifar10", "0.3"): 59.76, ("cifar10", "0.1"): 50.26,
            ("cifar10", "0.01"): 40.63, ("cifar10", "2c/c"): 39.09,
        },
        "FedHydra paper": PUBLISHED["paper_table"][1]["fedhydra"],
    },
    # FedLMD paper, Table 3b (MNIST Dirichlet 0.1) and Table 3a (MNIST, two label-sorted shards per client, the
    # nearest to our 2c/c); it reports no MNIST number for FedLMD-Tf (its Table 2: CIFAR-10 alpha 0.05 only)
    "multiround_fedlmd": {
        "FedLMD paper fedavg": {("mnist", "0.1"): 85.19, ("mnist", "2c/c"): 85.41},
        "FedLMD paper fedlmd": {("mnist", "0.1"): 88.61, ("mnist", "2c/c"): 88.48},
    },
}
# The setup behind a table's reference columns where it is not ours (printed under the table)
REFERENCE_SETUPS = {
    "multiround_fedlmd": "FedLMD paper columns: K = 100 clients, 10 per round, 200 rounds of E = 5 local epochs, "
                         "its 2-conv CNN, SGD 0.01 x 0.99 per round, batch 50, the best round's test accuracy; its "
                         "2c/c column is two label-sorted shards per client. Ours: 5 clients, all in every round, T "
                         "rounds of the cpu preset, the final model of round T.",
}

METHOD_ORDER = ["fedavg", "fedlmd", "fedlmd-tf", "ot", "feddf", "dense", "coboosting", "fedcvae", "fedmho",
                "fedmho-md", "fedmho-sd", "fedhydra-paper", "fedhydra"]
NOT_RUN = "not run"
# tables with their own report: results/scale.md (benchmarks.scale), results/robustness.md (benchmarks.robustness),
# results/ablation.md (benchmarks.ablation), results/reference_runs.md (benchmarks.reference_runs),
# results/gpu_cells.md, hetero_diag.md, fedhydra_teacher.md (its replays' records too) and cifar10_budget.md (one
# records file per local budget) (experiments/): probes' records stay out of the tables
OWN_RENDERER = {"scale", "robustness", "ablation", "gpu_cells", "hetero_diag", "fedhydra_teacher",
                "fedhydra_teacher_replays", "reference_runs", "reference_runs_failed"}


def _cell(record: dict) -> str:
    return record.get("cell") or ("2c/c" if record["partition"] == "2c/c" else f"{record['alpha']:g}")


def _stat(values: list[float], scale: float = 100.0, digits: int = 2) -> str:
    if not values:
        return NOT_RUN
    mean = statistics.fmean(values) * scale
    std = statistics.pstdev(values) * scale if len(values) > 1 else 0.0
    return f"{mean:.{digits}f} ± {std:.{digits}f} ({len(values)})"


def _round(record: dict) -> int | None:
    """The global round of a multi-round record (None for one-shot tables)."""
    return record.get("round") if record.get("num_rounds", 1) > 1 else None


def _row_key(record: dict) -> tuple:
    return (record["dataset"], _cell(record), record.get("num_clients"), _round(record))


def method_label(record: dict) -> str:
    """The table column of a record: its method, or a named variant of it (e.g. fedhydra-paper)."""
    return record.get("label") or record["method"]


def latest(records: list[dict]) -> list[dict]:
    keep: dict[tuple, dict] = {}
    for r in sorted(records, key=lambda r: r.get("recorded_at", "")):
        keep[(method_label(r), r["seed"], *_row_key(r))] = r
    return list(keep.values())


class _Cells:
    """Formats one table cell per (row, method): statistics, "n/a" with a numbered reason, "not run"."""

    def __init__(self, by: dict):
        self.by, self.reasons = by, {}

    def __call__(self, key: tuple, method: str, field: str) -> str:
        records = self.by[(*key, method)]
        done = [r[field] for r in records if r.get("status") != "not-applicable" and r.get(field) is not None]
        if done:
            return _stat(done)
        if records and all(r.get("status") == "not-applicable" for r in records):
            number = self.reasons.setdefault(records[-1]["reason"], len(self.reasons) + 1)
            return f"n/a [{number}]"
        return NOT_RUN

    def notes(self) -> list[str]:
        return [f"[{n}] not applicable: {reason}" for reason, n in self.reasons.items()]


def _client_columns(records: list[dict]) -> list[tuple[int, str]]:
    """(position, arch) of every client when the fleet is heterogeneous (FedHydra Table 3 shape)."""
    archs = next((r["client_archs"] for r in records if r.get("client_archs")), [])
    return list(enumerate(archs)) if len(set(archs)) > 1 else []


def _client_stat(records: list[dict], position: int) -> str:
    values = {r["seed"]: r["client_accuracy"][position] for r in records
              if len(r.get("client_accuracy") or []) > position and r["client_accuracy"][position] is not None}
    return _stat(list(values.values()))


def _best_client_stat(records: list[dict]) -> str:
    """The fleet's best client per seed (what a user who kept one client's model would have), over seeds."""
    best = {r["seed"]: max(a for a in r["client_accuracy"] if a is not None) for r in records
            if any(a is not None for a in r.get("client_accuracy") or [])}
    return _stat(list(best.values()))


def _mixed_fleets(rows: list[tuple], by: dict, methods: list[str]) -> list[str]:
    """A warning per (row, seed) whose methods ran on fleets whose clients score differently: a fleet trained again
    (a method's own training run, say) is the same fleet only where its clients score the same. Positions without a
    score (a decoder client, a method that skips a client) agree with any score."""
    lines = []
    for key in rows:
        fleets: dict[int, list[tuple[list, list[str]]]] = defaultdict(list)
        for m in methods:
            for r in by[(*key, m)]:
                scores = r.get("client_accuracy") or []
                if not any(a is not None for a in scores):
                    continue
                seen = fleets[r["seed"]]
                match = next((f for f in seen if all(a is None or b is None or a == b
                                                     for a, b in zip(f[0], scores))), None)
                if match is None:
                    seen.append((list(scores), [m]))
                else:
                    match[1].append(m)
        for seed, seen in sorted(fleets.items()):
            if len(seen) > 1:
                which = "; ".join(f"{', '.join(ms)}: clients "
                                  + ", ".join("-" if a is None else f"{100 * a:.1f}" for a in scores)
                                  for scores, ms in seen)
                lines.append(f"‡ {key[0]} {key[1]} seed {seed}: these methods ran on {len(seen)} different "
                             f"fleets ({which}); the client columns show one of them.")
    return lines


def render_table(name: str, records: list[dict]) -> str:
    records = latest(records)
    methods = sorted({method_label(r) for r in records},
                     key=lambda m: (METHOD_ORDER.index(m) if m in METHOD_ORDER else 99, m))
    rows = sorted({_row_key(r) for r in records},
                  key=lambda c: (c[0], c[1] == "2c/c", -float(c[1]) if c[1] != "2c/c" else 0, c[2] or 0, c[3] or 0))
    multi_round = any(key[3] is not None for key in rows)
    by = defaultdict(list)
    for r in records:
        by[(*_row_key(r), method_label(r))].append(r)
    cells = _Cells(by)
    clients = _client_columns(records)
    refs = REFERENCES.get(name, {})
    ens_methods = [m for m in methods
                   if any(r.get("ensemble_accuracy") is not None for r in records if method_label(r) == m)]

    def keys(key):
        return [key[0], key[1] + dagger(name, key[0], key[1]), str(key[2])] + ([str(key[3])] if multi_round else [])

    def accuracies(key) -> dict[str, list[float]]:
        return {m: [r["accuracy_final"] for r in by[(*key, m)]
                    if r.get("status") != "not-applicable" and r.get("accuracy_final") is not None] for m in methods}

    base = ["dataset", "cell", "K"] + (["T"] if multi_round else [])
    lines = [f"## {name}", "",
             "Top-1 test accuracy (%) of the final global model, mean ± std over seeds (n) (the best epoch, "
             "picked on test data, is never shown). `ens` = the teacher the method distils from, on the test set "
             "without labels"
             + ("; `client pN (arch)` = that client's local model on the test set, `best client` = the best of "
                "them in each seed" if clients else "")
             + ("; T = global round (multi-round mode)" if multi_round else "") + ".", ""]
    head = (base + methods + ["best"] + [f"{m} ens" for m in ens_methods] + [f"client p{i} ({a})" for i, a in clients]
            + (["best client"] if clients else []) + list(refs))
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in rows:
        shown = [r for m in methods for r in by[(*key, m)]]
        if refusal := uploads_refusal(f"{name} {key[0]} {key[1]} K={key[2]}", shown):
            lines.append("| " + " | ".join(keys(key) + [refusal]) + " |")
            continue
        row = keys(key) + [cells(key, m, "accuracy_final") for m in methods] + [best(accuracies(key))]
        row += [cells(key, m, "ensemble_accuracy") for m in ens_methods]
        everyone = [r for m in methods for r in by[(*key, m)]]
        row += [_client_stat(everyone, i) for i, _ in clients] + ([_best_client_stat(everyone)] if clients else [])
        row += [f"{refs[label][key[:2]]:.2f}" if key[:2] in refs[label] else "–" for label in refs]
        lines.append("| " + " | ".join(row) + " |")
    lines += [""] + cells.notes() + ([""] if cells.reasons else [])
    mixed = _mixed_fleets(rows, by, methods) if clients else []
    lines += mixed + ([""] if mixed else [])
    tuned = tuned_notes(name, {k[:2] for k in rows})
    lines += tuned + ([""] if tuned else [])
    if name in REFERENCE_SETUPS:
        lines += [REFERENCE_SETUPS[name], ""]
    if name in PUBLISHED:
        source, published = PUBLISHED[name]
        shown = [m for m in methods if m in published]
        lines += ["", f"Published ({source}; other setups, same cells):", ""]
        lines += ["| " + " | ".join(base + shown) + " |", "|" + "---|" * len(base + shown)]
        for key in rows:
            pkey = key[:2] + ((key[3],) if multi_round else ())
            lines.append("| " + " | ".join(keys(key) + [f"{published[m][pkey]:.2f}" if pkey in published[m]
                                                       else "–" for m in shown]) + " |")
    lines += ["", "Wall time per phase (s, mean over seeds; local = sum over clients, trained one after "
              "another):", ""]
    phases = ["local", "stratification", "alignment", "distillation", "evaluation", "server_total", "total"]
    head = base + ["method"] + phases
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key in rows:
        for m in methods:
            rs = [r for r in by[(*key, m)] if r.get("status") != "not-applicable"]
            if not rs:
                continue
            vals = [f"{statistics.fmean(r['wall_s'].get(p, 0.0) for r in rs):.1f}" for p in phases]
            lines.append("| " + " | ".join(keys(key) + [m] + vals) + " |")
    lines += budget_lines(records)
    some = records[0]
    versions = sorted({r.get("code_version", "?") for r in records})
    lines += ["", f"Machine: {some['machine']['cpus']} CPUs ({some['machine']['processor']}), "
              f"GPU: {some['machine']['gpu'] or 'none'}; "
              f"preset(s): {', '.join(sorted({r['preset'] for r in records}))}; "
              f"code: {', '.join(versions)}; records: `benchmarks/results/{name}.jsonl`.", ""]
    return "\n".join(lines)


BUDGET_PREFIXES = ("local.", "distill.", "eval.")


def budget_lines(records: list[dict]) -> list[str]:
    """One line per dataset whose records changed the preset's training budget (e.g. CIFAR-10 on 2 cores),
    so a reader sees which rows ran on less than the preset."""
    budgets: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for r in records:
        for key, value in (r.get("overrides") or {}).items():
            if key.startswith(BUDGET_PREFIXES):
                budgets[r["dataset"]][key].add(str(value))
    return ([""] + [f"Budget set on the command line (over the preset), {dataset}: "
                    + ", ".join(f"{k}={'/'.join(sorted(v))}" for k, v in sorted(keys.items())) + "."
                    for dataset, keys in sorted(budgets.items())]) if budgets else []


def render(out: Path | None = None) -> Path:
    records = load_records()
    tables = defaultdict(list)
    for r in records:
        # robustness_<name> too; clients-k<K> and dp-eps<e> tables: benchmarks.clients_table / dp_table render them
        if r["table"] not in OWN_RENDERER and not r["table"].startswith(("robustness", "clients-k", "dp-eps",
                                                                          "cifar10_budget")):
            tables[r["table"]].append(r)
    parts = ["# Benchmark results", "",
             "Generated by `python -m benchmarks.render` from the JSON records in this folder; every record "
             "names the command's settings, code version and machine. Commands: see `benchmarks/README.md`.", ""]
    parts += [render_table(name, rs) for name, rs in sorted(tables.items())]
    out = out or RESULTS_DIR / "README.md"
    out.write_text("\n".join(parts))
    return out


if __name__ == "__main__":
    import sys

    if "--readme" in sys.argv[1:]:  # the README's blocks: benchmarks.readme (which imports this module)
        from benchmarks.readme import main as readme_main

        sys.exit(readme_main(["--print"]))
    print(render())
