"""scripts/browser_check.py: notebooks in JupyterLab in headless Chromium, as a student meets them:
notebook 07's slider moved, and exercise 06.1 worked through (the starter, a wrong answer, the
right one).

These need the system chromium and playwright; without them they skip and say what to install.
The notebook-07 test takes about 2 minutes (it runs the whole notebook in a real kernel); the
exercise test runs one cell three times."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "browser_check.py"


def _missing() -> str | None:
    missing = []
    if shutil.which("chromium") is None:
        missing.append("no `chromium` on PATH (apt-get install -y chromium)")
    if importlib.util.find_spec("playwright") is None:
        missing.append("playwright is not installed (.venv/bin/pip install playwright; "
                       "its browser download is not needed)")
    return "; ".join(missing) or None


needs_browser = pytest.mark.skipif(_missing() is not None, reason=f"browser check: {_missing()}")


def _run(*args, timeout):
    env = {k: v for k, v in os.environ.items() if k != "CHROMIUM"}
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], check=False, capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)
    return proc, f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


@pytest.mark.compiles
def test_a_missing_browser_is_named_with_how_to_install_it():
    # needs neither chromium nor playwright: either one missing is reported, status 2
    proc, out = _run("--chromium", "/nonexistent/chromium", timeout=60)
    assert proc.returncode == 2, out
    assert "MISSING" in proc.stderr and "install" in proc.stderr, out


@pytest.mark.compiles
@needs_browser
def test_the_slider_of_notebook_07_changes_its_output():
    proc, out = _run("--timeout", "900", timeout=960)
    assert proc.returncode == 0, out
    assert "PASSED" in proc.stdout and "the output changed" in proc.stdout, out


@pytest.mark.compiles
@needs_browser
def test_a_student_works_exercise_06_1_a_wrong_answer_first():
    proc, out = _run("--exercise", "06.1", "--timeout", "600", timeout=660)
    assert proc.returncode == 0, out
    assert "PASSED: exercise 06.1" in proc.stdout, out
    for what in ("the starter as committed", "a typical wrong answer", "the right answer"):
        assert f"exercise 06.1: {what}" in proc.stdout, out


@pytest.mark.compiles
@needs_browser
def test_feedback_that_gives_the_answer_away_fails_the_exercise_check(tmp_path):
    # a copy of the notebooks whose 06.1 cell prints the measured values on the first wrong try
    copy = tmp_path / "notebooks"
    shutil.copytree(ROOT / "notebooks", copy, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
    path = next(copy.glob("06_*.ipynb"))
    text = path.read_text().replace('exercises.check(\\"06.1\\", answer)',
                                    'exercises.check(\\"06.1\\", answer, reveal=True)')
    assert "reveal=True" in text
    path.write_text(text)
    proc, out = _run("--exercise", "06.1", "--dir", str(copy), "--timeout", "600", timeout=660)
    assert proc.returncode == 1, out
    assert "gives the right value away" in proc.stderr, out


@pytest.mark.compiles
def test_an_exercise_whose_answer_is_a_function_is_refused_with_a_reason():
    proc, out = _run("--exercise", "14.2", "--chromium", sys.executable, timeout=120)
    assert proc.returncode in (1, 2), out
    if proc.returncode == 1:  # with playwright: the plan is refused before any browser starts
        assert "asks for a function" in proc.stderr, out


@pytest.mark.compiles
@needs_browser
def test_a_slider_whose_output_does_not_change_fails_the_check(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(
        "import ipywidgets as w\n"
        "from IPython.display import display\n"
        "out = w.Output()\n"
        "display(w.VBox([w.IntSlider(value=2, min=0, max=9), out]))  # nothing observes it\n"
        "with out:\n"
        "    print('always the same')")]
    nbformat.write(nb, tmp_path / "still.ipynb")
    proc, out = _run("--dir", str(tmp_path), "--notebook", "still.ipynb", "--change-timeout", "5",
                     "--timeout", "300", timeout=360)
    assert proc.returncode == 1, out
    assert "did not change" in proc.stderr and "always the same" in proc.stderr, out
