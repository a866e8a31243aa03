"""Notebook 06's and 07's graders beyond the solution and the one typical wrong answer that
tests/test_exercises.py grades: what they say for other mistakes, and that they leak no state."""

import os

import pytest

from minivllm_compile import Range, exercises
from minivllm_compile.exercises import ExerciseFailed


def _fails(key, answer):
    with pytest.raises(ExerciseFailed) as failed:
        exercises.get(key).grade(answer)
    return str(failed.value)


def test_06_1_names_each_wrong_decision_and_why():
    said = _fails("06.1", {"aten::pow": {"packet"}, "aten::pow.Tensor_Scalar": set(),
                           "aten::pow.default": {"torch.pow"}})
    assert "'aten::pow.Tensor_Scalar' splits the Tensor_Scalar node" in said and "exactly this entry" in said
    assert "torch function" in said
    assert "'aten::pow' " not in said  # that entry was right


def test_06_1_refuses_a_malformed_answer_saying_what_to_give():
    assert "one key per entry" in _fails("06.1", {"aten::pow": {"packet"}})
    assert "set of labels" in _fails("06.1", {"aten::pow": "packet", "aten::pow.Tensor_Scalar": set(),
                                              "aten::pow.default": set()})
    assert "are labelled" in _fails("06.1", {"aten::pow": {"aten.pow"}, "aten::pow.Tensor_Scalar": set(),
                                             "aten::pow.default": set()})


def test_07_1_explains_each_wrong_lookup_and_restores_the_cache_switch(monkeypatch):
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    serves = {1: (1, 16), 2: Range(1, 16), 16: (16, 16), 17: (17, 48), 50: (49, 64), 64: (49, 64), 65: (49, 64)}
    said = _fails("07.1", {"ranges": [Range(1, 16), (17, 48), (49, 64)], "serves": serves})
    assert "num_tokens=2" in said and "wins over the range containing it" in said
    assert "num_tokens=65" in said and "past max_num_batched_tokens=64" in said
    assert "num_tokens=1:" not in said and "num_tokens=16:" not in said  # those were right
    assert "VLLM_DISABLE_COMPILE_CACHE" not in os.environ
