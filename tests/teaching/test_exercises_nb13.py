"""Notebook 13's graders beyond the solution and the registered wrong answer: the answers students
typically give get messages that say what is wrong, and a grader leaves no state behind."""

import os

import pytest
import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized

from minivllm_compile import exercises
from minivllm_compile.compilation.passes import VllmPatternMatcherPass
from minivllm_compile.exercises import ExerciseFailed


def _fails(key, answer) -> str:
    with pytest.raises(ExerciseFailed) as failed:
        exercises.get(key).grade(answer)
    return str(failed.value)


@pytest.mark.compiles
def test_the_prediction_grader_names_the_gate_and_restores_the_switch_and_the_pass_log(monkeypatch):
    from minivllm_compile.exercises import nb13

    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    nb13._qk_truth.cache_clear()  # measure again: the switch and the table must be put back
    VllmPatternMatcherPass.match_table["SomePass"] = 3
    before = dict(VllmPatternMatcherPass.match_table)  # with what earlier tests left in it
    try:
        said = _fails("13.1", {"matches": 2, "calls": 4})  # every range, one per layer
        assert "calls: not 4. Did the pass run on the entries above the limit?" in said
        assert "matches: not 2. You counted one match per attention layer" in said
        assert "VLLM_DISABLE_COMPILE_CACHE" not in os.environ
        assert dict(VllmPatternMatcherPass.match_table) == before
    finally:
        VllmPatternMatcherPass.match_table.pop("SomePass", None)
    assert "answer a dict" in _fails("13.1", 1)


def _pattern(x):
    d = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :d]) * x[..., d:]


def _functional(out_like):
    def replacement(x):
        res = auto_functionalized(torch.ops.minivllm.silu_and_mul.default, out=out_like(x), input=x)
        return res

    return replacement


def test_a_wrong_replacement_is_caught_before_anything_compiles():
    def half(x):
        return torch.empty(x.shape[:-1] + (x.shape[-1] // 2,))

    said = _fails("13.2", (_pattern, _functional(torch.empty_like)))
    assert "`out` has shape (5, 16)" in said and "(5, 8)" in said
    assert "which element holds what the op wrote" in _fails("13.2", (_pattern, _functional(half)))

    def swapped(x):  # gate and up the other way round
        return _pattern(x.flip(-1))

    assert "your pattern is not SiluAndMul" in _fails("13.2", (swapped, _functional(half)))


@pytest.mark.compiles
def test_a_pattern_in_the_custom_op_form_is_told_what_the_plain_torch_graph_holds():
    def half(x):
        return torch.empty(x.shape[:-1] + (x.shape[-1] // 2,))

    def custom(x):
        return _functional(half)(x)[1]

    said = _fails("13.2", (custom, custom))
    assert "matched 0 times" in said and "auto_functionalized(silu_and_mul" in said
    assert "slice, neg, exp, add, div, slice, mul" in said


def test_a_starter_is_not_attempted(monkeypatch, capsys):
    monkeypatch.delenv("MINIVLLM_SOLUTIONS", raising=False)

    def todo(x):
        raise NotImplementedError

    exercises.check("13.2", (todo, todo))
    assert ("not attempted yet (your function still raises "
            "NotImplementedError)" in capsys.readouterr().out)
