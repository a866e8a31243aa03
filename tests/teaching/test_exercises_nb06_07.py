"""Notebook 06's and 07's graders beyond the solution and the one typical wrong answer that
tests/teaching/test_exercises.py grades: what they say for other mistakes, and that they leak no
state."""

import os

import pytest

from minivllm_compile import Range, exercises
from minivllm_compile.exercises import ExerciseFailed


def _fails(key, answer):
    with pytest.raises(ExerciseFailed) as failed:
        exercises.get(key).grade(answer)
    return str(failed.value)


def test_06_1_asks_about_each_wrong_decision_and_measures_why():
    with pytest.raises(ExerciseFailed) as failed:
        exercises.get("06.1").grade({"aten::pow": {"packet"}, "aten::pow.Tensor_Scalar": set(),
                                     "aten::pow.default": {"torch.pow"}})
    lesson, measured = failed.value.lesson, failed.value.measured
    assert "'aten::pow.Tensor_Scalar' and the Tensor_Scalar node: what does" in lesson
    assert "'aten::pow.default' and the torch.pow node: torch.pow is a torch function" in lesson
    assert "'aten::pow' and" not in lesson  # that entry was right
    assert "'aten::pow.Tensor_Scalar' splits the Tensor_Scalar node" in measured
    assert "splits the Tensor_Scalar" not in lesson


def test_06_1_refuses_a_malformed_answer_saying_what_to_give():
    assert "one key per entry" in _fails("06.1", {"aten::pow": {"packet"}})
    assert "set of labels" in _fails("06.1", {"aten::pow": "packet",
                                              "aten::pow.Tensor_Scalar": set(),
                                              "aten::pow.default": set()})
    assert "are labelled" in _fails("06.1", {"aten::pow": {"aten.pow"},
                                             "aten::pow.Tensor_Scalar": set(),
                                             "aten::pow.default": set()})


@pytest.mark.compiles
def test_07_1_asks_about_each_wrong_lookup_and_restores_the_cache_switch(monkeypatch):
    from minivllm_compile.exercises import nb07

    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    # measure again: the switch must be put back by the measurement
    nb07._dispatch_truth.cache_clear()
    serves = {1: (1, 16), 2: Range(1, 16), 16: (16, 16), 17: (17, 48), 50: (49, 64),
              64: (49, 64), 65: (49, 64)}
    with pytest.raises(ExerciseFailed) as failed:
        exercises.get("07.1").grade({"ranges": [Range(1, 16), (17, 48), (49, 64)],
                                     "serves": serves})
    lesson = failed.value.lesson
    assert ("num_tokens=2: not Range(1, 16): which entry does "
            "_find_range_for_shape try first" in lesson)
    assert "num_tokens=65: not Range(49, 64): is 65 inside any entry?" in lesson
    assert "num_tokens=1:" not in lesson and "num_tokens=16:" not in lesson  # those were right
    assert "Range(2, 2)" not in lesson and "2 -> Range(2, 2)" in failed.value.measured
    assert "VLLM_DISABLE_COMPILE_CACHE" not in os.environ
