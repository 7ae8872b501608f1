"""What a table cell may claim: one definition for every renderer (benchmarks/results/*.md and the README's blocks).

- `best`: the method with the highest mean where its lead over the second is more than the pooled standard error of
  the two means, sqrt(s1^2 / n1 + s2^2 / n2) with sample variances; "a ≈ b" where it is not: three seeds cannot tell
  two methods apart by less, and a bold winner would say they can.
- `tuned_cells`: the reported cells whose records were used to choose a setting (conf/tuned_cells.toml), marked † in
  every table that shows them, with what they chose under the table.
- `uploads_refusal`: every method of a row ran on byte-identical uploads in each seed (the records' `uploads_fp`,
  benchmarks.archives), or the one line that replaces the row.
"""

from __future__ import annotations

import math
import statistics
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

TUNED_FILE = Path(__file__).resolve().parent / "conf" / "tuned_cells.toml"
REFUSED = "refused:"  # how a refused row starts, after its key cells


def best(values: dict[str, list[float]]) -> str:
    """The method with the highest mean, or "a ≈ b" where the lead is within the pooled standard error ("–" with
    fewer than two methods run, or one of the top two on a single seed)."""
    ranked = sorted(((statistics.fmean(v), m, v) for m, v in values.items() if v), reverse=True)
    if len(ranked) < 2:
        return "–"
    (m1, a, va), (m2, b, vb) = ranked[:2]
    if len(va) < 2 or len(vb) < 2:
        return "– (n < 2)"  # no standard error to tell them apart
    se = math.sqrt(statistics.variance(va) / len(va) + statistics.variance(vb) / len(vb))
    return a if m1 - m2 > se else f"{a} ≈ {b}"


@dataclass(frozen=True)
class TunedCell:
    """One reported cell used to choose a setting: what it chose, on which of its records, and where they are."""

    table: str
    dataset: str
    cell: str
    chose: str
    on: str
    records: str
    commit: str

    def note(self) -> str:
        return (f"† {self.dataset} {self.cell}: chose {self.chose}; on {self.on}; records: {self.records}; "
                f"commit {self.commit}.")


def tuned_cells(path: Path | None = None) -> dict[tuple[str, str, str], TunedCell]:
    """(records file, dataset, cell) -> its entry in the tuned-cells file (TUNED_FILE unless `path`)."""
    return _read_tuned(Path(path or TUNED_FILE))


@lru_cache(maxsize=None)
def _read_tuned(path: Path) -> dict[tuple[str, str, str], TunedCell]:
    entries = tomllib.loads(path.read_text()).get("cell", [])
    out = {}
    for entry in entries:
        cell = TunedCell(**{k: str(entry[k]) for k in TunedCell.__dataclass_fields__})
        out[(cell.table, cell.dataset, cell.cell)] = cell
    return out


def dagger(table: str, dataset: str, cell: str, path: Path | None = None) -> str:
    """" †" where (table, dataset, cell) was used to choose a setting, else ""."""
    return " †" if (table, dataset, cell) in tuned_cells(path) else ""


def tuned_notes(tables: str | tuple[str, ...], shown, path: Path | None = None) -> list[str]:
    """The notes of the tuned cells among `shown` ((dataset, cell) pairs) of the records files `tables`."""
    tables = (tables,) if isinstance(tables, str) else tables
    shown = set(shown)
    return [entry.note() for (table, dataset, cell), entry in tuned_cells(path).items()
            if table in tables and (dataset, cell) in shown]


def uploads_refusal(row: str, records: list[dict], exempt: tuple[str, ...] = ()) -> str | None:
    """None where, in every seed, the methods of a row ran on the same uploads; else one line naming the row, the seed
    and each fingerprint with its methods. `records`: the records the row shows (one per method and seed); `exempt`:
    methods that run on a fleet of their own by design (FedCVAE's all-decoder fleet, FedMHO-MD's mixed one).
    Records without `uploads_fp` are left out of the comparison: they were written before records carried it and
    cannot be checked (the release moves them to results/archive/, so that every released record carries one);
    multi-round records carry none either, each method there being its own simulation."""
    by_seed: dict[int, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        label = r.get("label") or r["method"]
        if r.get("uploads_fp") and label not in exempt:
            by_seed[r["seed"]][r["uploads_fp"]].append(label)
    for seed, fps in sorted(by_seed.items()):
        if len(fps) > 1:
            which = "; ".join(f"{', '.join(sorted(labels))}: {fp}" for fp, labels in sorted(fps.items()))
            return f"{REFUSED} {row} seed {seed}: its methods ran on different uploads ({which})"
    return None
