"""Exercises of notebook 02 (tracing once): graphs with and without mark_dynamic under
dynamic=False (02.1), the counters of a DYNAMO_TRACE_ONCE model's life (02.2), and the files the
trace reads when the custom ops are off (02.3). Each grader runs the real thing to get the truth."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from minivllm_compile.exercises import ExerciseFailed, exercise

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
        compiled = torch.compile(scale_by_len, fullgraph=True, dynamic=False, backend=recording_backend)
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


def _new_graph_calls(after: list[int]) -> list[int]:
    return [n for n, a, b in zip(CALL_SIZES, [0, *after], after) if b > a]


def _why(which: str, new: list[int]) -> str:
    if which == "static":
        return (f"a new graph at sizes {new}: dynamic=False bakes each size into its graph as a constant "
                "and stock torch.compile keeps its guards, so every size not seen before is a new trace, "
                "and a size seen before (the second 8) reuses its graph")
    return (f"a new graph at sizes {new}: the marked first call made num_tokens a symbol, and that graph "
            "serves 5, 8 and 3; but the trace assumed the symbol >= 2 (Dynamo's 0/1 specialisation), "
            "stock torch.compile keeps that guard, so 1 fails it and gets a static graph of its own "
            "(nothing marks that tensor, and dynamic=False)")


@exercise(
    "02.1", "graphs with and without mark_dynamic",
    hint="for each call, ask: does a graph the backend already has fit this size? A constant fits one "
         "size; a symbol fits the sizes its guards allow (what did the trace assume about a marked size?)",
    solution=lambda: {"static": 4, "marked": 2},
    wrong=lambda: {"static": 4, "marked": 1},
    wrong_says="1 fails it",
)
def grade_graphs(answer: Any) -> str:
    if not isinstance(answer, dict) or set(answer) != {"static", "marked"}:
        raise ExerciseFailed("answer with a dict {'static': <graphs>, 'marked': <graphs>}: how many graphs "
                             f"each compiled function's backend holds after the calls at {list(CALL_SIZES)}")
    truth = {"static": graphs_after_each_call(False), "marked": graphs_after_each_call(True)}
    wrong = []
    for which, after in truth.items():
        if answer[which] != after[-1]:
            wrong.append(f"{which}: you predicted {answer[which]!r} graph(s); its backend received {after[-1]} "
                         f"(after each call: {after}). That is {_why(which, _new_graph_calls(after))}.")
    if wrong:
        raise ExerciseFailed(" ".join(wrong) + " Look again at §2's two cells.")
    return (f"Static: {truth['static'][-1]} graphs (one per distinct size), marked: {truth['marked'][-1]} "
            "(the symbolic one, plus a static one for the 1-token call its 0/1 guard refused). Under the "
            "decorator that guard is dropped too (§3), so the 1-token call runs the symbolic graph.")


# ---------------------------------------------------------------------------------------------
# 02.2: the counters of a DYNAMO_TRACE_ONCE model's life

COUNTERS = ("num_models_seen", "num_dynamo_traces", "num_graphs_seen", "num_backend_compilations")
STEPS = ("build", "first call", "more calls", "second model")


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


_REASONS = {
    "num_models_seen": {
        "build": "the decorator's __init__ counts every model it will compile, at construction",
        "second model": "the second model is a second decorated model: counted at its construction",
    },
    "num_dynamo_traces": {
        "build": "torch.compile is lazy (§1): construction only wraps forward, nothing is traced yet",
        "first call": "lm(...) first runs a warm-up at max_num_batched_tokens (64 tokens), and that is the one "
                      "trace; the 8-token call then reuses it. compile_sizes is VLLM_COMPILE's piecewise backend's "
                      "business (notebook 07): DYNAMO_TRACE_ONCE hands the whole graph to its backend once",
        "more calls": "the guards are dropped (§3): the one trace serves 4, 3, 8 and 17 tokens",
        "second model": "a second instance traces for itself (its own torch.compile and backend; with the "
                        "bytecode hook on, its first call drops Dynamo's cache entry for forward so it does)",
    },
    "num_graphs_seen": {"*": "it counts Dynamo graphs handed to VllmBackend, which only VLLM_COMPILE uses; in "
                             "this mode vLLM names the backend by string and none of its counters sees the trace"},
    "num_backend_compilations": {"*": "it counts VllmBackend's compiles of a piece for a size or range "
                                      "(VLLM_COMPILE only); compile_sizes changes nothing in DYNAMO_TRACE_ONCE"},
}


@exercise(
    "02.2", "the counters of a model's life",
    hint="answer {step: {counter: delta}} for the steps 'build', 'first call', 'more calls', 'second model' "
         "and the counters num_models_seen, num_dynamo_traces, num_graphs_seen, num_backend_compilations; "
         "§1 says what construction does, §3 what later calls do, and which counters this mode never moves",
    solution=lambda: {
        "build": {"num_models_seen": 1, "num_dynamo_traces": 0, "num_graphs_seen": 0, "num_backend_compilations": 0},
        "first call": {"num_models_seen": 0, "num_dynamo_traces": 1, "num_graphs_seen": 0,
                       "num_backend_compilations": 0},
        "more calls": {"num_models_seen": 0, "num_dynamo_traces": 0, "num_graphs_seen": 0,
                       "num_backend_compilations": 0},
        "second model": {"num_models_seen": 1, "num_dynamo_traces": 1, "num_graphs_seen": 0,
                         "num_backend_compilations": 0},
    },
    wrong=lambda: {
        "build": {"num_models_seen": 1, "num_dynamo_traces": 0, "num_graphs_seen": 0, "num_backend_compilations": 0},
        "first call": {"num_models_seen": 0, "num_dynamo_traces": 1, "num_graphs_seen": 1,
                       "num_backend_compilations": 2},
        "more calls": {"num_models_seen": 0, "num_dynamo_traces": 0, "num_graphs_seen": 0,
                       "num_backend_compilations": 0},
        "second model": {"num_models_seen": 1, "num_dynamo_traces": 0, "num_graphs_seen": 0,
                         "num_backend_compilations": 0},
    },
    wrong_says="VllmBackend",
)
def grade_counters(answer: Any) -> str:
    shape_ok = isinstance(answer, dict) and set(answer) == set(STEPS) and all(
        isinstance(answer[s], dict) and set(answer[s]) == set(COUNTERS) for s in STEPS)
    if not shape_ok:
        raise ExerciseFailed(f"answer with a dict {{step: {{counter: delta}}}}: the steps {list(STEPS)}, each "
                             f"with the counters {list(COUNTERS)}")
    truth = counter_scenario()
    wrong = []
    for step in STEPS:
        for c in COUNTERS:
            if answer[step][c] != truth[step][c]:
                reasons = _REASONS[c]
                why = reasons.get(step, reasons.get("*", ""))
                wrong.append(f"'{step}' changes {c} by {truth[step][c]}, not {answer[step][c]!r}"
                             + (f": {why}" if why else ""))
    if wrong:
        raise ExerciseFailed("; ".join(wrong) + ".")
    return ("Construction counts a model and traces nothing; the first call is the one trace (the warm-up's, "
            "compile_sizes notwithstanding); later sizes reuse it; a second model traces again for itself; "
            "and VllmBackend's counters stay at 0 in DYNAMO_TRACE_ONCE.")


# ---------------------------------------------------------------------------------------------
# 02.3: the traced files, with the custom ops off

def traced_files(custom_ops: list[str]) -> set[str]:
    """compilation_config.traced_files after the first call of a 1-layer Llama decoder."""
    from minivllm_compile import CompilationConfig, CompilationMode
    from minivllm_compile.models import build_model

    cc = CompilationConfig(mode=CompilationMode.DYNAMO_TRACE_ONCE, backend="eager", max_num_batched_tokens=32,
                           custom_ops=custom_ops)
    build_model("llama", num_layers=1, compilation_config=cc, device="cpu")(torch.arange(4) + 1, torch.arange(4))
    return set(cc.traced_files)


def _short(path: str) -> str:
    # minivllm_compile/models/layers.py, kernels/..., torch/nn/modules/linear.py: from the package's parent
    # or torch's, whichever holds it
    import minivllm_compile

    for root in (Path(minivllm_compile.__file__).parent.parent, Path(torch.__file__).parent.parent):
        if Path(path).is_relative_to(root):
            return str(Path(path).relative_to(root))
    return path


def _matches(entry: str, path: str) -> bool:
    entry = str(entry).replace("\\", "/").lstrip("/")
    return path.replace("\\", "/").endswith("/" + entry) or path == entry


@exercise(
    "02.3", "the traced files with the custom ops off",
    hint="follow each layer's `if not self.use_custom_op:` branch in minivllm_compile/models/layers.py: which "
         "Python functions does it call, and which of those does Dynamo inline (a file joins) rather than put "
         "in the graph as one call (torch.* functions, custom ops)?",
    solution=lambda: {"kernels/rotary_embedding.py"},
    wrong=lambda: {"kernels/rotary_embedding.py", "torch/nn/functional.py"},
    wrong_says="functional.py",
)
def grade_traced_files(answer: Any) -> str:
    if isinstance(answer, (str, Path)) or not isinstance(answer, (set, list, tuple, frozenset)):
        raise ExerciseFailed("answer with a set of file paths (as the notebook's `shown` prints them, e.g. "
                             "'torch/nn/modules/linear.py'), the files that join traced_files")
    default, off = traced_files(["all"]), traced_files(["none"])
    joined = off - default
    wrong = []
    for entry in answer:
        if any(_matches(entry, p) for p in joined):
            continue
        if any(_matches(entry, p) for p in default):
            wrong.append(f"{entry} is traced with the custom ops on too (§4's list): give only the files that join")
        elif "functional" in str(entry) or str(entry).startswith("torch/_"):
            wrong.append(f"{entry} does not join: torch.nn.functional.silu (like every torch.* function) goes "
                         "into the graph as one call; Dynamo knows it and does not inline its Python body")
        elif str(entry).endswith("ops.py"):
            wrong.append(f"{entry} does not join: a custom op is a leaf for Dynamo, on or off (its Python body "
                         "never runs while tracing); with custom_ops=['none'] the layers just stop calling most")
        else:
            wrong.append(f"{entry} does not join: Dynamo inlined no function from it")
    for path in sorted(joined):
        if not any(_matches(entry, path) for entry in answer):
            wrong.append(f"{_short(path)} joins and you left it out: a layer's plain-torch branch calls a Python "
                         "function defined there, and Dynamo inlines it (patched_inline_call records its file)")
    if wrong:
        raise ExerciseFailed("; ".join(wrong) + ".")
    return (f"{', '.join(sorted(_short(p) for p in joined))} joins: RotaryEmbedding's plain-torch branch calls "
            "rotary_embedding_ref, inlined; RMSNorm's forward_native is in layers.py already, and SiluAndMul's "
            "torch.nn.functional.silu goes into the graph as one call. A file that joins is a file whose edits "
            "now change the compile-cache key (notebook 09).")
