"""The user docs stay short and free of project history: README.md at most 2,000 words, benchmarks/README.md at most
2,500 (words as `wc -w` counts them: whitespace-separated tokens), and no commit hash (a word of 7 to 40 hex digits)
in README.md, benchmarks/README.md, deploy/README.md, experiments/README.md or docs/ outside the provenance lines the
README's generator writes. docs/decisions.md is the record of what was tried and dropped, with the commit that last
had it, and is left out of the hash check."""

import re
from pathlib import Path

from benchmarks.readme import PROVENANCE

ROOT = Path(__file__).resolve().parents[2]
WORD_LIMITS = {"README.md": 2000, "benchmarks/README.md": 2500}
HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}\b")  # a digit at least: "defaced" is a word, not a hash
HISTORY = {"docs/decisions.md"}


def user_docs() -> list[Path]:
    files = [ROOT / name for name in ("README.md", "benchmarks/README.md", "deploy/README.md", "experiments/README.md")]
    files += sorted((ROOT / "docs").rglob("*.md"))
    return [f for f in files if str(f.relative_to(ROOT)) not in HISTORY]


def hashes(text: str) -> list[str]:
    """Every hex word outside the generated provenance lines, with its line."""
    return [f"{line.strip()[:80]}: {word}" for line in text.splitlines() if not line.startswith(PROVENANCE)
            for word in HASH.findall(line)]


def test_the_hash_check_finds_a_planted_commit_and_nothing_in_plain_prose():
    assert hashes("Fixed at e5b05e6 (see 8657589-dirty).") == ["Fixed at e5b05e6 (see 8657589-dirty).: e5b05e6",
                                                              "Fixed at e5b05e6 (see 8657589-dirty).: 8657589"]
    assert hashes(f"{PROVENANCE} code e5b05e6 (6)") == []
    assert hashes("a defaced table, 10,034 steps, sha256 of 64 hex: " + "ab" * 32 + ", 2c/c, cnn3-bn, 1e-5") == []


def test_the_user_docs_are_within_their_word_limits():
    counts = {name: len((ROOT / name).read_text().split()) for name in WORD_LIMITS}
    assert {name: n for name, n in counts.items() if n > WORD_LIMITS[name]} == {}


def test_no_commit_hash_in_the_user_docs_outside_provenance_lines():
    found = {str(f.relative_to(ROOT)): hashes(f.read_text()) for f in user_docs()}
    assert {name: words for name, words in found.items() if words} == {}
