"""No silent skips in CI: with CI=true a missing data directory fails the pytest run (non-zero
exit, a message that says why); locally the data tests skip and the summary lists the reason.
Each case runs pytest in a subprocess on a two-test file that uses the project's conftest."""

import os
import re
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]

DATA_TESTS = '''
def test_asks_for_the_fixture(mnist_dir):
    assert (mnist_dir / "mnist").is_dir()


def test_calls_data_dir_itself():
    from tests.conftest import data_dir

    assert (data_dir() / "mnist").is_dir()
'''


def run_pytest(tmp_path, ci: str | None, *select):
    test_file = tmp_path / "test_needs_data.py"
    test_file.write_text(DATA_TESTS)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update({"PYTHONPATH": str(ROOT), "ONESHOT_FL_DATA_DIR": str(tmp_path / "no-data-here")})
    if ci is not None:
        env["CI"] = ci
    target = [f"{test_file}::{name}" for name in select] or [str(test_file)]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-c", str(ROOT / "pyproject.toml"), "--rootdir",
                           str(tmp_path), "-p", "tests.conftest", "-q", *target],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def test_ci_fails_the_run_before_any_test_when_a_selected_test_needs_missing_data(tmp_path):
    code, out = run_pytest(tmp_path, "true")
    assert code != 0, out
    assert "CI=true: data tests must run in CI, not skip." in out
    assert f"ONESHOT_FL_DATA_DIR={tmp_path / 'no-data-here'}" in out
    assert "passed" not in out and "skipped" not in out


def test_ci_fails_a_test_that_calls_data_dir_itself(tmp_path):
    code, out = run_pytest(tmp_path, "true", "test_calls_data_dir_itself")
    assert code == 1, out
    assert "1 failed" in out and "CI=true: data tests must run in CI, not skip." in out


def test_without_ci_missing_data_skips_and_the_summary_says_why(tmp_path):
    code, out = run_pytest(tmp_path, "false")
    assert code == 0, out
    assert "2 skipped" in out
    # -rs: the short summary lists the skips with their count and reason
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED [")]
    assert sum(int(re.match(r"SKIPPED \[(\d+)\]", line).group(1)) for line in skipped) == 2, out
    assert all("MNIST not found" in line for line in skipped)
