"""Notebook 04's and 05's graders beyond the one typical wrong answer
tests/teaching/test_exercises.py tries: other wrong answers get messages that name what is wrong,
and grading leaves no state behind."""

import os

import pytest
import torch

from minivllm_compile.exercises import ExerciseFailed, nb04, nb05


def test_04_1_a_malformed_answer_says_what_shape_to_give():
    with pytest.raises(ExerciseFailed, match="one entry per call"):
        nb04.grade_two_models({"traces": [1, 0]})


@pytest.mark.compiles
def test_04_1_asks_about_a_wrong_entry_without_naming_it_and_restores_the_hook_setting(monkeypatch):
    monkeypatch.delenv("VLLM_USE_BYTECODE_HOOK", raising=False)
    # measure again: the setting must be put back by the measurement
    nb04._calls_truth.cache_clear()
    answer = {"traces": [1, 0, 1, 0, 1, 0], "entered": [True, True, True, True, True, False]}
    with pytest.raises(ExerciseFailed) as failed:
        nb04.grade_two_models(answer)
    lesson = failed.value.lesson
    assert ("entered: 1 of your 6 entries are wrong" in lesson
            and "hook-on model's later call run" in lesson)
    assert "traces:" not in lesson and "[True, True, True, False" in failed.value.measured
    assert "VLLM_USE_BYTECODE_HOOK" not in os.environ


@pytest.mark.compiles
def test_04_2_an_in_place_write_is_allowed():
    answer = {"rebind": (True, 3), "add_": (True, 3), "+=": (True, 3), "int attribute": (False, 1)}
    with pytest.raises(ExerciseFailed) as failed:
        nb04.grade_state_changes(answer)
    assert ("'add_', refused under cudagraph_mode='FULL': not True. An in-place "
            "method" in failed.value.lesson)
    assert "'add_': refused under FULL: False" in failed.value.measured


def test_05_2_a_swapped_table_computes_something_else_and_the_stock_table_is_untouched():
    with pytest.raises(ExerciseFailed, match="computes something else") as failed:
        nb05.grade_teach({1: "peak", 2: "total"})
    assert "{1: 'total', 2: 'peak'}" not in failed.value.lesson
    with pytest.raises(ExerciseFailed, match="not written by the op"):
        nb05.grade_teach({1: "x", 2: "total"})
    assert nb05.accumulate not in nb05.FixFunctionalizationPass.MUTATED_ARGS
    assert torch._inductor.config.enable_auto_functionalized_v2 is True  # the patch is undone


@pytest.mark.compiles
def test_the_static_retrace_exercise_04_1_teaches_is_also_warned_about(caplog):
    import logging

    from minivllm_compile.exercises import nb04

    with caplog.at_level(logging.WARNING, logger="minivllm_compile"):
        truth = nb04.run_calls()
    # call 5: the hook-off model traces again
    assert truth["traces"][4] == 1 and truth["static_retrace"]
    warned = [r.getMessage() for r in caplog.records if "traced this model again" in r.getMessage()]
    assert (len(warned) == 1 and "static shapes" in warned[0]
            and "VLLM_USE_BYTECODE_HOOK" in warned[0])


@pytest.mark.compiles
def test_instances_of_one_class_with_the_hook_on_and_off_keep_their_own_traces(caplog):
    """Issue 21 item 12: a hook-on instance's first call ran remove_from_cache on forward's code
    object, which every instance shared; a hook-off instance then traced again, outside a first
    call, a static graph that served every size. Each instance compiles its own copy of forward's
    code now: the six calls of exercise 04.1 on two nb04.Toy trace once per model, and each serves
    every size from its first, dynamic trace."""
    import logging

    with caplog.at_level(logging.WARNING, logger="minivllm_compile"):
        truth = nb04.run_calls(nb04.Toy)
    assert truth == {"traces": [1, 0, 1, 0, 0, 0],
                     "entered": [True, True, True, False, True, False],
                     "static_retrace": False}
    assert "traced this model again" not in caplog.text
