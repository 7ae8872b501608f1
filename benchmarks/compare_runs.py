"""Compare two run folders of the same uploads (e.g. one replay before and one after a refactor): final and
teacher accuracy, the accuracy of every evaluated epoch, and, where the method writes one (FedHydra),
stratification.json to the digit: every U, then every other entry (wall seconds excepted).

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


def _leaves(value, prefix: str = "") -> dict[str, object]:
    """{"a.b.0": leaf} of a JSON value: every number, string, bool or null, by its path."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _leaves(item, f"{prefix}{key}.").items()}
    if isinstance(value, list):
        return {k: v for i, item in enumerate(value) for k, v in _leaves(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}


def _grouped(paths) -> list[str]:
    """Leaf paths by their entry: "peer_check.u (50 values)" for the 50 leaves of the list peer_check.u."""
    counts: dict[str, int] = {}
    for path in paths:
        parts = path.split(".")
        while parts and parts[-1].isdigit():
            parts.pop()
        counts[".".join(parts)] = counts.get(".".join(parts), 0) + 1
    return [f"{entry} ({n} value{'s' if n > 1 else ''})" for entry, n in sorted(counts.items())]


def _strat(path: Path) -> dict | None:
    file = path / "stratification.json"
    return json.loads(file.read_text()) if file.is_file() else None


def compare(a: Path, b: Path) -> tuple[list[str], bool]:
    ra, rb = (json.loads((p / "result.json").read_text()) for p in (a, b))
    sa, sb = _strat(a), _strat(b)
    same = True
    lines = [f"| quantity | {a.name} | {b.name} | max abs difference |", "|---|---|---|---|"]
    for key in ("accuracy_final", "ensemble_accuracy", "mean_ensemble_accuracy"):
        va, vb = ra["global"].get(key), rb["global"].get(key)
        if va is None and vb is None:  # a method without that teacher (DENSE has no separate mean ensemble)
            continue
        same &= va == vb
        lines.append(f"| {key} | {va} | {vb} | {abs(va - vb) if None not in (va, vb) else ''} |")
    ha, hb = ([h.get("accuracy") for h in r.get("history", [])] for r in (ra, rb))
    if ha or hb:
        diffs = [abs(x - y) for x, y in zip(ha, hb) if None not in (x, y)]
        same_history = ha == hb
        same &= same_history
        lines.append(f"| accuracy of every evaluated epoch ({len(ha)} / {len(hb)} epochs) | | | "
                     f"{max(diffs, default=0.0):g}{'' if same_history else ' (differ)'} |")
    if (sa is None) != (sb is None):
        same = False
        lines.append(f"| stratification.json | {'yes' if sa else 'none'} | {'yes' if sb else 'none'} | |")
    elif sa is not None:
        for key in U_KEYS:
            if key in sa or key in sb:
                diff = _max_diff(sa.get(key, []), sb.get(key, []))
                same &= diff == 0.0
                lines.append(f"| stratification.json {key} | | | {diff:g} |")
        # every other entry, to the digit; wall seconds are reported, never compared
        la, lb = ({k: v for k, v in _leaves({k: v for k, v in s.items() if k not in U_KEYS}).items()
                   if k != "seconds"} for s in (sa, sb))
        differ = sorted(k for k in la.keys() & lb.keys() if la[k] != lb[k])
        only = [(name, _grouped(keys)) for name, keys in ((a.name, la.keys() - lb.keys()),
                                                          (b.name, lb.keys() - la.keys())) if keys]
        same &= not differ and not only
        text = f"{len(la.keys() & lb.keys())} in both, {len(differ)} differ"
        text += f": {', '.join(differ)}" if differ else ""
        text += "".join(f"; only in {name}: {', '.join(keys)}" for name, keys in only)
        lines.append(f"| stratification.json, every other entry | | | {text} |")
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
