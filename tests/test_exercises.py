"""Every exercise's grader, both ways: the reference solution passes, a typical wrong answer fails
with a message that says what is wrong. And every core notebook carries its exercises as starters."""

import json
from pathlib import Path

import pytest

from minivllm_compile import exercises
from minivllm_compile.exercises import ExerciseFailed

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
KEYS = [ex.key for ex in exercises.all_exercises()]


@pytest.mark.parametrize("key", KEYS)
def test_the_reference_solution_passes(key):
    ex = exercises.get(key)
    said = ex.grade(ex.solution())
    assert isinstance(said, str) and said


@pytest.mark.parametrize("key", KEYS)
def test_a_typical_wrong_answer_fails_and_says_why(key):
    ex = exercises.get(key)
    with pytest.raises(ExerciseFailed) as failed:
        ex.grade(ex.wrong())
    assert ex.wrong_says in str(failed.value), f"{key}: the grader said {str(failed.value)!r}"


def _cells(nb: str) -> list[str]:
    (path,) = NOTEBOOKS.glob(f"{nb}_*.ipynb")
    return ["".join(c["source"]) for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


@pytest.mark.parametrize("nb", exercises.NOTEBOOKS)
def test_every_core_notebook_checks_its_exercises_from_starter_cells(nb):
    keys = [k for k in KEYS if k.startswith(nb + ".")]
    assert keys, f"notebook {nb} is in the workshop's core but has no exercise"
    cells = _cells(nb)
    for key in keys:
        checking = [c for c in cells if f'exercises.check("{key}"' in c]
        assert len(checking) == 1, f"exercise {key}: {len(checking)} cells call exercises.check on it"
        assert "# TODO" in checking[0], f"exercise {key}: its cell is not a starter (no '# TODO' left)"


def test_check_reports_an_unattempted_exercise_and_grades_the_solution_under_the_switch(monkeypatch, capsys):
    key = KEYS[0]
    monkeypatch.setenv("MINIVLLM_SOLUTIONS", "0")
    exercises.check(key)
    assert "not attempted yet" in capsys.readouterr().out
    with pytest.raises(ExerciseFailed):
        exercises.check(key, exercises.get(key).wrong())
    monkeypatch.setenv("MINIVLLM_SOLUTIONS", "1")
    exercises.check(key)  # the starter's `...` is replaced by the reference solution
    assert "reference solution (MINIVLLM_SOLUTIONS=1) is right" in capsys.readouterr().out


def test_unknown_keys_and_misplaced_graders_are_refused():
    with pytest.raises(KeyError, match="keyed 'NN.k'"):
        exercises.get("99.1")
    with pytest.raises(ValueError, match="belongs in minivllm_compile/exercises/nb02.py"):
        exercises.exercise("02.9", "x", hint="", solution=lambda: 0, wrong=lambda: 1, wrong_says="")(lambda a: "")
