"""Graders for the notebooks' "your turn" exercises (the core never imports this package).

An exercise is registered in `nbNN.py` (NN: its notebook) under a key such as "02.1", with
a grader, a reference solution and a typical wrong answer. A notebook cell reads:

    from minivllm_compile import exercises
    answer = ...                      # TODO: your prediction / your function
    exercises.check("02.1", answer)

`check` grades the answer and prints what was right; a wrong answer raises ExerciseFailed, whose
message says what is wrong and where to look, not just "wrong". An answer still `...`, or a
function of the student's that still raises NotImplementedError (the starter's body), is reported
as not attempted (no error), so "Run All" goes through a notebook with its exercises untouched.
With MINIVLLM_SOLUTIONS=1 (what CI sets) the reference solution is graded instead, so every
grader runs whenever the notebooks run. tests/test_exercises.py grades every solution (passes)
and every registered wrong answer (fails, with its message).
"""

from __future__ import annotations

import importlib
import inspect
import os
from dataclasses import dataclass
from typing import Any, Callable

from minivllm_compile.envs import override as env  # noqa: F401  (the graders set switches with it)

TODO = ...  # what a starter cell leaves in place of an answer

# The notebooks that carry exercises (the workshop's core; notebooks/README.md lists the track).
NOTEBOOKS = ("02", "03", "04", "05", "06", "07", "09", "13", "14", "15")


class ExerciseFailed(AssertionError):
    """A wrong answer. The message names what is wrong and what to look at again."""


@dataclass(frozen=True)
class Exercise:
    key: str  # "NN.k": notebook NN, exercise k
    title: str
    hint: str  # printed while the exercise is not attempted
    grade: Callable[[Any], str]  # raises ExerciseFailed, else returns what the answer got right
    solution: Callable[[], Any]  # the reference answer (a value, or the function a student writes)
    wrong: Callable[[], Any]  # a typical wrong answer (tests/test_exercises.py)
    wrong_says: str  # a phrase the grader's message on `wrong` contains


_REGISTRY: dict[str, Exercise] = {}


def exercise(key: str, title: str, *, hint: str, solution: Callable[[], Any], wrong: Callable[[], Any],
             wrong_says: str) -> Callable[[Callable[[Any], str]], Callable[[Any], str]]:
    """Register the decorated function as the grader of exercise `key`."""

    def register(grade: Callable[[Any], str]) -> Callable[[Any], str]:
        if key in _REGISTRY:
            raise ValueError(f"exercise {key!r} is registered twice ({_REGISTRY[key].grade.__module__})")
        if key[:2] not in NOTEBOOKS or not grade.__module__.endswith(f".nb{key[:2]}"):
            raise ValueError(f"exercise {key!r} belongs in minivllm_compile/exercises/nb{key[:2]}.py")
        _REGISTRY[key] = Exercise(key, title, hint, grade, solution, wrong, wrong_says)
        return grade

    return register


def solutions_enabled() -> bool:
    """MINIVLLM_SOLUTIONS=1: grade the reference solutions instead of the notebook's answers."""
    return os.environ.get("MINIVLLM_SOLUTIONS", "0") == "1"


def get(key: str) -> Exercise:
    if key[:2] in NOTEBOOKS:
        importlib.import_module(f"{__name__}.nb{key[:2]}")  # registers that notebook's exercises
    if key not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "none loaded"
        raise KeyError(f"no exercise {key!r}; exercises are keyed 'NN.k' by notebook (known: {known})")
    return _REGISTRY[key]


def all_exercises() -> list[Exercise]:
    for nb in NOTEBOOKS:
        try:
            importlib.import_module(f"{__name__}.nb{nb}")
        except ModuleNotFoundError as e:  # a notebook without exercises: its test says so
            if e.name != f"{__name__}.nb{nb}":
                raise
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


def check(key: str, answer: Any = TODO) -> None:
    """Grade `answer` for exercise `key` and print the verdict: right (and why), or not attempted
    yet (with its hint); a wrong answer raises ExerciseFailed saying what is wrong. Returns None,
    so the cell that ends with it shows the verdict only."""
    ex = get(key)
    if solutions_enabled():
        answer, whose = ex.solution(), "the reference solution (MINIVLLM_SOLUTIONS=1)"
    elif answer is TODO:
        print(f"exercise {key}, {ex.title}: not attempted yet. Hint: {ex.hint}")
        return
    else:
        whose = "your answer"
    try:
        said = ex.grade(answer)
    except NotImplementedError:
        if solutions_enabled():
            raise
        print(f"exercise {key}, {ex.title}: not attempted yet (your function still raises "
              f"NotImplementedError). Hint: {ex.hint}")
        return
    print(f"exercise {key}, {ex.title}: {whose} is right. {said}")


def solution_source(key: str) -> str:
    """The reference solution's source, for a teacher (or a student who is done trying)."""
    return inspect.getsource(get(key).solution)
