"""Notebook 17's exercises: three broken models, given without their cause. For each, the student
names the one switch of vLLM's debugging guide that makes it right while turning off the least
(viz/debugging.SWITCHES), and gives the fix. The grader reruns the broken model under that switch
and under every narrower one, then runs the student's fix with nothing turned off, each time
against the same model run eagerly.

    answer = {"turn_off": "<a name from SWITCHES>", "fix": <a model class, or for 17.3 a pass>}
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

from minivllm_compile import (
    CompilationConfig,
    CompilationMode,
    compilation_counter,
    support_torch_compile,
)
from minivllm_compile.exercises import ExerciseFailed, env, exercise
from minivllm_compile.viz.debugging import SWITCHES, apply_switch, run_and_compare, runner

WIDTH = 16
MAX_TOKENS = 32
SIZES = (
    32,
    4,
    12,
    20,
)  # the first call traces (a warm-up at max_num_batched_tokens), then smaller steps


def _linear(n_in: int, n_out: int, seed: int) -> nn.Linear:
    """A Linear with weights from its own generator: every instance of a model is the same model."""
    layer = nn.Linear(n_in, n_out)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n_out, n_in, generator=g) / n_in**0.5)
        layer.bias.copy_(torch.randn(n_out, generator=g) * 0.1)
    return layer


def inputs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(17)
    return [torch.randn(n, WIDTH, generator=g) for n in SIZES]


# ---------------------------------------------------------------------------------------------
# the three broken models


@support_torch_compile
class Checked(nn.Module):
    """17.1: refuses hidden states with a NaN in them, rather than pass it on to the next layer."""

    def __init__(self, *, compilation_config: CompilationConfig | None = None):
        super().__init__()
        self.up, self.down = _linear(WIDTH, 2 * WIDTH, 1), _linear(2 * WIDTH, WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.up(x))
        if torch.isnan(h).any():
            raise ValueError("NaN in the hidden states")
        return self.down(h)


@support_torch_compile
class TwoPath(nn.Module):
    """17.2: a long input is centred over its tokens; a short one is left as it is."""

    def __init__(self, *, compilation_config: CompilationConfig | None = None):
        super().__init__()
        self.up, self.down = _linear(WIDTH, 2 * WIDTH, 3), _linear(2 * WIDTH, WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        if x.shape[0] >= 16:
            h = h - h.mean(dim=0, keepdim=True)
        return self.down(torch.relu(h))


@support_torch_compile
class Doubler(nn.Module):
    """17.3: a projection, doubled, then scaled and shifted; compiled with a user's pass."""

    def __init__(self, *, compilation_config: CompilationConfig | None = None):
        super().__init__()
        self.proj = _linear(WIDTH, WIDTH, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x) * 2
        return torch.relu(h) * 3 - 1


def double_to_add(graph: torch.fx.Graph) -> None:
    """A user's post-grad pass: x * 2 becomes x + x (an add is cheaper than a multiply)."""
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if (
            node.op == "call_function"
            and node.target == aten.mul.Tensor
            and not isinstance(node.args[1], torch.fx.Node)
        ):
            x = node.args[0]
            with graph.inserting_before(node):
                add = graph.call_function(aten.add.Tensor, (x, x))
            add.meta = dict(node.meta)
            node.replace_all_uses_with(add)
            graph.erase_node(node)


def config(name: str, user_pass: Callable | None = None) -> CompilationConfig:
    """The configuration each broken model is served with (VLLM_COMPILE, the guide's default)."""
    inductor = (
        {"post_grad_custom_post_pass": user_pass or double_to_add, "fx_graph_cache": False}
        if name == "17.3"
        else {}
    )
    return CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        backend="inductor" if name == "17.3" else "eager",
        max_num_batched_tokens=MAX_TOKENS,
        splitting_ops=[],
        inductor_compile_config=inductor,
    )


# ---------------------------------------------------------------------------------------------
# grading


@dataclass(frozen=True)
class _Case:
    key: str
    broken: type
    section: str  # where the notebook shows this kind of failure


CASES = {
    "17.1": _Case("17.1", Checked, "§3 (a graph break)"),
    "17.2": _Case("17.2", TwoPath, "§4 (a shape specialisation)"),
    "17.3": _Case("17.3", Doubler, "§6 (a wrong Inductor result)"),
}


@contextmanager
def _quiet() -> Iterator[None]:
    """Every rerun really compiles (nothing from the compile cache), and the graders' compiles keep
    their progress lines to themselves; the switches and log levels are put back after."""
    logs = {
        logging.getLogger("torch._inductor.standalone_compile"): logging.ERROR,
        logging.getLogger("minivllm_compile"): logging.ERROR,
    }
    saved = {log: log.level for log in logs}
    for log, level in logs.items():
        log.setLevel(level)
    try:
        with env(VLLM_DISABLE_COMPILE_CACHE="1"), torch.no_grad():
            yield
    finally:
        for log, level in saved.items():
            log.setLevel(level)


def _build(cls: type) -> Callable[[CompilationConfig], Callable]:
    return lambda cc: runner(cls(compilation_config=cc))


def _reference(case: _Case) -> Callable:
    return case.broken()  # no config: mode NONE, the model run eagerly


def _check_switch(case: _Case, switch: Any) -> str:
    if switch not in SWITCHES:
        raise ExerciseFailed(
            f"'turn_off' names one switch, as a string: one of {list(SWITCHES)}; got {switch!r}"
        )
    # (that the model goes wrong as configured is tests/test_exercises_nb17.py's to check, not
    # each grading's)
    cc, ref, xs = config(case.key), _reference(case), inputs()
    ok, said = run_and_compare(
        _build(case.broken), apply_switch(cc, switch), xs, ref, env=SWITCHES[switch].env
    )
    if not ok:
        raise ExerciseFailed(
            f"rerun with {switch}, the broken model still goes wrong ({said}): {switch} leaves the "
            f"broken piece on. Rerun it under the other switches, as in {case.section}"
        )
    for other in SWITCHES.values():
        if other.narrower_than(SWITCHES[switch]):
            ok, _ = run_and_compare(
                _build(case.broken), apply_switch(cc, other.name), xs, ref, env=other.env
            )
            if ok:
                raise ExerciseFailed(
                    f"{switch} makes it right, but it turns off more than the broken piece: "
                    "a switch "
                    "that turns off less also does (compare what each one turns off, §1's table)"
                )
    return f"{switch} is the narrowest switch that makes it right"


def _refuses_nan(fix: type) -> bool:
    """17.1's model exists to refuse a NaN: its fix, compiled, must refuse one too."""
    model = fix(compilation_config=config("17.1"))
    model(inputs()[0])  # the first call compiles
    x = inputs()[1]
    x[0, 0] = float("nan")
    try:
        model(x)
    except Exception:  # noqa: BLE001  (how it refuses is the fix's business)
        return True
    return False


def _fix_class(case: _Case, fix: Any) -> str:
    if not (isinstance(fix, type) and issubclass(fix, case.broken)):
        raise ExerciseFailed(
            f"'fix' is a class: a subclass of {case.broken.__name__} with its forward rewritten "
            f"(class Fixed({case.broken.__name__}): def forward(self, x): ...); got {fix!r}"
        )
    ref, xs = _reference(case), inputs()
    before = compilation_counter.num_dynamo_traces
    ok, said = run_and_compare(_build(fix), config(case.key), xs, ref)
    traces = compilation_counter.num_dynamo_traces - before
    if not ok:
        raise ExerciseFailed(
            f"your fix, compiled as the broken model was ({config(case.key).mode.name}), does not "
            f"match eager: {said}. Reread {case.section} for the ways out"
        )
    if traces != 1:
        raise ExerciseFailed(
            f"your fix matches eager but Dynamo traced it {traces} times, not once: it must still "
            f"compile, as one graph for every size (no ignore_torch_compile; reread {case.section})"
        )
    if case.key == "17.1" and not _refuses_nan(fix):
        raise ExerciseFailed(
            "your fix compiles and matches eager, but lets a NaN through: the check is what this "
            "model is for. Keep it, where Dynamo does not trace it (reread §3's fixes)"
        )
    sizes = ", ".join(map(str, SIZES))
    return f"your {fix.__name__} compiles once and matches eager at {sizes} tokens."


def _fix_pass(case: _Case, fix: Any) -> str:
    if not callable(fix) or isinstance(fix, type):
        raise ExerciseFailed(
            f"'fix' is a pass: a function of a torch.fx.Graph that edits it in place; got {fix!r}"
        )
    ok, said = run_and_compare(
        _build(case.broken), config(case.key, user_pass=fix), inputs(), _reference(case)
    )
    if not ok:
        raise ExerciseFailed(
            f"with your pass the compiled model still goes wrong ({said}): reread {case.section}"
        )
    rewritten = _doubles_left(fix)
    if rewritten:
        raise ExerciseFailed(
            f"your pass leaves {rewritten} in a graph that has one: it must still do its job, "
            "x * 2 into x + x, and nothing else"
        )
    return "your pass turns x * 2 into x + x and leaves every other multiply alone."


def _doubles_left(pass_: Callable[[torch.fx.Graph], None]) -> str:
    """Run the pass on a small graph with x * 2 and x * 3: what it should rewrite but did not."""

    def f(x):
        return (x * 2) * 3

    gm = make_fx(f)(torch.ones(4))
    pass_(gm.graph)
    aten = torch.ops.aten
    muls = [
        n.args[1] for n in gm.graph.nodes if n.op == "call_function" and n.target == aten.mul.Tensor
    ]
    return "x * 2" if 2 in muls else ""


def _grade(key: str, answer: Any, check_fix: Callable[[_Case, Any], str]) -> str:
    if not isinstance(answer, dict) or set(answer) != {"turn_off", "fix"}:
        raise ExerciseFailed(f'give {{"turn_off": "<switch>", "fix": ...}}; got {answer!r}')
    case = CASES[key]
    with _quiet():
        said = _check_switch(case, answer["turn_off"])
        fixed = check_fix(case, answer["fix"])
    return f"{said}; {fixed}"


# ---------------------------------------------------------------------------------------------
# reference solutions


@torch.library.custom_op("nb17::centre_if_long", mutates_args=())
def _centre_if_long(h: torch.Tensor) -> torch.Tensor:
    # Dynamo does not trace into a custom op: the branch on num_tokens runs at every call
    return h - h.mean(dim=0, keepdim=True) if h.shape[0] >= 16 else h.clone()


@_centre_if_long.register_fake
def _(h: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(h)


@torch.library.custom_op("nb17::refuse_nan", mutates_args=())
def _refuse_nan(h: torch.Tensor) -> torch.Tensor:
    # the check runs at every call: Dynamo does not trace into a custom op
    if torch.isnan(h).any():
        raise ValueError("NaN in the hidden states")
    return h.clone()


@_refuse_nan.register_fake
def _(h: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(h)


def _checked_fixed() -> type:
    class CheckedFixed(Checked):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.ops.nb17.refuse_nan(torch.relu(self.up(x))))

    return CheckedFixed


def _two_path_fixed() -> type:
    class TwoPathFixed(TwoPath):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.relu(torch.ops.nb17.centre_if_long(self.up(x))))

    return TwoPathFixed


def double_to_add_fixed(graph: torch.fx.Graph) -> None:
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target == aten.mul.Tensor and node.args[1] == 2:
            x = node.args[0]
            with graph.inserting_before(node):
                add = graph.call_function(aten.add.Tensor, (x, x))
            add.meta = dict(node.meta)
            node.replace_all_uses_with(add)
            graph.erase_node(node)


@exercise(
    "17.1",
    "a model that will not compile",
    hint="run it as configured, read what Dynamo says and where; then rerun it under the "
    "switches, from the narrowest up (§1, §3)",
    solution=lambda: {"turn_off": "mode=NONE", "fix": _checked_fixed()},
    wrong=lambda: {"turn_off": "backend=eager", "fix": _checked_fixed()},
    wrong_says="still goes wrong",
)
def grade_graph_break(answer: Any) -> str:
    return _grade("17.1", answer, _fix_class)


@exercise(
    "17.2",
    "a model right at one size, wrong at others",
    hint="compare it with eager at every size of nb17.SIZES; then ask which switch brings the "
    "guards back (§4)",
    solution=lambda: {"turn_off": "mode=STOCK_TORCH_COMPILE", "fix": _two_path_fixed()},
    wrong=lambda: {"turn_off": "mode=NONE", "fix": _two_path_fixed()},
    wrong_says="turns off more than the broken piece",
)
def grade_shape(answer: Any) -> str:
    return _grade("17.2", answer, _fix_class)


@exercise(
    "17.3",
    "a model wrong only with Inductor",
    hint="bisect as §6 does: the passes, then the backend, then the mode; then read the pass",
    solution=lambda: {"turn_off": "passes off", "fix": double_to_add_fixed},
    wrong=lambda: {"turn_off": "passes off", "fix": lambda graph: None},
    wrong_says="must still do its job",
)
def grade_pass(answer: Any) -> str:
    return _grade("17.3", answer, _fix_pass)
