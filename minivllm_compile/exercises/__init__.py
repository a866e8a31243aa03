"""Graders for the notebooks' "your turn" exercises (the core never imports this package).

An exercise is registered in `nbNN.py` (NN: its notebook) under a key such as "02.1", with a
grader, a reference solution, a typical wrong answer, the section to reread and two hints. A
notebook cell reads:

    from minivllm_compile import exercises
    answer = ...                      # TODO: your prediction / your function
    exercises.check("02.1", answer)

`check` grades the answer and prints one verdict, as plain text, never a traceback:
- left as `...` (or a function of the student's that still raises NotImplementedError, the
  starter's body): "not attempted yet" and the hint, so "Run All" goes through a notebook with its
  exercises untouched;
- right: what the answer got right, and why;
- wrong: what the answer misunderstands and which section to reread, never the right value. After
  two wrong tries, or with `check(key, answer, reveal=True)`, it adds what the grader measured.
`exercises.hint(key)` prints a second, deeper hint. The grader's own compiles are quiet (no INFO
lines): the verdict is all a cell shows.

A grader raises ExerciseFailed(lesson, measured=...) on a wrong answer; `lesson` must not state a
right value, `measured` may. Each grader runs the real thing to get the truth, once per process
(`measured_once`): a second try, and a test grading a wrong answer after the solution, reuse it.

MINIVLLM_SOLUTIONS=1 grades the reference solutions instead of the cells' answers (a teacher's
check that every grader works; a wrong verdict then raises). CI leaves it off: the notebooks run
their starters, and tests/teaching/test_exercises*.py grade every reference solution and wrong
answer.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from minivllm_compile.envs import _bool
from minivllm_compile.envs import override as env  # noqa: F401  (the graders set switches with it)

TODO = ...  # what a starter cell leaves in place of an answer

# The notebooks that carry exercises (the workshop's core; notebooks/README.md lists the track).
NOTEBOOKS = ("02", "03", "04", "05", "06", "07", "09", "13", "14", "15", "16", "17")
REVEAL_AFTER = 2  # wrong tries of one exercise before check shows what the grader measured

# 1/0, true/false, yes/no, on/off; else an error
solutions_enabled = _bool("MINIVLLM_SOLUTIONS", False)


class ExerciseFailed(AssertionError):
    """A wrong answer. `lesson` names what the answer misunderstands and what to look at again,
    never a right value; `measured` is what the grader measured (shown on request)."""

    def __init__(self, lesson: str, measured: str = "") -> None:
        super().__init__(lesson + (f"\nMeasured: {measured}" if measured else ""))
        self.lesson, self.measured = lesson, measured


@dataclass(frozen=True)
class Exercise:
    key: str  # "NN.k": notebook NN, exercise k
    title: str
    section: str  # where the lesson is, e.g. "notebook 02 §2"
    hint: str  # printed while the exercise is not attempted: where to start, not the answer
    deeper_hint: str  # exercises.hint(key): the reasoning, step by step, still not the answer
    grade: Callable[[Any], str]  # raises ExerciseFailed, else returns what the answer got right
    solution: Callable[[], Any]  # the reference answer (a value, or the function a student writes)
    wrong: Callable[[], Any]  # a typical wrong answer (tests/teaching/test_exercises.py)
    wrong_says: str  # a phrase the lesson on `wrong` contains
    # a phrase of `measured` on `wrong` that states the right value: never in the lesson
    gives_away: str


_REGISTRY: dict[str, Exercise] = {}
_wrong_tries: Counter = Counter()  # key -> wrong answers checked in this process


def exercise(key: str, title: str, *, section: str, hint: str, deeper_hint: str,
             solution: Callable[[], Any],
             wrong: Callable[[], Any], wrong_says: str,
             gives_away: str) -> Callable[[Callable[[Any], str]], Callable[[Any], str]]:
    """Register the decorated function as the grader of exercise `key`."""

    def register(grade: Callable[[Any], str]) -> Callable[[Any], str]:
        if key in _REGISTRY:
            raise ValueError(f"exercise {key!r} is registered twice "
                             f"({_REGISTRY[key].grade.__module__})")
        if key[:2] not in NOTEBOOKS or not grade.__module__.endswith(f".nb{key[:2]}"):
            raise ValueError(f"exercise {key!r} belongs in "
                             f"minivllm_compile/exercises/nb{key[:2]}.py")
        _REGISTRY[key] = Exercise(key, title, section, hint, deeper_hint, grade, solution,
                                  wrong, wrong_says,
                                  gives_away)
        return grade

    return register


def measured_once(fn: Callable) -> Callable:
    """Cache a grader's measurement for this process (its arguments must be hashable). The real
    thing does the same on every try, so only the first try of an exercise pays for its compiles."""
    return functools.cache(fn)


def get(key: str) -> Exercise:
    if not isinstance(key, str):
        raise TypeError("an exercise is named by its key, a string 'NN.k' (notebook NN, exercise "
                        f"k) such as '02.1', as the notebook's cell passes it; got {key!r}")
    if key[:2] in NOTEBOOKS:
        importlib.import_module(f"{__name__}.nb{key[:2]}")  # registers that notebook's exercises
    if key not in _REGISTRY:
        known = ", ".join(sorted(_REGISTRY)) or "none loaded"
        raise KeyError(f"no exercise {key!r}; exercises are keyed 'NN.k' by "
                       f"notebook (known: {known})")
    return _REGISTRY[key]


def all_exercises() -> list[Exercise]:
    for nb in NOTEBOOKS:
        importlib.import_module(f"{__name__}.nb{nb}")
    return [_REGISTRY[k] for k in sorted(_REGISTRY)]


@contextmanager
def quiet() -> Iterator[None]:
    """No log line at INFO or WARNING, from any logger, and no Python warning, while a grader runs:
    its compiles would otherwise print above the verdict. Errors still show."""
    before = logging.root.manager.disable
    logging.disable(max(before, logging.WARNING))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(before)


def check(key: str, answer: Any = TODO, *, reveal: bool = False) -> None:
    """Grade `answer` for exercise `key` and print the verdict: right (and why), not attempted yet
    (with the hint), or wrong (what is misunderstood and where to reread; what the grader measured
    too after REVEAL_AFTER wrong tries, or with reveal=True). Returns None, so the cell that ends
    with it shows the verdict only."""
    ex = get(key)
    head = f"exercise {key}, {ex.title}:"
    if solutions_enabled():
        answer = ex.solution()
    elif answer is TODO:
        print(f"{head} not attempted yet.\nHint: "
              f"{ex.hint}\n(exercises.hint({key!r}) gives a deeper one.)")
        return
    try:
        with quiet():
            said = ex.grade(answer)
    except NotImplementedError:
        if solutions_enabled():
            raise
        print(f"{head} not attempted yet (your function still raises NotImplementedError).\nHint: "
              f"{ex.hint}\n(exercises.hint({key!r}) gives a deeper one.)")
        return
    except ExerciseFailed as failed:
        if solutions_enabled():  # the reference solution must pass: a broken grader is an error
            raise
        print(_wrong(ex, failed, reveal))
        return
    whose = ("the reference solution (MINIVLLM_SOLUTIONS=1)" if solutions_enabled()
             else "your answer")
    print(f"{head} {whose} is right. {said}")


def _wrong(ex: Exercise, failed: ExerciseFailed, reveal: bool) -> str:
    _wrong_tries[ex.key] += 1
    tries = _wrong_tries[ex.key]
    lines = [f"exercise {ex.key}, {ex.title}: not right yet (wrong try {tries}).", failed.lesson,
             f"Reread {ex.section}. A deeper hint: exercises.hint({ex.key!r})."]
    if failed.measured and (reveal or tries >= REVEAL_AFTER):
        lines.append(f"What the grader measured: {failed.measured}")
    elif failed.measured:
        lines.append(f"(After {REVEAL_AFTER} wrong tries, or with exercises.check({ex.key!r}, "
                     "answer, reveal=True), this also shows what the grader measured.)")
    return "\n".join(lines)


def hint(key: str) -> None:
    """Print exercise `key`'s second, deeper hint."""
    ex = get(key)
    print(f"exercise {key}, {ex.title}, a deeper hint (then reread "
          f"{ex.section}):\n{ex.deeper_hint}")


def solution_source(key: str) -> str:
    """The reference solution's source, for a teacher (or a student who is done trying)."""
    return inspect.getsource(get(key).solution)
