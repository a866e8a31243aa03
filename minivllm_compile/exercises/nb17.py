"""Notebook 17's exercises: three broken models, given without their cause. For each, the student
names the one switch of vLLM's debugging guide that makes it right while turning off the least
(viz/debugging.SWITCHES), and gives the fix. The grader reruns the broken model under that switch
and under every narrower one (each rerun once per process), then runs the student's fix with
nothing turned off, each time against the same model run eagerly. A wrong switch is answered with
what it misses; the reruns' table (and the narrowest switch in it) is what the grader measured.

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
from minivllm_compile.exercises import ExerciseFailed, env, exercise, measured_once
from minivllm_compile.viz.debugging import (
    SWITCHES,
    Outcome,
    apply_switch,
    narrowest,
    run_and_compare,
    runner,
)

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


@measured_once
def _rerun(key: str, switch: str) -> tuple[bool, str]:
    """The broken model of `key`, built afresh under one switch ("": as configured), against eager.
    The same every time: a second try, or the table of a wrong answer, reuses it."""
    case, cc = CASES[key], config(key)
    with _quiet():
        if not switch:
            return run_and_compare(_build(case.broken), cc, inputs(), _reference(case))
        return run_and_compare(_build(case.broken), apply_switch(cc, switch), inputs(),
                               _reference(case), env=SWITCHES[switch].env)


def _reruns(key: str, switches: list[str]) -> str:
    """What the grader measured: each rerun's outcome, and the narrowest switch among them that
    makes the model right."""
    rows = [Outcome(name, *_rerun(key, name)) for name in switches]
    said = [f"{r.switch or 'as configured'}: {'ok, ' if r.ok else ''}{r.said}" for r in rows]
    best = ", ".join(narrowest(rows)) or "none of these"
    return "; ".join(said) + f"; narrowest that makes it right: {best}"


def _check_switch(case: _Case, switch: Any) -> str:
    if switch not in SWITCHES:
        raise ExerciseFailed(
            f"'turn_off' names one switch, as a string: one of {list(SWITCHES)}; got {switch!r}"
        )
    # (that the model goes wrong as configured is tests/teaching/test_exercises_nb17.py's to check,
    # not each grading's)
    if not _rerun(case.key, switch)[0]:
        raise ExerciseFailed(
            f"rerun with {switch}, the broken model still goes wrong: {switch} leaves the broken "
            "piece on. Rerun it under the other switches, from the narrowest up (§1's table; §6 "
            "shows how)",
            measured=_reruns(case.key, ["", *SWITCHES]),
        )
    narrower = [s.name for s in SWITCHES.values() if s.narrower_than(SWITCHES[switch])]
    if any(_rerun(case.key, name)[0] for name in narrower):
        raise ExerciseFailed(
            f"{switch} makes it right, but it turns off more than the broken piece: a switch that "
            "turns off less also does (compare what each one turns off, §1's table)",
            measured=_reruns(case.key, [switch, *narrower]),
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
    measured = (f"{fix.__name__} compiled as configured "
                f"{'matches eager' if ok else 'does not match eager: ' + said}; "
                f"Dynamo traced it {traces} times")
    if not ok:
        how = "runs but differs from eager" if said.startswith("wrong at") else "fails"
        raise ExerciseFailed(
            f"your fix, compiled as the broken model was ({config(case.key).mode.name}), {how}: "
            f"what broke the model is still in its forward ({case.section} shows the ways out)",
            measured=measured)
    if traces != 1:
        raise ExerciseFailed(
            "your fix matches eager, but Dynamo did not trace it exactly once: it must still "
            f"compile, as one graph for every size (no ignore_torch_compile; {case.section})",
            measured=measured)
    if case.key == "17.1" and not _refuses_nan(fix):
        raise ExerciseFailed(
            "your fix compiles and matches eager, but lets a NaN through: the check is what this "
            "model is for. Keep it, where Dynamo does not trace it (§3's fixes)",
            measured=f"{measured}; with a NaN in its input it returned a tensor, no error")
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
    measured = f"{case.broken.__name__} compiled with your pass: {said}"
    if not ok:
        raise ExerciseFailed(
            "with your pass the compiled model still goes wrong: the pass still changes what the "
            f"model computes. Run it on a small graph, before and after, as {case.section} does",
            measured=measured)
    left = _muls_left(fix)
    if 2 in left:
        raise ExerciseFailed(
            "your pass leaves x * 2 in a graph that has one: it must still do its job, x * 2 into "
            "x + x, and nothing else", measured=f"{measured}; on (x * 2) * 3, the multiplies your "
            f"pass left: {', '.join(f'* {c}' for c in left)}")
    return "your pass turns x * 2 into x + x and leaves every other multiply alone."


def _muls_left(pass_: Callable[[torch.fx.Graph], None]) -> list:
    """Run the pass on a small graph, (x * 2) * 3: the constants still multiplied by after it."""

    def f(x):
        return (x * 2) * 3

    gm = make_fx(f)(torch.ones(4))
    pass_(gm.graph)
    aten = torch.ops.aten
    return [n.args[1] for n in gm.graph.nodes
            if n.op == "call_function" and n.target == aten.mul.Tensor]


def _grade(key: str, answer: Any, check_fix: Callable[[_Case, Any], str]) -> str:
    if not isinstance(answer, dict) or set(answer) != {"turn_off", "fix"}:
        raise ExerciseFailed(f'give {{"turn_off": "<switch>", "fix": ...}}; got {answer!r}')
    case = CASES[key]
    with _quiet():
        said = _check_switch(case, answer["turn_off"])
        fixed = check_fix(case, answer["fix"])
    return f"{said}; {fixed}"


# ---------------------------------------------------------------------------------------------
# reference solutions (their source is what exercises.solution_source shows)


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


def graph_break_solution() -> dict:
    class CheckedFixed(Checked):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.ops.nb17.refuse_nan(torch.relu(self.up(x))))  # custom op above

    # STOCK_TORCH_COMPILE compiles with fullgraph=True too: the same graph break
    return {"turn_off": "mode=NONE", "fix": CheckedFixed}


def shape_solution() -> dict:
    class TwoPathFixed(TwoPath):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down(torch.relu(torch.ops.nb17.centre_if_long(self.up(x))))  # custom op

    # plain torch.compile keeps the shape guard and retraces below 16 tokens
    return {"turn_off": "mode=STOCK_TORCH_COMPILE", "fix": TwoPathFixed}


def pass_solution() -> dict:
    def double_to_add_fixed(graph: torch.fx.Graph) -> None:
        aten = torch.ops.aten
        for node in list(graph.nodes):
            # the bug: every multiply by a constant was rewritten, x * 3 into x + x too
            if node.op == "call_function" and node.target == aten.mul.Tensor \
                    and node.args[1] == 2:
                x = node.args[0]
                with graph.inserting_before(node):
                    add = graph.call_function(aten.add.Tensor, (x, x))
                add.meta = dict(node.meta)
                node.replace_all_uses_with(add)
                graph.erase_node(node)

    # Inductor and the mode are innocent: only the passes need to go
    return {"turn_off": "passes off", "fix": double_to_add_fixed}


@exercise(
    "17.1",
    "a model that will not compile",
    section="notebook 17 §3 (Dynamo: a graph break) and §1 (the switches)",
    hint="run it as configured, read what Dynamo says and where; then rerun it under the "
    "switches, from the narrowest up (§1, §3)",
    deeper_hint="Call runner(nb17.Checked(compilation_config=nb17.config('17.1'))) on each "
    "of nb17.inputs(): the error names what Dynamo cannot put in a graph, and its last "
    "lines (from user code) the line of forward. Then rerun(lambda cc: "
    "runner(nb17.Checked(compilation_config=cc)), nb17.config('17.1'), nb17.inputs(), "
    "nb17.Checked()) reruns a fresh model under every switch, as §6 does; "
    "print(table(rows)) and ask which switches that make it right have no narrower one "
    "that does too. For the fix, of §3's three ways out, which keeps forward one compiled "
    "graph and still runs the check at every call?",
    solution=graph_break_solution,
    wrong=lambda: {**graph_break_solution(), "turn_off": "backend=eager"},
    wrong_says="still goes wrong",
    gives_away="narrowest that makes it right: mode=NONE",
)
def grade_graph_break(answer: Any) -> str:
    return _grade("17.1", answer, _fix_class)


@exercise(
    "17.2",
    "a model right at one size, wrong at others",
    section="notebook 17 §4 (dynamic shapes: a specialisation) and §1 (the switches)",
    hint="compare it with eager at every size of nb17.SIZES; then ask which switch brings the "
    "guards back (§4)",
    deeper_hint="Build runner(nb17.TwoPath(compilation_config=nb17.config('17.2'))) and the "
    "eager nb17.TwoPath(), and compare them on each of nb17.inputs() in order: the first call "
    "traces, at the warm-up size. Which sizes go wrong, and which line of forward decides by the "
    "number of tokens? vLLM's modes drop the guard Dynamo put on that line; §5 shows a mode that "
    "keeps its guards and traces again when one fails. Check your choice with rerun and "
    "table, as §6 uses them: no narrower switch may also make it right. For the fix, §4's last "
    "cell moves a branch on the size to where it runs at every call, at the call's size.",
    solution=shape_solution,
    wrong=lambda: {**shape_solution(), "turn_off": "mode=NONE"},
    wrong_says="turns off more than the broken piece",
    gives_away="narrowest that makes it right: mode=STOCK_TORCH_COMPILE",
)
def grade_shape(answer: Any) -> str:
    return _grade("17.2", answer, _fix_class)


@exercise(
    "17.3",
    "a model wrong only with Inductor",
    section="notebook 17 §6 (Inductor: a wrong result) and §1 (the switches)",
    hint="bisect as §6 does: the passes, then the backend, then the mode; then read the pass",
    deeper_hint="rerun(lambda cc: nb17.Doubler(compilation_config=cc), nb17.config('17.3'), "
    "nb17.inputs(), nb17.Doubler(), switches=[\"passes off\", \"backend=eager\", \"mode=NONE\"]) "
    "bisects as §6 does; narrowest(rows) reads off where to look. Then read the user's pass, "
    "print(inspect.getsource(nb17.double_to_add)), and run it on a small graph as §6 does: "
    "make_fx of a function that multiplies by 2 and then by another constant, the code before "
    "and after with unified_diff. Which multiplies does the pass rewrite, and which should it? "
    "Your pass must still rewrite what the pass is for.",
    solution=pass_solution,
    wrong=lambda: {**pass_solution(), "fix": lambda graph: None},
    wrong_says="must still do its job",
    gives_away="node.args[1] == 2",
)
def grade_pass(answer: Any) -> str:
    return _grade("17.3", answer, _fix_pass)
