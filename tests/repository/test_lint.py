"""The ruff configuration in pyproject.toml holds for every Python file of the repository: line
length 100, pycodestyle, pyflakes and isort (the notebooks are checked by nbval instead)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_check_passes():
    assert importlib.util.find_spec("ruff") is not None, (
        "ruff is not installed: install the test extra (pip install -e '.[test]'), which pins the "
        "ruff version whose verdicts this test expects")
    done = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (
        f"ruff check found problems:\n{done.stdout}{done.stderr}\n"
        "Fix what ruff can with `python -m ruff check --fix .` (import order, whitespace) and the "
        "rest by hand (wrap long lines inside brackets; split long strings into adjacent pieces)")
