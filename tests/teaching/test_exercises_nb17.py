"""Notebook 17's graders beyond their registered wrong answers
(tests/teaching/test_exercises.py runs those and the reference solutions): each grader fails its
broken model given back as the fix, and names the other typical mistakes."""

import pytest
import torch

from minivllm_compile import ignore_torch_compile
from minivllm_compile.exercises import ExerciseFailed, nb17
from minivllm_compile.viz.debugging import run_and_compare


@pytest.mark.compiles
@pytest.mark.parametrize("key", sorted(nb17.CASES))
def test_each_broken_model_goes_wrong_as_configured(key):
    case = nb17.CASES[key]
    with nb17._quiet():
        ok, said = run_and_compare(
            nb17._build(case.broken), nb17.config(key), nb17.inputs(), nb17._reference(case)
        )
    assert not ok, f"{key}: {said}"


def test_17_1_fails_the_broken_model_as_its_own_fix():
    with pytest.raises(ExerciseFailed, match="does not match eager: Unsupported"):
        nb17.grade_graph_break({"turn_off": "mode=NONE", "fix": nb17.Checked})


@pytest.mark.compiles
def test_17_1_wants_the_nan_check_kept():
    class Unchecked(nb17.Checked):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.relu(self.up(x)))

    with pytest.raises(ExerciseFailed, match="lets a NaN through"):
        nb17.grade_graph_break({"turn_off": "mode=NONE", "fix": Unchecked})


def test_17_1_refuses_a_fix_that_no_longer_compiles():
    @ignore_torch_compile
    class Eager(nb17.Checked):
        pass

    with pytest.raises(ExerciseFailed, match="traced it 0 times"):
        nb17.grade_graph_break({"turn_off": "mode=NONE", "fix": Eager})


def test_17_1_says_a_broader_switch_turns_off_too_much():
    with pytest.raises(ExerciseFailed, match="turns off more than the broken piece"):
        nb17.grade_graph_break({"turn_off": "enforce_eager", "fix": None})


@pytest.mark.compiles
def test_17_2_fails_the_broken_model_as_its_own_fix():
    with pytest.raises(ExerciseFailed, match="does not match eager: wrong at 4 tokens"):
        nb17.grade_shape({"turn_off": "mode=STOCK_TORCH_COMPILE", "fix": nb17.TwoPath})


def test_17_2_names_the_switches_when_given_something_else():
    with pytest.raises(ExerciseFailed, match="one of \\['enforce_eager'"):
        nb17.grade_shape({"turn_off": "guards on", "fix": nb17.TwoPath})
    with pytest.raises(ExerciseFailed, match=r'give \{"turn_off"'):
        nb17.grade_shape("mode=STOCK_TORCH_COMPILE")


@pytest.mark.compiles
def test_17_3_fails_the_broken_pass_as_its_own_fix():
    with pytest.raises(ExerciseFailed, match="with your pass the compiled model still goes wrong"):
        nb17.grade_pass({"turn_off": "passes off", "fix": nb17.double_to_add})


@pytest.mark.compiles
def test_17_3_says_backend_eager_turns_off_more_than_the_passes():
    with pytest.raises(ExerciseFailed, match="turns off more than the broken piece"):
        nb17.grade_pass({"turn_off": "backend=eager", "fix": nb17.pass_solution()["fix"]})
