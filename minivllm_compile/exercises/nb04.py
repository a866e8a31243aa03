"""Notebook 04's exercises: the bytecode hook and the `__code__` swap (seed §3, §8).

Both graders compile small decorated modules defined here, each with a `forward` code object of
its own: Dynamo keeps its cache entries on the code object, and the hook's first call runs
`remove_from_cache` on it, so a grader compiling the notebook's LlamaModel would wipe the cache
entries of the notebook's own models."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from minivllm_compile import (
    CompilationConfig,
    CompilationMode,
    compilation_counter,
    support_torch_compile,
)
from minivllm_compile.exercises import ExerciseFailed, env, exercise
from minivllm_compile.viz.dynamo_entries import count_dynamo_entries




def _trace_once(**kw: Any) -> CompilationConfig:
    return CompilationConfig(mode=CompilationMode.DYNAMO_TRACE_ONCE, backend="eager", **kw)


def _forget(cls: type) -> None:
    # drop Dynamo's cache entries for cls.forward (their guards are dropped: a stale one would serve)
    torch._dynamo.eval_frame.remove_from_cache(cls.forward.__code__)


# --- 04.1: two models, one code object -----------------------------------------------------------

@support_torch_compile
class Toy(nn.Module):
    """A one-Linear stand-in for the decoder: decorated like LlamaModel, with its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x))


# (which model, num_tokens): `off` is built with VLLM_USE_BYTECODE_HOOK=0, `on` with 1, both before call 1
CALLS = (("off", 8), ("off", 3), ("on", 8), ("on", 3), ("off", 5), ("on", 5))


def run_calls() -> dict[str, Any]:
    """Make CALLS on two fresh Toys; per call: new Dynamo traces, and whether Dynamo was entered."""
    _forget(Toy)
    with env(VLLM_USE_BYTECODE_HOOK="0"):
        off = Toy(compilation_config=_trace_once())
    with env(VLLM_USE_BYTECODE_HOOK="1"):
        on = Toy(compilation_config=_trace_once())
    models = {"off": off, "on": on}
    traces, entered = [], []
    try:
        for which, n in CALLS:
            before = compilation_counter.num_dynamo_traces
            with env(VLLM_USE_BYTECODE_HOOK="1" if which == "on" else "0"), count_dynamo_entries() as entries:
                models[which](torch.randn(n, 8))
            traces.append(compilation_counter.num_dynamo_traces - before)
            entered.append(entries.count > 0)
        # a retrace is not a first call: nothing marks the dims dynamic, so its graph is static
        static_retrace = len(off.captured_graphs) > 1 and all(
            isinstance(d, int) for d in off.captured_graphs[-1].graph.find_nodes(op="placeholder")[-1]
            .meta["example_value"].shape)
    finally:
        _forget(Toy)
    return {"traces": traces, "entered": entered, "static_retrace": static_retrace}


def _why_trace(i: int, got: int) -> str:
    which = CALLS[i][0]
    first = next(j for j, (w, _) in enumerate(CALLS) if w == which) == i
    if first:
        return f"it is the {which} model's first call, and a first call always traces"
    if which == "on":
        return ("after its first call the hook-on model only swaps its captured code into "
                "forward.__code__ and calls forward as plain Python: Dynamo cannot trace what it never sees")
    if got:
        return ("call 3, the hook-on model's first call, ran remove_from_cache(Toy.forward.__code__), which "
                "drops every cache entry of that code object, the hook-off model's too (both models run "
                "the same class's forward): the hook-off model's next call finds no entry and Dynamo traces "
                "again")
    return "its cache entry is still there (guards dropped, so it serves every size)"


def _grade_calls(answer: Any) -> str:
    if not (isinstance(answer, dict) and set(answer) == {"traces", "entered"}
            and all(isinstance(answer[k], (list, tuple)) and len(answer[k]) == len(CALLS) for k in answer)):
        raise ExerciseFailed(f'answer with {{"traces": [{len(CALLS)} ints], "entered": [{len(CALLS)} bools]}}, '
                             "one entry per call in nb04.CALLS, in order")
    truth = run_calls()
    wrong = []
    for i, (which, n) in enumerate(CALLS):
        said, got = answer["traces"][i], truth["traces"][i]
        if said != got:
            wrong.append(f"call {i + 1} ({which}, {n} tokens): you predicted {said} new trace(s), Dynamo made "
                         f"{got}: {_why_trace(i, got)}")
    for i, (which, n) in enumerate(CALLS):
        said, got = bool(answer["entered"][i]), truth["entered"][i]
        if said != got:
            why = ("with the hook off every call goes through Dynamo's frame evaluation to find its cache "
                   "entry (section 3)" if which == "off" else
                   "its first call is a Dynamo compile" if got else
                   "with the hook on, a later call never enters Dynamo (section 3)")
            wrong.append(f"call {i + 1} ({which}, {n} tokens): you said Dynamo was{'' if said else ' not'} "
                         f"entered; it was{'' if got else ' not'}: {why}")
    if wrong:
        raise ExerciseFailed("; ".join(wrong))
    static = (" That retrace happened outside a first call, so no dims were marked dynamic: its graph fits "
              "5 tokens only, and with the guards dropped nothing would stop it serving other sizes."
              if truth["static_retrace"] else "")
    return ("Two instances share one forward code object and so one list of Dynamo cache entries: the "
            "hook-on model's remove_from_cache at its first call made the hook-off model trace again (call 5)."
            + static + " That is why section 3 builds its hook-off model after the hook-on model's first "
            "call, and why a process uses one VLLM_USE_BYTECODE_HOOK setting for every model.")


@exercise("04.1", "two models, one code object",
          hint="a first call always traces; with the hook on, later calls never enter Dynamo; and look at "
               "what the hook-on model's first call does before compiling (wrapper.py, __call__)",
          solution=lambda: {"traces": [1, 0, 1, 0, 1, 0], "entered": [True, True, True, False, True, False]},
          wrong=lambda: {"traces": [1, 0, 1, 0, 0, 0], "entered": [True, True, True, False, True, False]},
          wrong_says="remove_from_cache")
def grade_two_models(answer: Any) -> str:
    return _grade_calls(answer)


# --- 04.2: which state changes does the hook's `update` check refuse? --------------------------

@support_torch_compile
class Rebind(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        return x * 2


@support_torch_compile
class InPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.add_(1)
        return x * 2


@support_torch_compile
class Augmented(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count += 1
        return x * 2


@support_torch_compile
class IntAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0  # a plain Python int, not a buffer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count = self.count + 1
        return x * 2


STATE_MODELS = {"rebind": Rebind, "add_": InPlace, "+=": Augmented, "int attribute": IntAttribute}


def _count_lines(cls: type) -> list[str]:
    return [line.split("  #")[0].strip() for line in inspect.getsource(cls).splitlines() if "count" in line]


# what `count` is (its line in __init__) and what forward does to it, for the notebook to print
STATE_VARIANTS = {name: tuple(_count_lines(cls)) for name, cls in STATE_MODELS.items()}
CALLS_PER_MODEL = 3


def state_truth() -> dict[str, tuple[bool, int]]:
    """Per variant: (the hook's check refuses it under cudagraph_mode="FULL", `count` after
    CALLS_PER_MODEL calls under cudagraph_mode="NONE"), both with the hook on."""
    truth = {}
    with env(VLLM_USE_BYTECODE_HOOK="1"):
        for name, cls in STATE_MODELS.items():
            try:
                try:
                    cls(compilation_config=_trace_once(cudagraph_mode="FULL"))(torch.ones(4))
                    refused = False
                except RuntimeError as e:  # Dynamo wraps the hook's error in InternalTorchDynamoError
                    if "forward assigns a buffer" not in str(e):
                        raise
                    refused = True
                model = cls(compilation_config=_trace_once())
                for _ in range(CALLS_PER_MODEL):
                    model(torch.ones(4))
                truth[name] = (refused, int(model.count))
            finally:
                _forget(cls)
    return truth


_WHY = {
    "rebind": "`self.count = self.count + 1` binds a new tensor to the buffer: the graph returns it and the "
              "transformed code replays the assignment with self._buffers.update(...) after the graph",
    "add_": "`add_` writes the buffer itself (the graph mutates an input); the transformed code assigns "
            "nothing, so there is no `update` to find, and a captured graph would write the same memory",
    "+=": "Python runs `self.count += 1` as `self.count = self.count.__iadd__(1)`: the graph adds in place "
          "and returns the buffer, and the transformed code replays the assignment with "
          "self._buffers.update(...); the check looks for `update`, so it refuses this one too (even though "
          "the tensor assigned is the buffer itself)",
    "int attribute": "a Python int is a constant to Dynamo: the one trace computed 0 + 1 = 1, and the "
                     "transformed code sets the attribute to that constant on every call (it is not a "
                     "buffer, so no `update`, and the check does not fire). With the guards dropped nothing "
                     "notices that the value changed",
}


def _grade_state(answer: Any) -> str:
    if not (isinstance(answer, dict) and set(answer) == set(STATE_MODELS) and all(
            isinstance(v, (tuple, list)) and len(v) == 2 for v in answer.values())):
        raise ExerciseFailed(f"answer with {{variant: (refused under FULL, count after {CALLS_PER_MODEL} calls "
                             f"under NONE)}} for the variants {list(STATE_MODELS)}")
    truth = state_truth()
    wrong = []
    for name, (refused, count) in truth.items():
        said_refused, said_count = answer[name]
        if bool(said_refused) != refused:
            wrong.append(f"{name!r}: you said the check {'refuses' if said_refused else 'allows'} it under "
                         f"cudagraph_mode='FULL'; it {'refuses' if refused else 'allows'} it ({_WHY[name]})")
        if said_count != count:
            wrong.append(f"{name!r}: you predicted count {said_count} after {CALLS_PER_MODEL} calls with "
                         f"cudagraph_mode='NONE'; it is {count} ({_WHY[name]})")
    if wrong:
        raise ExerciseFailed("; ".join(wrong))
    return ("The check refuses exactly the forwards whose transformed code contains `update`: any "
            "assignment to a buffer attribute, `+=` included (it is an assignment in Python). An in-place "
            "method call such as add_ writes the buffer's own memory, which a captured graph replays; and a "
            "Python attribute is frozen at its traced value, with no check at all.")


@exercise("04.2", "which state changes does the hook's check refuse?",
          hint="decompile each variant's transformed code (model._compiled_bytecode, wrapper.decompile) "
               "and search for `update`; and ask what Dynamo makes of a Python int",
          solution=lambda: {"rebind": (True, 3), "add_": (False, 3), "+=": (True, 3), "int attribute": (False, 1)},
          wrong=lambda: {"rebind": (True, 3), "add_": (False, 3), "+=": (False, 3), "int attribute": (False, 3)},
          wrong_says="self._buffers.update")
def grade_state_changes(answer: Any) -> str:
    return _grade_state(answer)
