"""Every exercise's grader, both ways: the reference solution passes, a typical wrong answer fails
with a lesson that names the misconception and never the right value. What a student sees from
`check` (plain text, the right value only after two wrong tries or on request, no compile log),
and what the committed notebooks show (starters, "not attempted", never a verdict).

This is where CI grades every reference solution: the notebooks run their starters under nbval.
Each grader measures the real thing once per process (exercises.measured_once), so grading the
wrong answer after the solution costs no second compile."""

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from minivllm_compile import exercises
from minivllm_compile.exercises import ExerciseFailed

NOTEBOOKS = Path(__file__).resolve().parents[2] / "notebooks"
KEYS = [ex.key for ex in exercises.all_exercises()]
# the graders that compile (or start ranks) to measure: whole suite only. The others, right and
# wrong answers alike, are in the quick tier, which fails any of them that compiles after all.
COMPILING_GRADERS = {"02.2", "02.3", "03.1", "03.2", "04.1", "04.2", "06.2", "07.1", "07.2", "09.2",
                     "13.1", "13.2", "15.1", "15.2", "16.1", "16.2", "17.1", "17.2", "17.3"}
GRADED = [pytest.param(k, marks=pytest.mark.compiles) if k in COMPILING_GRADERS else k
          for k in KEYS]
VERDICTS = ("is right", "not right yet", "Traceback", "ExerciseFailed", "What the grader measured")


@pytest.mark.parametrize("key", GRADED)
def test_the_reference_solution_passes(key):
    ex = exercises.get(key)
    said = ex.grade(ex.solution())
    assert isinstance(said, str) and said


@pytest.mark.parametrize("key", GRADED)
def test_a_typical_wrong_answer_fails_with_its_lesson_and_not_the_right_value(key):
    ex = exercises.get(key)
    with pytest.raises(ExerciseFailed) as failed:
        ex.grade(ex.wrong())
    lesson, measured = failed.value.lesson, failed.value.measured
    assert ex.wrong_says in lesson, f"{key}: the lesson is {lesson!r}"
    # the phrase that states the right value is what the grader measured (or the solution's code),
    # never the lesson; nor is any part of the measured text
    assert ex.gives_away in measured + exercises.solution_source(key), (
        key,
        ex.gives_away,
        measured,
    )
    assert ex.gives_away not in lesson, f"{key}: the lesson gives the answer away: {lesson!r}"
    for part in filter(None, (p.strip() for p in measured.split(";"))):
        assert part not in lesson, f"{key}: the lesson states what was measured: {part!r}"


@pytest.mark.parametrize("key", KEYS)
def test_every_exercise_has_a_section_and_two_hints_that_do_not_give_it_away(key):
    ex = exercises.get(key)
    assert ex.section.startswith("notebook ") and ex.hint and ex.deeper_hint
    assert ex.deeper_hint != ex.hint and len(ex.deeper_hint) > len(ex.hint)
    for hint in (ex.hint, ex.deeper_hint):
        assert ex.gives_away not in hint, f"{key}: a hint gives the answer away: {hint!r}"


def test_a_wrong_answer_is_plain_text_and_the_measured_value_comes_after_two_tries(
    monkeypatch, capsys
):
    ex = exercises.get("06.1")  # a grader that compiles nothing: quick
    monkeypatch.delenv("MINIVLLM_SOLUTIONS", raising=False)
    monkeypatch.setattr(exercises, "_wrong_tries", exercises.Counter())
    exercises.check("06.1", ex.wrong())  # returns; no exception reaches the cell
    first = capsys.readouterr().out
    assert "not right yet (wrong try 1)" in first and ex.wrong_says in first
    assert "Reread notebook 06 §3" in first and "exercises.hint('06.1')" in first
    assert ex.gives_away not in first and "Traceback" not in first and "reveal=True" in first
    exercises.check("06.1", ex.wrong())
    second = capsys.readouterr().out
    assert "wrong try 2" in second and f"What the grader measured: {ex.gives_away}" in second
    assert second.strip().splitlines()[-1].startswith("What the grader measured")


def test_reveal_shows_the_measured_value_at_the_first_try(monkeypatch, capsys):
    ex = exercises.get("14.1")
    monkeypatch.delenv("MINIVLLM_SOLUTIONS", raising=False)
    monkeypatch.setattr(exercises, "_wrong_tries", exercises.Counter())
    exercises.check("14.1", ex.wrong(), reveal=True)
    out = capsys.readouterr().out
    assert "wrong try 1" in out and ex.gives_away in out.splitlines()[-1]


def test_a_right_answer_and_a_starter(monkeypatch, capsys):
    monkeypatch.delenv("MINIVLLM_SOLUTIONS", raising=False)
    exercises.check("14.1", exercises.get("14.1").solution())
    assert (
        "exercise 14.1, the runtime mode and padded size of a step: your answer is right."
        in capsys.readouterr().out
    )
    exercises.check("14.1")
    out = capsys.readouterr().out
    assert (
        "not attempted yet" in out
        and exercises.get("14.1").hint in out
        and "exercises.hint('14.1')" in out
    )
    exercises.hint("14.1")
    assert exercises.get("14.1").deeper_hint in capsys.readouterr().out


@pytest.mark.compiles
def test_the_graders_compiles_are_quiet_and_the_verdict_is_the_last_line(monkeypatch, capfd):
    from minivllm_compile.exercises import nb02

    monkeypatch.delenv("MINIVLLM_SOLUTIONS", raising=False)
    nb02.traced_files.cache_clear()  # measure again: two Dynamo traces, each logging at INFO
    exercises.check("02.3", exercises.get("02.3").solution())
    out, err = capfd.readouterr()
    assert "INFO" not in out and "WARNING" not in err, (out, err)
    assert out.strip().splitlines() == [out.strip().splitlines()[0]] and "is right" in out
    assert logging.root.manager.disable == logging.NOTSET  # logging is back as it was
    nb02.traced_files.cache_clear()
    nb02.traced_files(("all",))  # outside a grader the log is as loud as before
    assert "Dynamo bytecode transform time" in capfd.readouterr().out


@pytest.mark.parametrize(
    "value, on",
    [
        ("1", True),
        ("yes", True),
        ("true", True),
        ("on", True),
        ("0", False),
        ("no", False),
        ("off", False),
        ("", False),
    ],
)
def test_minivllm_solutions_reads_every_boolean_spelling(monkeypatch, value, on):
    monkeypatch.setenv("MINIVLLM_SOLUTIONS", value)
    assert exercises.solutions_enabled() is on


def test_a_bad_minivllm_solutions_or_key_is_an_error_that_says_what_to_do(monkeypatch):
    monkeypatch.setenv("MINIVLLM_SOLUTIONS", "maybe")
    with pytest.raises(ValueError, match="MINIVLLM_SOLUTIONS='maybe' is not a boolean"):
        exercises.check("14.1")
    monkeypatch.delenv("MINIVLLM_SOLUTIONS")
    with pytest.raises(TypeError, match="a string 'NN.k'.* such as '02.1'.*got None"):
        exercises.check(None)
    with pytest.raises(KeyError, match="keyed 'NN.k'"):
        exercises.get("99.1")


def test_under_the_switch_the_reference_solution_is_graded_and_a_failure_raises(
    monkeypatch, capsys
):
    monkeypatch.setenv("MINIVLLM_SOLUTIONS", "1")
    exercises.check("14.1")  # the starter's `...` is replaced by the reference solution
    assert "reference solution (MINIVLLM_SOLUTIONS=1) is right" in capsys.readouterr().out
    ex = exercises.get("14.1")
    broken = dataclasses.replace(ex, solution=ex.wrong)
    monkeypatch.setitem(exercises._REGISTRY, "14.1", broken)
    with pytest.raises(
        ExerciseFailed
    ):  # a teacher's check: a grader that fails its solution is loud
        exercises.check("14.1")


def test_misplaced_graders_are_refused():
    with pytest.raises(ValueError, match="belongs in minivllm_compile/exercises/nb02.py"):
        exercises.exercise(
            "02.9",
            "x",
            section="",
            hint="",
            deeper_hint="",
            solution=lambda: 0,
            wrong=lambda: 1,
            wrong_says="",
            gives_away="",
        )(lambda a: "")


# --- the committed notebooks ----------------------------------------------------------------


def _code_cells(nb: str) -> list[dict]:
    (path,) = NOTEBOOKS.glob(f"{nb}_*.ipynb")
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def _text(outputs: list[dict]) -> str:
    parts = []
    for out in outputs:
        parts.append("".join(out.get("text", "")))
        parts.extend(
            "".join(v) if isinstance(v, list) else str(v) for v in out.get("data", {}).values()
        )
        parts.extend([out.get("ename", ""), out.get("evalue", "")] + out.get("traceback", []))
    return "\n".join(parts)


@pytest.mark.parametrize("nb", exercises.NOTEBOOKS)
def test_each_exercise_cell_is_a_starter_committed_unattempted_and_never_compared_by_nbval(nb):
    keys = [k for k in KEYS if k.startswith(nb + ".")]
    assert keys, f"notebook {nb} is in the workshop's core but has no exercise"
    cells = _code_cells(nb)
    for key in keys:
        checking = [c for c in cells if f'exercises.check("{key}"' in "".join(c["source"])]
        assert len(checking) == 1, (
            f"exercise {key}: {len(checking)} cells call exercises.check on it"
        )
        cell = checking[0]
        assert "# TODO" in "".join(cell["source"]), (
            f"exercise {key}: its cell is not a starter (no '# TODO' left)"
        )
        # nbval never compares this cell's output with the committed one (a teacher's run grades)
        assert "nbval-ignore-output" in cell["metadata"].get("tags", []), (
            f"exercise {key}: not tagged"
        )
        shown = _text(cell["outputs"])
        assert f"exercise {key}, " in shown and "not attempted yet" in shown, (
            f"exercise {key}: {shown[-300:]!r}"
        )
        assert exercises.get(key).hint in shown.replace("\n", " ")
        given_away = [v for v in VERDICTS if v in shown]
        assert not given_away, (
            f"exercise {key}'s committed output holds a verdict ({given_away}): {shown[-300:]!r}"
        )
        assert not any(o["output_type"] == "error" for o in cell["outputs"])
