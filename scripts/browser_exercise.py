"""The student's path through one exercise, for scripts/browser_check.py (--exercise KEY).

In the JupyterLab page browser_check.py opened on the exercise's notebook: run the exercise's cell
as committed (its starter: expect "not attempted"), replace the `answer = ...` line with the
exercise's registered wrong answer and run it (expect the lesson, no traceback, not the right
value), then with the reference answer (expect "right"). The answers are typed into the cell's
editor as source text, so they must be Python literals (a value exercise, not one whose answer is
a function).
"""

from __future__ import annotations

import ast
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

NEVER_SHOWN = ("Traceback", "ExerciseFailed")  # a wrong answer is plain text, not an exception


@dataclass
class Plan:
    key: str
    notebook: str  # the file name, in the notebooks folder
    starter: str  # the cell's source as committed
    wrong: str  # the same cell with the registered wrong answer
    right: str  # ... and with the reference answer
    wrong_says: str  # what the lesson on the wrong answer must contain
    gives_away: str  # what it must not


class PlanError(Exception):
    """The exercise cannot be driven this way (no such key, not a value exercise, no starter)."""


def plan(key: str, notebooks: Path) -> Plan:
    from minivllm_compile import exercises

    try:
        ex = exercises.get(key)
    except (KeyError, TypeError) as e:
        raise PlanError(str(e)) from None
    (path,) = notebooks.glob(f"{key[:2]}_*.ipynb")
    cells = [
        "".join(c["source"])
        for c in json.loads(path.read_text())["cells"]
        if c["cell_type"] == "code"
    ]
    (starter,) = [c for c in cells if f'exercises.check("{key}"' in c]
    line = re.search(r"^answer = \.\.\..*$", starter, re.MULTILINE)
    if line is None:
        raise PlanError(
            f"exercise {key}'s cell has no `answer = ...` line to replace: it asks for a function; "
            "choose a value exercise (for example 06.1 or 14.1)"
        )

    def with_answer(value: object) -> str:
        text = repr(value)
        if ast.literal_eval(text) != value:
            raise PlanError(
                f"exercise {key}'s answers are not Python literals: choose a value exercise"
            )
        return starter[: line.start()] + f"answer = {text}" + starter[line.end() :]

    return Plan(
        key,
        path.name,
        starter,
        with_answer(ex.wrong()),
        with_answer(ex.solution()),
        ex.wrong_says,
        ex.gives_away,
    )


def drive_exercise(
    page,
    plan_: Plan,
    kernel_idle: Callable[[], bool],
    wait_until: Callable,
    log: Callable,
    step: Callable,
    fail: type[Exception],
    timeout: Callable[[], float],
) -> None:
    """Run the exercise cell three times in the open notebook, checking what each run shows."""
    cell = (
        page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell")
        .filter(has_text=f'exercises.check("{plan_.key}"')
        .first
    )
    if cell.count() == 0:
        raise fail(f'no cell of {plan_.notebook} calls exercises.check("{plan_.key}")')
    cell.scroll_into_view_if_needed()
    prompt = cell.locator(".jp-InputArea-prompt")

    def run(source: str | None, what: str) -> str:
        step(f"exercise {plan_.key}: {what}")
        editor = cell.locator(".cm-content").first
        editor.click()
        if source is not None:  # typed as a student would paste it: no auto-closed brackets
            page.keyboard.press("Control+a")
            page.keyboard.insert_text(source)
            typed = editor.inner_text()
            if "answer = " not in typed or typed.count("exercises.check(") != 1:
                raise fail(f"typing the answer into the cell's editor left: {typed!r}")
        before = prompt.inner_text().strip()
        page.keyboard.press("Control+Enter")  # run this cell, stay on it

        def finished() -> str | None:
            now = prompt.inner_text().strip()
            if now == before or not re.fullmatch(r"\[\d+\]:", now) or not kernel_idle():
                return None
            return cell.locator(".jp-OutputArea").inner_text().strip() or None

        shown = wait_until(
            finished, timeout(), f"exercise {plan_.key}'s cell did not finish ({what})"
        )
        time.sleep(0.5)  # the last stream message may trail the idle status
        shown = cell.locator(".jp-OutputArea").inner_text().strip()
        log(f"  it shows: {shown[:300]!r}")
        leaked = [w for w in NEVER_SHOWN if w in shown]
        if leaked:
            raise fail(
                f"exercise {plan_.key} ({what}) shows {leaked}, not a plain verdict:\n    "
                + shown.replace("\n", "\n    ")
            )
        return shown

    shown = run(None, "the starter as committed")
    if "not attempted yet" not in shown:
        raise fail(
            f"the starter of exercise {plan_.key} should say 'not attempted yet'; it shows:"
            f"\n    {shown}"
        )
    shown = run(plan_.wrong, "a typical wrong answer")
    if "not right yet" not in shown or plan_.wrong_says not in shown.replace("\n", " "):
        raise fail(
            f"a wrong answer to exercise {plan_.key} should be told 'not right yet' and "
            f"{plan_.wrong_says!r}; it shows:\n    {shown}"
        )
    if plan_.gives_away in shown:
        raise fail(
            f"the feedback on a first wrong answer to exercise {plan_.key} gives the right "
            f"value away ({plan_.gives_away!r}):\n    {shown}"
        )
    shown = run(plan_.right, "the right answer")
    if "your answer is right" not in shown:
        raise fail(
            f"the right answer to exercise {plan_.key} should be told 'your answer is right'; "
            f"it shows:\n    {shown}"
        )
