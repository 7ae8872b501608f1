"""Compare two run folders of the same uploads (e.g. one replay before and one after a refactor): final and
teacher accuracy, and (FedHydra's runs) every U of stratification.json to the digit.

  python -m benchmarks.compare_runs RUN_A RUN_B [--out results/refactor_check.md]

Prints a markdown table (and writes it with --out): each quantity, its value in both runs, and the largest
absolute difference for the U matrices, then the server's wall seconds per phase and their ratio (reported, not
compared); exits 1 if any quantity differs. Cost: seconds (reads two run folders).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

U_KEYS = ("u", "u_r", "u_c", "used_u_r", "used_u_c")
TIMING_KEYS = ("stratification", "distillation", "evaluation", "server_fuse")


def _max_diff(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    return float(np.abs(a - b).max()) if a.size else 0.0


def compare(a: Path, b: Path) -> tuple[list[str], bool]:
    ra, rb = (json.loads((p / "result.json").read_text()) for p in (a, b))
    sa, sb = (json.loads((p / "stratification.json").read_text()) if (p / "stratification.json").is_file() else {}
              for p in (a, b))
    same = True
    lines = [f"| quantity | {a.name} | {b.name} | max abs difference |", "|---|---|---|---|"]
    for key in ("accuracy_final", "ensemble_accuracy", "mean_ensemble_accuracy"):
        va, vb = ra["global"].get(key), rb["global"].get(key)
        if va is None and vb is None:  # a method without that teacher (DENSE has no separate mean ensemble)
            continue
        same &= va == vb
        lines.append(f"| {key} | {va} | {vb} | {abs(va - vb) if None not in (va, vb) else ''} |")
    for key in U_KEYS:
        if key in sa or key in sb:
            diff = _max_diff(sa.get(key, []), sb.get(key, []))
            same &= diff == 0.0
            lines.append(f"| stratification.json {key} | | | {diff:g} |")
    code = [f"{r['provenance']['git'].get('commit')}{'-dirty' if r['provenance']['git'].get('dirty') else ''}"
            for r in (ra, rb)]
    lines.append(f"| code | {code[0]} | {code[1]} | |")
    # wall seconds are reported, never compared: two runs are the same run whatever their speed
    for key in TIMING_KEYS:
        ta, tb = ra.get("timings", {}).get(key), rb.get("timings", {}).get(key)
        if ta is not None and tb is not None:
            ratio = f"{ta / tb:.2f}x" if tb else ""
            lines.append(f"| seconds: {key} (ratio {a.name} / {b.name}) | {ta:.1f} | {tb:.1f} | {ratio} |")
    return lines, same


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_a", type=Path)
    parser.add_argument("run_b", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--title", default="Two runs of the same uploads")
    args = parser.parse_args(argv)
    lines, same = compare(args.run_a, args.run_b)
    text = "\n".join([f"# {args.title}", "", *lines, "", "Identical." if same else "They differ."]) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
