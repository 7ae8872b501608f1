"""The README's results blocks, generated from the committed records.

Each block sits in README.md between `<!-- begin: table NAME -->` and `<!-- end: table NAME -->` and ends with one
provenance line (it starts with PROVENANCE: the records files, code versions and how many records came from a dirty
tree, machines, budget, wall time). Rules every block follows:
  - a cell is mean±std over seeds (n), from the latest record per method, row and seed; a cell without a record
    is "not run", never a blank or a number from elsewhere;
  - `fedhydra` (the default) counts only records of the current default: DEFAULT_SINCE or a later commit of this
    history, not a dirty tree (set DEFAULT_SINCE to the commit that changes FedHydra's default);
  - the `best` column names the method with the highest mean where its lead over the second is more than the pooled
    standard error of the two means (sqrt(s1^2 / n1 + s2^2 / n2)), and says "a ≈ b" where it is not (cells.best);
  - † marks a cell whose records were used to choose a setting (conf/tuned_cells.toml);
  - a row whose methods ran on different uploads in a seed is refused: one line naming the fingerprints replaces it
    (cells.uploads_refusal).

  python -m benchmarks.readme            # rewrite the blocks of README.md from the records
  python -m benchmarks.readme --check    # exit 1 naming every block that differs from what the records render
  python -m benchmarks.readme --print    # print the blocks

Cost: seconds (reads the records; asks git once per code version).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from collections import defaultdict
from functools import lru_cache
from pathlib import Path

from benchmarks.cells import best, dagger, uploads_refusal
from benchmarks.records import REPO_ROOT, load_records
from benchmarks.render import NOT_RUN, REFERENCES, _cell, latest, method_label

README = REPO_ROOT / "README.md"
PROVENANCE = "Provenance (generated):"
# The commit that set FedHydra's current default: the README shows `fedhydra` from records of it or later commits.
DEFAULT_SINCE = "9725813"
BLOCK = re.compile(r"(<!-- begin: table (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end: table (?P=name) -->)",
                   re.DOTALL)

PAPER_CELLS = [(d, c) for d in ("mnist", "fmnist") for c in ("0.5", "0.3", "0.1", "0.01", "2c/c")] + [
    ("cifar10", "0.5"), ("cifar10", "0.1")]
PAPER_METHODS = ("fedavg", "feddf", "dense", "coboosting", "fedhydra-paper", "fedhydra")
HETERO_FLEETS = (("hetero_grey", "grey", ("mnist", "fmnist")), ("hetero_cifar10", "CIFAR-10", ("cifar10",)))
HETERO_METHODS = ("feddf", "dense", "coboosting", "fedhydra")
CLIENTS_METHODS = ("fedavg", "dense", "coboosting", "fedhydra")
DP_METHODS = ("fedavg", "dense", "fedhydra", "fedmho-md")
ROBUSTNESS_METHODS = ("dense", "fedhydra-paper", "fedhydra")
ROBUSTNESS_VARIANTS = ("minus", "flip", "scale10")
BUDGET_PREFIXES = ("local.", "distill.", "eval.", "fedhydra.ms-steps")
MAX_LISTED = 8  # code versions a provenance line lists one by one (more: their count, and FedHydra's)


@lru_cache(maxsize=None)
def is_current_default(version: str) -> bool:
    """A record's code version is DEFAULT_SINCE or a later commit of this history (not a dirty tree)."""
    if not version or version.endswith("-dirty"):
        return False
    done = subprocess.run(["git", "merge-base", "--is-ancestor", DEFAULT_SINCE, version], cwd=REPO_ROOT,
                          capture_output=True, timeout=10)
    return done.returncode == 0


def shown(records: list[dict]) -> list[dict]:
    """The records a block may show: run (not "not applicable"), and `fedhydra` only of the current default."""
    return [r for r in records if r.get("status") != "not-applicable"
            and (method_label(r) != "fedhydra" or is_current_default(r.get("code_version", "")))]


def stat(values: list[float]) -> str:
    """A cell: mean±std (n) in % (population std over the seeds), or "not run"."""
    if not values:
        return NOT_RUN
    std = statistics.pstdev(values) if len(values) > 1 else 0.0
    return f"{100 * statistics.fmean(values):.2f}±{100 * std:.2f} ({len(values)})"


def table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def newest(records: list[dict], key) -> list[dict]:
    """The latest record per (method, row key, seed)."""
    keep: dict[tuple, dict] = {}
    for r in sorted(records, key=lambda r: r.get("recorded_at", "")):
        keep[(method_label(r), key(r), r["seed"])] = r
    return list(keep.values())


def by_row(records: list[dict], key) -> dict[tuple, list[dict]]:
    """row key -> the latest record per (method, row, seed)."""
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in newest(records, key):
        out[key(r)].append(r)
    return out


def method_cells(values: dict[str, list[float]], methods) -> list[str]:
    return [stat(values.get(m, [])) for m in methods] + [best({m: values.get(m, []) for m in methods})]


def row_cells(row: str, records: list[dict], methods, exempt: tuple[str, ...] = ()) -> list[str]:
    """A row's cells per method and its `best`, or the one cell refusing it where its methods ran on different
    uploads in a seed."""
    shown = [r for r in records if method_label(r) in methods]
    if refusal := uploads_refusal(row, shown, exempt):
        return [refusal]
    values: dict[str, list[float]] = defaultdict(list)
    for r in shown:
        values[method_label(r)].append(r["accuracy_final"])
    return method_cells(values, methods)


def provenance(files: list[str], records: list[dict]) -> str:
    """One line: records files (under benchmarks/results), code versions (dirty ones counted), machines, budget,
    wall time (each fleet's client training once, every record's server)."""
    versions = defaultdict(int)
    for r in records:
        versions[r.get("code_version", "?")] += 1
    dirty = sum(n for v, n in versions.items() if v.endswith("-dirty"))
    machines = sorted({f"{m.get('cpus')} CPUs ({m.get('cpu') or m.get('processor')}), "
                       f"{'GPU ' + m['gpu'] if m.get('gpu') else 'no GPU'}"
                       for r in records if (m := r.get("machine"))})
    budget: dict[str, dict[str, set]] = defaultdict(lambda: defaultdict(set))
    for r in records:
        for k, v in (r.get("overrides") or {}).items():
            if k.startswith(BUDGET_PREFIXES) and k != "local.dp.epsilon":  # the DP table's variable, not budget
                budget[r["dataset"]][k].add(str(v))
    presets = sorted({r.get("preset", "?") for r in records})
    budget_text = f"{', '.join(presets)} preset" + "".join(
        f", {d} " + " ".join(f"{k}={'/'.join(sorted(v))}" for k, v in sorted(keys.items()))
        for d, keys in sorted(budget.items()))
    fleets: dict[tuple, float] = {}
    for r in records:  # a fleet's clients trained once, whatever number of methods replayed its uploads
        fleet = (r.get("table"), r.get("dataset"), _cell(r), r.get("num_clients"), r.get("seed"), r.get("uploads_id"))
        fleets[fleet] = max(fleets.get(fleet, 0.0), (r.get("wall_s") or {}).get("local", 0.0))
    server = sum((r.get("wall_s") or {}).get("server_total", 0.0) for r in records)
    listed = (", ".join(f"{v} ({n})" for v, n in sorted(versions.items())) if len(versions) <= MAX_LISTED
              else f"{len(versions)} versions")
    fedhydra = sorted({r.get("code_version", "?") for r in records if method_label(r) == "fedhydra"})
    return (f"{PROVENANCE} records {', '.join(files)} in benchmarks/results; code {listed}, {dirty} of "
            f"{len(records)} records from a dirty tree"
            + (f" (fedhydra: {', '.join(fedhydra)})" if fedhydra and len(versions) > MAX_LISTED else "")
            + f"; machine {'; '.join(machines) or 'unknown'}; budget {budget_text}; wall time "
            f"{sum(fleets.values()) / 3600:.1f} h clients + {server / 3600:.1f} h server.")


def paper_block() -> str:
    records = shown(load_records("paper_table"))
    rows = by_row(records, lambda r: (r["dataset"], _cell(r)))
    target = REFERENCES["paper_table"]["target (best published)"]
    body = [[d, c + dagger("paper_table", d, c), *row_cells(f"paper_table {d} {c}", rows[(d, c)], PAPER_METHODS),
             f"{target[(d, c)]:.2f}"] for d, c in PAPER_CELLS]
    used = [r for r in records if (r["dataset"], _cell(r)) in PAPER_CELLS and method_label(r) in PAPER_METHODS]
    return "\n".join(table(["dataset", "cell", *PAPER_METHODS, "best", "best published"], body)
                     + ["", provenance(["paper_table.jsonl"], newest(used, lambda r: (r["dataset"], _cell(r))))])


def hetero_block() -> str:
    body, used = [], []
    for name, label, datasets in HETERO_FLEETS:
        records = [r for r in shown(load_records(name)) if r.get("num_clients") == 5]
        rows = by_row(records, lambda r: (r["dataset"], _cell(r)))
        clients: dict[tuple, dict[int, float]] = defaultdict(dict)
        for r in latest(records):  # the best client of each seed's fleet
            if r.get("client_accuracy"):
                clients[(r["dataset"], _cell(r))][r["seed"]] = max(r["client_accuracy"])
        for d in datasets:
            for c in ("0.5", "0.1"):
                body.append([label, d, c + dagger(name, d, c), *row_cells(f"{name} {d} {c}", rows[(d, c)],
                                                                          HETERO_METHODS),
                             stat(list(clients[(d, c)].values()))])
        used += newest([r for r in records if method_label(r) in HETERO_METHODS], lambda r: (r["dataset"], _cell(r)))
    return "\n".join(table(["fleet", "dataset", "cell", *HETERO_METHODS, "best", "best client"], body)
                     + ["", provenance([f"{name}.jsonl" for name, _, _ in HETERO_FLEETS], used)])


def recorded_ks() -> list[int]:
    return sorted(int(m.group(1)) for p in (REPO_ROOT / "benchmarks" / "results").glob("clients-k*.jsonl")
                  if (m := re.fullmatch(r"clients-k(\d+)\.jsonl", p.name)))


def clients_block(dataset: str = "fmnist", cell: str = "0.5") -> str:
    body, used = [], []
    for k in recorded_ks():
        records = newest([r for r in shown(load_records(f"clients-k{k}"))
                          if r["dataset"] == dataset and _cell(r) == cell and method_label(r) in CLIENTS_METHODS],
                         lambda r: r["num_clients"])
        rows = by_row(records, lambda r: r["num_clients"])
        body.append([f"{k}{dagger(f'clients-k{k}', dataset, cell)}",
                     *row_cells(f"clients-k{k} {dataset} {cell}", rows[k], CLIENTS_METHODS)])
        used += records
    return "\n".join(table(["K", *CLIENTS_METHODS, "best"], body)
                     + ["", provenance(["clients-k*.jsonl"], used)])


def dp_block() -> str:
    """Accuracy against epsilon at the preset's distillation budget, one row per dataset, epsilon and client
    epochs (DP-SGD passes with DP, SGD epochs without)."""
    files = sorted(p.name for p in (REPO_ROOT / "benchmarks" / "results").glob("dp-eps*.jsonl"))
    records = [r for f in files for r in shown(load_records(f.removesuffix(".jsonl")))
               if "distill.epochs" not in (r.get("overrides") or {}) and method_label(r) in DP_METHODS]

    def key(r):
        epsilon = (r.get("overrides") or {}).get("local.dp.epsilon", 0.0)
        sets = r.get("overrides") or {}
        epochs = sets.get("local.dp.epochs" if epsilon else "local.epochs", sets.get("local.epochs", 10))
        return r["dataset"], float(epsilon), int(epochs)

    rows = by_row(records, key)
    order = sorted(rows, key=lambda k: (k[0], k[2], k[1] == 0, k[1]))
    body = [[d, "no DP" if e == 0 else f"{e:g}", str(n),
             *row_cells(f"dp-eps{e:g} {d}", rows[(d, e, n)], DP_METHODS, exempt=("fedmho-md",))]
            for d, e, n in order]  # FedMHO-MD serves a fleet of its own (5 classifier + 5 decoder clients)
    return "\n".join(table(["dataset", "epsilon", "client epochs", *DP_METHODS, "best"], body)
                     + ["", provenance(["dp-eps*.jsonl"], newest(records, key))])


def robustness_block() -> str:
    records = [r for r in shown(load_records("robustness"))
               if r.get("variant") in ROBUSTNESS_VARIANTS and method_label(r) in ROBUSTNESS_METHODS]
    newest: dict[tuple, dict] = {}
    for r in sorted(records, key=lambda r: r.get("recorded_at", "")):
        newest[(method_label(r), r["dataset"], r["cell"], r["seed"], r["variant"], r["victim"])] = r
    rows: dict[tuple, list[dict]] = defaultdict(list)
    for (_label, dataset, cell, _seed, variant, _victim), r in newest.items():
        rows[(dataset, cell, variant)].append(r)
    order = sorted(rows, key=lambda k: (k[0], k[1], ROBUSTNESS_VARIANTS.index(k[2])))
    body = [[d, c + dagger("robustness", d, c), v,
             *row_cells(f"robustness {d} {c} {v}", rows[(d, c, v)], ROBUSTNESS_METHODS)] for d, c, v in order]
    return "\n".join(table(["dataset", "cell", "client 0", *ROBUSTNESS_METHODS, "best"], body)
                     + ["", provenance(["robustness.jsonl"], list(newest.values()))])


BLOCKS = {"paper": paper_block, "hetero": hetero_block, "clients": clients_block, "dp": dp_block,
          "robustness": robustness_block}


def render_readme(text: str) -> tuple[str, list[str]]:
    """(text with every generated block rendered again, the names of the blocks that changed). A block name the
    renderer does not know is an error (a typo would otherwise leave a stale block in place)."""
    changed = []

    def fill(match: re.Match) -> str:
        name = match.group("name")
        if name not in BLOCKS:
            raise KeyError(f"README block {name!r}: known blocks are {', '.join(BLOCKS)}")
        body = BLOCKS[name]() + "\n"
        if body != match.group("body"):
            changed.append(name)
        return match.group(1) + body + match.group(4)

    return BLOCK.sub(fill, text), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--file", type=Path, default=README)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a block differs")
    parser.add_argument("--print", action="store_true", help="print every block")
    args = parser.parse_args(argv)
    if args.print:
        print("\n\n".join(f"<!-- begin: table {name} -->\n{block()}\n<!-- end: table {name} -->"
                          for name, block in BLOCKS.items()))
        return 0
    text = args.file.read_text()
    new, changed = render_readme(text)
    if args.check:
        if changed:
            print(f"{args.file}: generated block(s) {', '.join(changed)} differ from what the records render "
                  "(python -m benchmarks.readme rewrites them)", file=sys.stderr)
            return 1
        return 0
    args.file.write_text(new)
    print(json.dumps({"file": str(args.file), "rewritten": changed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
