"""The graders of notebooks 09 and 14 beyond their registered wrong answers: each other typical
mistake gets a message that names it."""

import pytest
import torch

from minivllm_compile.exercises import ExerciseFailed, nb09, nb14


def test_09_1_refuses_a_name_that_is_no_factor_before_computing_anything():
    answer = {**nb09._KEY_SOLUTION, "compile_sizes=[4, 8]": "compile_sizes"}
    with pytest.raises(ExerciseFailed, match="give the name of one factor"):
        nb09.grade_keys(answer)


def test_09_1_asks_for_every_change():
    with pytest.raises(ExerciseFailed, match="missing"):
        nb09.grade_keys({"compile_sizes=[4, 8]": "config"})


def test_14_1_explains_the_step_above_the_largest_capture_size():
    answer = {**nb14._DISPATCH_SOLUTION, (25, True): ("FULL", 32)}
    with pytest.raises(ExerciseFailed, match="above the largest capture size"):
        nb14.grade_dispatch(answer)


def test_14_1_explains_the_padding():
    answer = {**nb14._DISPATCH_SOLUTION, (13, True): ("FULL", 13)}
    with pytest.raises(ExerciseFailed, match="pads up to the next capture size"):
        nb14.grade_dispatch(answer)


def _copied_not_cloned(step, static_x, batches):
    outputs = []
    for batch in batches:
        static_x.copy_(batch)
        outputs.append(step(static_x))
    return outputs


def _cloned_not_copied(step, static_x, batches):
    return [step(batch).clone() for batch in batches]


def _bypassed(step, static_x, batches):
    return [torch.zeros(4, 8) for _ in batches]


@pytest.mark.parametrize("collect, says", [
    (_copied_not_cloned, "the same tensor"),
    (_cloned_not_copied, "never saw your batches"),
    (_bypassed, "called step 0 times"),
])
def test_14_2_names_each_hazard(collect, says):
    with pytest.raises(ExerciseFailed, match=says):
        nb14.grade_collect(collect)
