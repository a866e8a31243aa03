"""Exercises of notebook 02 (tracing once): graphs with and without mark_dynamic under
dynamic=False (02.1), the counters of a DYNAMO_TRACE_ONCE model's life (02.2), and the files the
trace reads when the custom ops are off (02.3). Each grader runs the real thing to get the truth."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from minivllm_compile.exercises import ExerciseFailed, exercise, measured_once

# ---------------------------------------------------------------------------------------------
# 02.1: dynamic=False, with and without mark_dynamic

CALL_SIZES = (8, 5, 8, 1, 3)  # the calls of 02.1, in order


def scale_by_len(x: torch.Tensor) -> torch.Tensor:  # the notebook's toy, §2
    return x * x.shape[0]


def graphs_after_each_call(mark_first: bool) -> list[int]:
    """torch.compile(scale_by_len, fullgraph=True, dynamic=False) with a backend that records the
    graphs it is given; call it at CALL_SIZES (mark_dynamic(x, 0) on the first input when
    `mark_first`) and return how many graphs the backend holds after each call."""
    graphs = []

    def recording_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    code = scale_by_len.__code__
    # Dynamo keeps its cache entries (and its recompile limit) per code object: start and end clean,
    # so a second grading neither reuses nor counts the first one's graphs
    torch._dynamo.eval_frame.remove_from_cache(code)
    try:
        compiled = torch.compile(scale_by_len, fullgraph=True, dynamic=False,
                                 backend=recording_backend)
        after = []
        for i, n in enumerate(CALL_SIZES):
            x = torch.ones(n)
            if mark_first and i == 0:
                torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), x * n)
            after.append(len(graphs))
        return after
    finally:
        torch._dynamo.eval_frame.remove_from_cache(code)


@measured_once
def _graphs_truth() -> dict[str, list[int]]:
    return {"static": graphs_after_each_call(False), "marked": graphs_after_each_call(True)}


_MISSED = {  # (which, predicted too many): what that prediction misses
    ("static", True): "a call at a size seen before passes the guards of the graph traced "
                      "at that size, and runs it",
    ("static", False): "with dynamic=False each size is a constant in its graph, and "
                       "stock torch.compile keeps its guards: a call at a size no graph "
                       "was traced at fails them all",
    ("marked", True): "the marked first call's graph is symbolic in num_tokens: a later call that "
                      "passes its guards runs it, whatever its size",
    ("marked", False): "the marked call made num_tokens a symbol, but the trace also assumed "
                       "something about that symbol (Dynamo specialises the sizes 0 and 1), and "
                       "stock torch.compile keeps that guard. Does every later call pass it? A "
                       "later tensor is not marked, and dynamic=False",
}


@exercise(
    "02.1", "graphs with and without mark_dynamic", section="notebook 02 §2 (dynamic=False, and "
                                                            "still a SymInt)",
    hint="for each call, ask: does a graph the backend already has fit this size? A constant fits "
         "one size; a symbol fits the sizes its guards allow",
    deeper_hint="Write the five calls in a column, and beside them the graphs the backend holds. "
                "'static': each graph has its size baked in as a constant (§2's first cell prints "
                "`* 8`), and every guard is checked at every call, so a call traces when no graph "
                "was made at its size. 'marked': the first graph has a symbol for num_tokens; "
                "while tracing at 8, Dynamo assumed something about it (seed §2: a marked size is "
                "assumed to be neither 0 nor 1). Test each later size against that assumption: a "
                "call that fails it is traced again, and its tensor is not marked.",
    solution=lambda: {"static": 4, "marked": 2},
    wrong=lambda: {"static": 4, "marked": 1},
    wrong_says="specialises the sizes 0 and 1",
    gives_away="marked: the backend received 2 graph(s)",
)
def grade_graphs(answer: Any) -> str:
    if not isinstance(answer, dict) or set(answer) != {"static", "marked"} \
            or not all(isinstance(v, int) for v in answer.values()):
        raise ExerciseFailed("answer with a dict {'static': <graphs>, 'marked': <graphs>} of two "
                             "ints: how many graphs each compiled function's backend holds after "
                             f"the calls at {list(CALL_SIZES)}")
    truth = _graphs_truth()
    wrong = []
    for which, after in truth.items():
        if answer[which] != after[-1]:
            too_many = answer[which] > after[-1]
            wrong.append(f"{which}: you predicted {answer[which]} graph(s), too "
                         f"{'many' if too_many else 'few'}: {_MISSED[which, too_many]}.")
    if wrong:
        raise ExerciseFailed("\n".join(wrong), measured="; ".join(
            f"{which}: the backend received {after[-1]} graph(s) (after each call: {after})"
            for which, after in truth.items()))
    return (f"Static: {truth['static'][-1]} graphs (one per distinct size), marked: "
            f"{truth['marked'][-1]} (the symbolic one, plus a static one for the 1-token call its "
            "0/1 guard refused). Under the decorator that guard is dropped too (§3), so the "
            "1-token call runs the symbolic graph.")


# ---------------------------------------------------------------------------------------------
# 02.2: the counters of a DYNAMO_TRACE_ONCE model's life

COUNTERS = ("num_models_seen", "num_dynamo_traces", "num_graphs_seen", "num_backend_compilations")
STEPS = ("build", "first call", "more calls", "second model")


@measured_once
def counter_scenario() -> dict[str, dict[str, int]]:
    """02.2's scenario: what each step changes in the compilation_counter."""
    from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter
    from minivllm_compile.models import build_model

    def tokens(n):
        return torch.arange(n) % 200 + 1, torch.arange(n)

    deltas = {}

    @contextmanager
    def step(name):
        before = compilation_counter.clone()
        yield
        deltas[name] = {c: getattr(compilation_counter, c) - getattr(before, c) for c in COUNTERS}

    cc = CompilationConfig(mode=CompilationMode.DYNAMO_TRACE_ONCE, backend="eager",
                           compile_sizes=[4, 8], max_num_batched_tokens=64)
    with step("build"):
        lm = build_model("llama", num_layers=1, compilation_config=cc, device="cpu")
    with step("first call"):
        lm(*tokens(8))
    with step("more calls"):
        for n in (4, 3, 8, 17):
            lm(*tokens(n))
    with step("second model"):
        lm2 = build_model("llama", num_layers=1, compilation_config=cc, device="cpu")
        lm2(*tokens(8))
    return deltas


_QUESTIONS = {  # what a wrong entry misses: a question that leads to it, never the number
    "num_models_seen": {"*": "the decorator counts a model in its __init__: what "
                             "does this step construct?"},
    "num_dynamo_traces": {
        "build": "torch.compile is lazy (§1): what runs at construction?",
        "first call": "lm(...) first runs a warm-up at max_num_batched_tokens, then the call "
                      "itself: with the guards dropped, which of the two traces? compile_sizes "
                      "belongs to VLLM_COMPILE's piecewise backend (notebook 07), not to this mode",
        "more calls": "the guards are dropped (§3): what would make a later size trace again?",
        "second model": "a second instance has its own torch.compile and backend (and with the "
                        "bytecode hook on, its first call drops Dynamo's cache entry for forward, "
                        "notebook 04): does it trace?",
    },
    "num_graphs_seen": {"*": "it counts the Dynamo graphs handed to VllmBackend: which backend "
                             "does DYNAMO_TRACE_ONCE hand its graph to (wrapper.py)?"},
    "num_backend_compilations": {"*": "it counts VllmBackend's compiles of a piece for a size or "
                                      "range: does this mode split the graph into pieces?"},
}


@exercise(
    "02.2", "the counters of a model's life", section="notebook 02 §1 and §3",
    hint="answer {step: {counter: delta}} for the steps 'build', 'first call', 'more calls', "
         "'second model' and the counters num_models_seen, num_dynamo_traces, num_graphs_seen, "
         "num_backend_compilations; for each counter, find where the code moves it",
    deeper_hint="grep the package for each counter's name: num_models_seen moves in the "
                "decorator's __init__, num_dynamo_traces in the wrapper when Dynamo hands it a "
                "graph, num_graphs_seen and num_backend_compilations in backends.py (VllmBackend). "
                "Then walk the function: construction (§1: lazy), the first call (lm.__call__ runs "
                "a warm-up first: models/lm.py), the later calls (§3: no guards), a second model "
                "(its own wrapper; notebook 04 §3 on what the hook's first call does).",
    solution=lambda: {
        "build": {"num_models_seen": 1, "num_dynamo_traces": 0, "num_graphs_seen": 0,
                  "num_backend_compilations": 0},
        "first call": {"num_models_seen": 0, "num_dynamo_traces": 1, "num_graphs_seen": 0,
                       "num_backend_compilations": 0},
        "more calls": {"num_models_seen": 0, "num_dynamo_traces": 0, "num_graphs_seen": 0,
                       "num_backend_compilations": 0},
        "second model": {"num_models_seen": 1, "num_dynamo_traces": 1, "num_graphs_seen": 0,
                         "num_backend_compilations": 0},
    },
    wrong=lambda: {
        "build": {"num_models_seen": 1, "num_dynamo_traces": 0, "num_graphs_seen": 0,
                  "num_backend_compilations": 0},
        "first call": {"num_models_seen": 0, "num_dynamo_traces": 1, "num_graphs_seen": 1,
                       "num_backend_compilations": 2},
        "more calls": {"num_models_seen": 0, "num_dynamo_traces": 0, "num_graphs_seen": 0,
                       "num_backend_compilations": 0},
        "second model": {"num_models_seen": 1, "num_dynamo_traces": 0, "num_graphs_seen": 0,
                         "num_backend_compilations": 0},
    },
    wrong_says="VllmBackend",
    gives_away="'first call' num_graphs_seen: 0",
)
def grade_counters(answer: Any) -> str:
    shape_ok = isinstance(answer, dict) and set(answer) == set(STEPS) and all(
        isinstance(answer[s], dict) and set(answer[s]) == set(COUNTERS) for s in STEPS)
    if not shape_ok:
        raise ExerciseFailed("answer with a dict {step: {counter: delta}}: the steps "
                             f"{list(STEPS)}, each with the counters {list(COUNTERS)}")
    truth = counter_scenario()
    wrong, measured = [], []
    for step in STEPS:
        for c in COUNTERS:
            if answer[step][c] != truth[step][c]:
                questions = _QUESTIONS[c]
                question = questions.get(step, questions.get("*"))
                wrong.append(f"'{step}' {c}: not {answer[step][c]!r}. "
                             f"{question[0].upper()}{question[1:]}")
                measured.append(f"'{step}' {c}: {truth[step][c]}")
    if wrong:
        raise ExerciseFailed("\n".join(wrong), measured="; ".join(measured))
    return ("Construction counts a model and traces nothing; the first call is the one trace (the "
            "warm-up's, compile_sizes notwithstanding); later sizes reuse it; a second model "
            "traces again for itself; and VllmBackend's counters stay at 0 in DYNAMO_TRACE_ONCE.")


# ---------------------------------------------------------------------------------------------
# 02.3: the traced files, with the custom ops off

@measured_once
def traced_files(custom_ops: tuple[str, ...]) -> frozenset[str]:
    """compilation_config.traced_files after the first call of a 1-layer Llama decoder."""
    from minivllm_compile import CompilationConfig, CompilationMode
    from minivllm_compile.models import build_model

    cc = CompilationConfig(mode=CompilationMode.DYNAMO_TRACE_ONCE, backend="eager",
                           max_num_batched_tokens=32,
                           custom_ops=list(custom_ops))
    build_model("llama", num_layers=1, compilation_config=cc, device="cpu")(torch.arange(4) + 1,
                                                                            torch.arange(4))
    return frozenset(cc.traced_files)


def _short(path: str) -> str:
    # minivllm_compile/models/layers.py, kernels/..., torch/nn/modules/linear.py: from the package's
    # parent or torch's, whichever holds it
    import minivllm_compile

    for root in (Path(minivllm_compile.__file__).parent.parent, Path(torch.__file__).parent.parent):
        if Path(path).is_relative_to(root):
            return str(Path(path).relative_to(root))
    return path


def _matches(entry: str, path: str) -> bool:
    entry = str(entry).replace("\\", "/").lstrip("/")
    return path.replace("\\", "/").endswith("/" + entry) or path == entry


@exercise(
    "02.3", "the traced files with the custom ops off", section="notebook 02 §4 (the traced files)",
    hint="follow each layer's `if not self.use_custom_op:` branch in "
         "minivllm_compile/models/layers.py: which Python functions does it call, and which of "
         "those does Dynamo inline (a file joins) rather than put in the graph as one call "
         "(torch.* functions, custom ops)?",
    deeper_hint="Open models/layers.py at RMSNorm, SiluAndMul and RotaryEmbedding. For each "
                "plain-torch branch, list the calls it makes and where each callee is defined: in "
                "layers.py itself (already traced), in torch (a torch.* function is one node in "
                "the graph; Dynamo does not read its Python body), or elsewhere in the package "
                "(Dynamo steps into it, and its file joins traced_files).",
    solution=lambda: {"kernels/rotary_embedding.py"},
    wrong=lambda: {"kernels/rotary_embedding.py", "torch/nn/functional.py"},
    wrong_says="functional.py",
    gives_away="kernels/rotary_embedding.py",
)
def grade_traced_files(answer: Any) -> str:
    if isinstance(answer, (str, Path)) or not isinstance(answer, (set, list, tuple, frozenset)):
        raise ExerciseFailed("answer with a set of file paths (as the notebook's "
                             "`shown` prints them, e.g. 'torch/nn/modules/linear.py'), "
                             "the files that join traced_files")
    default, off = traced_files(("all",)), traced_files(("none",))
    joined = off - default
    wrong = []
    for entry in answer:
        if any(_matches(entry, p) for p in joined):
            continue
        if any(_matches(entry, p) for p in default):
            wrong.append(f"{entry} is traced with the custom ops on too (§4's list): "
                         "give only the files that join")
        elif "functional" in str(entry) or str(entry).startswith("torch/_"):
            wrong.append(f"{entry} does not join: torch.nn.functional.silu (like every torch.* "
                         "function) goes into the graph as one call; Dynamo knows it and does "
                         "not inline its Python body")
        elif str(entry).endswith("ops.py"):
            wrong.append(f"{entry} does not join: a custom op is a leaf for Dynamo, on or off (its "
                         "Python body never runs while tracing); with custom_ops=['none'] the "
                         "layers just stop calling most")
        else:
            wrong.append(f"{entry} does not join: Dynamo inlined no function from it")
    missing = [path for path in joined if not any(_matches(entry, path) for entry in answer)]
    if missing:
        wrong.append(f"{len(missing)} file(s) that join are missing: a layer's plain-torch "
                     "branch calls a Python function defined outside layers.py and outside "
                     "torch, and Dynamo inlines it (patched_inline_call records its file). Which "
                     "branch calls such a function?")
    if wrong:
        raise ExerciseFailed("\n".join(wrong), measured="the files that join: "
                             + ", ".join(sorted(_short(p) for p in joined)))
    return (f"{', '.join(sorted(_short(p) for p in joined))} joins: RotaryEmbedding's plain-torch "
            "branch calls rotary_embedding_ref, inlined; RMSNorm's forward_native is in layers.py "
            "already, and SiluAndMul's torch.nn.functional.silu goes into the graph as one call. A "
            "file that joins is a file whose edits now change the compile-cache key (notebook 09).")
