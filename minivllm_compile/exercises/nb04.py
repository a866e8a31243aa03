"""Notebook 04's exercises: the bytecode hook and Dynamo's transformed code (seed §3, §8).

Both graders compile small decorated modules defined here. 04.1 compiles them as vLLM does, every
instance on the class's one forward code object (SharedCodeToy), to show what that costs: Dynamo
keeps its cache entries on the code object, and the hook's first call runs `remove_from_cache` on
it."""

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
from minivllm_compile.exercises import ExerciseFailed, env, exercise, measured_once
from minivllm_compile.viz.dynamo_entries import count_dynamo_entries


def _trace_once(**kw: Any) -> CompilationConfig:
    return CompilationConfig(mode=CompilationMode.DYNAMO_TRACE_ONCE, backend="eager", **kw)


def _forget(cls: type) -> None:
    # drop Dynamo's cache entries for cls.forward (their guards are
    # dropped: a stale one would serve)
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


class SharedCodeToy(Toy):
    """Toy compiled as vLLM compiles a model: every instance compiles the class's forward, one
    code object shared by all of them (this package gives each instance a copy of its own)."""

    def own_forward(self):
        return type(self).forward


# (which model, num_tokens): `off` is built with VLLM_USE_BYTECODE_HOOK=0, `on`
# with 1, both before call 1
CALLS = (("off", 8), ("off", 3), ("on", 8), ("on", 3), ("off", 5), ("on", 5))


def run_calls(cls: type = SharedCodeToy) -> dict[str, Any]:
    """Make CALLS on two fresh instances of `cls`; per call: new Dynamo traces, and whether Dynamo
    was entered."""
    _forget(Toy)
    with env(VLLM_USE_BYTECODE_HOOK="0"):
        off = cls(compilation_config=_trace_once())
    with env(VLLM_USE_BYTECODE_HOOK="1"):
        on = cls(compilation_config=_trace_once())
    models = {"off": off, "on": on}
    traces, entered = [], []
    try:
        for which, n in CALLS:
            before = compilation_counter.num_dynamo_traces
            with env(VLLM_USE_BYTECODE_HOOK="1" if which == "on"
                     else "0"), count_dynamo_entries() as entries:
                models[which](torch.randn(n, 8))
            traces.append(compilation_counter.num_dynamo_traces - before)
            entered.append(entries.count > 0)
        # a retrace is not a first call: nothing marks the dims dynamic, so its graph is static
        static_retrace = len(off.captured_graphs) > 1 and all(
            isinstance(d, int)
            for d in off.captured_graphs[-1].graph.find_nodes(op="placeholder")[-1]
            .meta["example_value"].shape)
    finally:
        _forget(Toy)
    return {"traces": traces, "entered": entered, "static_retrace": static_retrace}


# run_calls itself stays uncached: a test watches its warning
_calls_truth = measured_once(run_calls)


def _trace_question(i: int, got: int) -> str:
    """What a wrong trace count at call i misses (a question, not the count)."""
    which = CALLS[i][0]
    if next(j for j, (w, _) in enumerate(CALLS) if w == which) == i:
        return "what does a model's first call do (the decorator's __call__)?"
    if which == "on":
        return ("after its first call, the hook-on model swaps its captured code into "
                "forward.__code__ and calls forward: can Dynamo trace a call it never sees?")
    if got:
        return ("what did the hook-on model's first call do before compiling (wrapper.py, "
                "__call__)? Both models run Toy.forward, one code object, and Dynamo keeps its "
                "cache entries on the code object")
    return ("a hook-off call looks up its code object's cache entry (guards dropped, it serves "
            "every size): is it still there?")


def _entered_question(i: int) -> str:
    which = CALLS[i][0]
    if which == "off":
        return "how does a hook-off call find its compiled code (§3)?"
    if next(j for j, (w, _) in enumerate(CALLS) if w == which) == i:
        return "what does a model's first call do?"
    return "what does a hook-on model's later call run, and through whom (§3)?"


def _grade_calls(answer: Any) -> str:
    if not (isinstance(answer, dict) and set(answer) == {"traces", "entered"}
            and all(isinstance(answer[k], (list, tuple)) and len(answer[k]) == len(CALLS)
                    for k in answer)):
        raise ExerciseFailed(f'answer with {{"traces": [{len(CALLS)} ints], '
                             f'"entered": [{len(CALLS)} bools]}}, '
                             "one entry per call in nb04.CALLS, in order")
    truth = _calls_truth()
    questions = {"traces": [], "entered": []}  # a wrong call's question, once per kind of call
    for i in range(len(CALLS)):
        if answer["traces"][i] != truth["traces"][i]:
            questions["traces"].append(_trace_question(i, truth["traces"][i]))
        if bool(answer["entered"][i]) != truth["entered"][i]:
            questions["entered"].append(_entered_question(i))
    wrong = [f"{what}: {len(qs)} of your {len(CALLS)} entries are wrong. Ask of them: "
             + " ".join(dict.fromkeys(qs)) for what, qs in questions.items() if qs]
    if wrong:
        raise ExerciseFailed("\n".join(wrong), measured=f"traces per call: {truth['traces']}; "
                             f"Dynamo entered per call: {truth['entered']}")
    static = (" That retrace happened outside a first call, so no dims were marked "
              "dynamic: its graph fits 5 tokens only, and with the guards dropped nothing "
              "would stop it serving other sizes."
              if truth["static_retrace"] else "")
    own = _own_code_truth()
    return ("Two instances share one forward code object and so one list of Dynamo cache "
            "entries: the hook-on model's remove_from_cache at its first call made the hook-off "
            "model trace again (call 5)."
            + static + " That is why vLLM runs one VLLM_USE_BYTECODE_HOOK setting per process. "
            "This package's own models do not share it: each instance compiles a copy of forward's "
            "code (TorchCompileWithNoGuardsWrapper.own_forward), so the same six calls on two "
            f"nb04.Toy make {own['traces']} traces: nothing drops another instance's entry.")


@measured_once
def _own_code_truth() -> dict[str, Any]:
    return run_calls(Toy)


@exercise("04.1", "two models, one code object", section="notebook 04 §3 (Dynamo entered: every "
          "call with the hook off, never with it on)",
          hint="for each call, ask: is it its model's first call? Is its model's hook on "
               "or off? And what did an earlier call do to the cache entries of the code "
               "object both models share?",
          deeper_hint="Open TorchCompileWithNoGuardsWrapper.__call__ "
                      "(minivllm_compile/compilation/wrapper.py) and read what a hook-on model "
                      "does on its first call, before it compiles: "
                      "which code object does it touch (original_code_object, and what "
                      "SharedCodeToy.own_forward gives it), and whose cache entries live there? "
                      "Then replay the six calls in order, keeping a note of which cache entries "
                      "Toy.forward's code object holds after each one.",
          solution=lambda: {"traces": [1, 0, 1, 0, 1, 0],
                            "entered": [True, True, True, False, True, False]},
          wrong=lambda: {"traces": [1, 0, 1, 0, 0, 0],
                         "entered": [True, True, True, False, True, False]},
          wrong_says="one code object",
          gives_away="traces per call: [1, 0, 1, 0, 1, 0]")
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
    return [line.split("  #")[0].strip() for line in inspect.getsource(cls).splitlines()
            if "count" in line]


# what `count` is (its line in __init__) and what forward does to it, for the notebook to print
STATE_VARIANTS = {name: tuple(_count_lines(cls)) for name, cls in STATE_MODELS.items()}
CALLS_PER_MODEL = 3


@measured_once
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
                # Dynamo wraps the hook's error in InternalTorchDynamoError
                except RuntimeError as e:
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


_WHY = {  # what each variant does: shown with the measured values
    "rebind": "`self.count = self.count + 1` binds a new tensor to the buffer: the graph "
              "returns it and the transformed code replays the assignment with "
              "self._buffers.update(...) after the graph",
    "add_": "`add_` writes the buffer itself (the graph mutates an input); the transformed "
            "code assigns nothing, so there is no `update` to find, and a captured graph "
            "would write the same memory",
    "+=": "Python runs `self.count += 1` as `self.count = self.count.__iadd__(1)`: the graph adds "
          "in place and returns the buffer, and the transformed code replays the assignment with "
          "self._buffers.update(...); the check looks for `update`, so it refuses this one too "
          "(even though the tensor assigned is the buffer itself)",
    "int attribute": "a Python int is a constant to Dynamo: the one trace computed 0 + 1 = 1, and "
                     "the transformed code sets the attribute to that constant on every call (it "
                     "is not a buffer, so no `update`, and the check does not fire). With the "
                     "guards dropped nothing notices that the value changed",
}
_REFUSED_QUESTION = {  # a wrong "refused?": what to look at
    "rebind": "decompile its transformed code (decompile(model._compiled_bytecode)): what does it "
              "do with the tensor forward binds to self.count, and is `update` among its names?",
    "add_": "an in-place method writes the buffer's own memory: does the transformed code assign "
            "anything back to the module?",
    "+=": "how does Python run `self.count += 1`? An augmented assignment is an assignment: "
          "decompile the transformed code and look for `update`",
    "int attribute": "is a plain int attribute a buffer, and what one "
                     "name does the check look for?",
}
_COUNT_QUESTION = {  # a wrong count: what to follow
    "rebind": "follow one call: where does the new value go, and does the next call read it?",
    "add_": "follow one call: which memory does add_ write, and does the next call read it?",
    "+=": "follow one call: where does the new value go, and does the next call read it?",
    "int attribute": "what is a Python int to Dynamo? The one trace saw count == 0; with the "
                     "guards dropped, what does every later call's transformed code set it to?",
}


def _grade_state(answer: Any) -> str:
    if not (isinstance(answer, dict) and set(answer) == set(STATE_MODELS) and all(
            isinstance(v, (tuple, list)) and len(v) == 2 for v in answer.values())):
        raise ExerciseFailed("answer with {variant: (refused under FULL, count after "
                             f"{CALLS_PER_MODEL} calls under NONE)}} for the "
                             f"variants {list(STATE_MODELS)}")
    truth = state_truth()
    wrong, measured = [], []
    for name, (refused, count) in truth.items():
        said_refused, said_count = answer[name]
        if bool(said_refused) != refused:
            wrong.append(f"{name!r}, refused under cudagraph_mode='FULL': not "
                         f"{bool(said_refused)}. "
                         f"{_REFUSED_QUESTION[name][0].upper()}{_REFUSED_QUESTION[name][1:]}")
        if said_count != count:
            wrong.append(f"{name!r}, count after {CALLS_PER_MODEL} calls: not {said_count!r}. "
                         f"{_COUNT_QUESTION[name][0].upper()}{_COUNT_QUESTION[name][1:]}")
        if bool(said_refused) != refused or said_count != count:
            measured.append(f"{name!r}: refused under FULL: {refused}, "
                            f"count {count} ({_WHY[name]})")
    if wrong:
        raise ExerciseFailed("\n".join(wrong), measured="; ".join(measured))
    return ("The check refuses exactly the forwards whose transformed code contains `update`: "
            "any assignment to a buffer attribute, `+=` included (it is an assignment in "
            "Python). An in-place method call such as add_ writes the buffer's own memory, "
            "which a captured graph replays; and a Python attribute is frozen at its traced "
            "value, with no check at all.")


@exercise("04.2", "which state changes does the hook's check refuse?", section="notebook 04 §5 "
          "(the hook's safety check: a forward that assigns a buffer)",
          hint="decompile each variant's transformed code "
               "(model._compiled_bytecode, wrapper.decompile) and search for "
               "`update`; and ask what Dynamo makes of a Python int",
          deeper_hint="Build one variant yourself, hook on, cudagraph_mode='NONE', call it once "
                      "and print decompile(model._compiled_bytecode): the assignments after the "
                      "graph call are what the transformed code replays. The check is `'update' in "
                      "code.co_names`. For the counts, remember that a buffer is a tensor (an "
                      "input of the graph, read fresh at every call) while a plain int is a "
                      "constant Dynamo folds into the trace.",
          solution=lambda: {"rebind": (True, 3), "add_": (False, 3), "+=": (True, 3),
                            "int attribute": (False, 1)},
          wrong=lambda: {"rebind": (True, 3), "add_": (False, 3), "+=": (False, 3),
                         "int attribute": (False, 3)},
          wrong_says="augmented assignment",
          gives_away="'+=': refused under FULL: True")
def grade_state_changes(answer: Any) -> str:
    return _grade_state(answer)
