"""Exercises of notebook 03 (guards and dynamic shapes): which calls a model compiled with
evaluate_guards=True refuses, and the guard behind each refusal (03.1); what each DynamicShapesType
makes of a branch and of a slice on num_tokens (03.2). Each grader compiles the toy and calls it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from minivllm_compile import (
    CompilationConfig,
    CompilationMode,
    DynamicShapesConfig,
    DynamicShapesType,
    support_torch_compile,
)
from minivllm_compile.exercises import ExerciseFailed, env, exercise, measured_once


@contextmanager
def _fresh_cache(cls: type) -> Iterator[None]:
    # this grader's models are its own: drop their Dynamo cache entries when done, so that gradings
    # do not pile up entries on the toy's forward
    try:
        yield
    finally:
        torch._dynamo.eval_frame.remove_from_cache(cls.forward.__code__)


def _compile(cls: type, kind: DynamicShapesType, evaluate: bool) -> nn.Module:
    return cls(compilation_config=CompilationConfig(
        mode=CompilationMode.DYNAMO_TRACE_ONCE, backend="eager",
        dynamic_shapes_config=DynamicShapesConfig(type=kind, evaluate_guards=evaluate)))


def _failed_guard(error: RuntimeError) -> tuple[str, str]:
    """(guard, the source line it came from) from Dynamo's fail_on_recompile message (its first
    failing guard)."""
    line = next((ln for ln in str(error).splitlines() if "x.size()" in ln), "")
    parts = line.strip().split("  # ")
    if len(parts) < 2:
        return "a shape guard", "a line of forward"
    return parts[0].split(": ", 1)[-1], parts[1].strip()


# ---------------------------------------------------------------------------------------------
# 03.1: which calls does evaluate_guards refuse?

@support_torch_compile
class Chunked(nn.Module):
    """Sums (or, for short inputs, maxes) num_tokens in rows of 4."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.view(-1, 4)
        if x.shape[0] >= 16:
            return rows.sum(dim=1)
        return rows.amax(dim=1)


TRACED_AT = 24  # the first call, which traces
PROBE_SIZES = (4, 8, 12, 16, 18, 20, 30, 64)  # the later calls of 03.1


@measured_once
def refusals() -> dict[int, tuple[str, str]]:
    """Chunked with evaluate_guards=True, traced at TRACED_AT tokens, then called at each of
    PROBE_SIZES: {size: (the guard that refused it, its source line)}, for
    the refused sizes only."""
    refused = {}
    with env(VLLM_USE_BYTECODE_HOOK="0"), _fresh_cache(Chunked):
        model = _compile(Chunked, DynamicShapesType.BACKED, evaluate=True)
        model(torch.ones(TRACED_AT))
        for n in PROBE_SIZES:
            x = torch.arange(n, dtype=torch.float32)
            try:
                torch.testing.assert_close(model(x), Chunked()(x))  # Chunked(): mode NONE, eager
            except RuntimeError as e:
                if "recompile" not in str(e):
                    raise
                refused[n] = _failed_guard(e)
    return refused


@exercise(
    "03.1", "which calls does evaluate_guards refuse?", section="notebook 03 §4 (evaluate_guards "
    "catches a specialisation)",
    hint="list the questions forward asks about x.shape[0] while it is traced at 24 tokens (a "
         "branch is one; so is a view that must divide the size), what 24 answers to each, and "
         "which probe sizes answer one of them differently",
    deeper_hint="Read Chunked.forward line by line with x.shape[0] = 24 and write down every fact "
                "about the size that line needs: `x.view(-1, 4)` needs a size the view can split "
                "into rows of 4 (what does 24 answer?), and `if x.shape[0] >= 16` needs the "
                "branch's answer for 24. Each fact is a shape guard. Then take each probe size and "
                "check it against every fact: one that disagrees with any of them is refused.",
    solution=lambda: {4, 8, 12, 18, 30},
    wrong=lambda: {4, 8, 12},
    wrong_says="rows = x.view(-1, 4)",
    gives_away="refused: [4, 8, 12, 18, 30]",
)
def grade_refusals(answer: Any) -> str:
    if not isinstance(answer, (set, frozenset, list, tuple)) or not all(
        isinstance(n, int) for n in answer):
        raise ExerciseFailed(f"answer with a set of sizes: those of {list(PROBE_SIZES)} "
                             "that the strict model refuses")
    truth = refusals()
    predicted = set(answer)
    wrong = []
    for n in sorted(predicted - set(PROBE_SIZES)):
        wrong.append(f"{n} is not one of the probe sizes {list(PROBE_SIZES)}")
    missing = sorted(set(truth) - predicted)
    for source in sorted({truth[n][1] for n in missing}):
        k = sum(truth[n][1] == source for n in missing)
        wrong.append(f"{k} refused size(s) are missing from your set, refused by the guard that "
                     f"`{source}` recorded: that line asks a question about the size too")
    extra = sorted((predicted & set(PROBE_SIZES)) - set(truth))
    if extra:
        wrong.append(f"{len(extra)} size(s) in your set run, equal to eager: a call is refused "
                     "only when it answers one of the trace's questions differently from 24, "
                     "not for being another size")
    if wrong:
        guards = "; ".join(f"{n}: `{g}` (from `{src}`)" for n, (g, src) in sorted(truth.items()))
        raise ExerciseFailed("\n".join(wrong) + "\nThe trace at 24 recorded one shape guard per "
                             "question it asked about the size (all folded into the frame's one "
                             "SHAPE_ENV guard); a call is refused when it fails any of them.",
                             measured=f"refused: {sorted(truth)}; the guard "
                                      f"each failed first: {guards}")
    guards = sorted({f"`{g}` (from `{src}`)" for g, src in truth.values()})
    return (f"Refused {sorted(truth)}. The guards that refused them: "
            f"{' and '.join(guards)}. A branch on the size and a view that must divide it "
            "both become guards, and with evaluate_guards a call that fails one raises "
            "instead of silently running the graph traced at 24.")


# ---------------------------------------------------------------------------------------------
# 03.2: BACKED, UNBACKED, BACKED_SIZE_OBLIVIOUS on a branch and on a slice

@support_torch_compile
class Branch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 4:
            return x * 2
        return x - 1


@support_torch_compile
class Slice(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:8] * 2  # the first 8 tokens, or all of them when there are fewer


TOYS = {"branch": Branch, "slice": Slice}
OUTCOMES = ("guard", "no guard", "trace error")
FIRST_CALL = 16


@measured_once
def outcome(cls: type, kind: DynamicShapesType) -> tuple[str, str]:
    """Trace `cls` at FIRST_CALL tokens with `kind` (evaluate_guards where vLLM allows it: not for
    UNBACKED), then call it at 2..15 tokens. Returns (one of OUTCOMES, what was seen)."""
    evaluate = kind != DynamicShapesType.UNBACKED
    with env(VLLM_USE_BYTECODE_HOOK="0"), _fresh_cache(cls):
        model = _compile(cls, kind, evaluate)
        try:
            model(torch.ones(FIRST_CALL))
        except Exception as e:  # noqa: BLE001  (Dynamo's UserError for a data-dependent guard, and its kin)
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return "trace error", f"the first call fails: {type(e).__name__}: {first}"
        symbol = next(n.meta["example_value"] for n in model.captured_graphs[0].graph.nodes
                      if n.op == "placeholder"
                      and isinstance(n.meta.get("example_value"), torch.SymInt))
        guards = [str(g.expr) for g in symbol.node.shape_env.guards]
        refused = []
        for n in range(2, FIRST_CALL):
            x = torch.arange(n, dtype=torch.float32)
            try:
                torch.testing.assert_close(model(x), cls()(x))  # cls(): mode NONE, eager
            except RuntimeError as e:
                if "recompile" not in str(e):
                    raise
                refused.append(n)
    if guards:
        refusing = (f"refuses the calls at {_sizes(refused)} tokens" if refused
                    else "refuses none of 2..15 tokens")
        return "guard", (f"the trace (symbol {symbol}) recorded the shape guard(s) {guards}; "
                         f"evaluate_guards {refusing}")
    return "no guard", (f"the trace (symbol {symbol}) recorded no shape guard; every size "
                        "from 2 to 15 runs, = eager")


def _sizes(sizes: list[int]) -> str:
    contiguous = sizes == list(range(sizes[0], sizes[-1] + 1))
    return f"{sizes[0]}..{sizes[-1]}" if contiguous and len(
        sizes) > 2 else ", ".join(map(str, sizes))


_QUESTIONS = {  # what a wrong prediction misses: a question that leads to it, never the outcome
    ("branch", "BACKED"): "A Python `if` needs True or False while tracing: where "
                          "does a backed symbol get its answer from, and what does "
                          "Dynamo record about the answer?",
    ("branch", "BACKED_SIZE_OBLIVIOUS"): "Size-oblivious reasoning changes only the checks "
                                         "torch's own ops make about sizes (could it be 0 or 1? "
                                         "is a slice's end past it?): is a Python `if` in "
                                         "forward one of those checks?",
    ("branch", "UNBACKED"): "An unbacked symbol has no hint: what can the trace answer to `u0 > "
                            "4`, and can one graph take both sides of the `if`?",
    ("slice", "BACKED"): "`x[:8]` has min(8, num_tokens) rows: how does a backed symbol "
                         "settle that min while tracing at 16, and what does it record so "
                         "that the graph stays valid?",
    ("slice", "BACKED_SIZE_OBLIVIOUS"): "The slicing code asks whether 8 is past the size: "
                                        "does it ask size-obliviously, and does such a "
                                        "question need the hint's answer?",
    ("slice", "UNBACKED"): "With no hint to settle it, can min(8, num_tokens) stay symbolic in the "
                           "graph, and does a slice need anything more than that?",
}


def _kind(key: Any) -> DynamicShapesType | None:
    if isinstance(key, DynamicShapesType):
        return key
    try:
        return DynamicShapesType(str(key).lower())
    except ValueError:
        return DynamicShapesType.__members__.get(str(key).upper())


@exercise(
    "03.2", "what each DynamicShapesType makes of a branch and a slice", section="notebook 03 §6 "
    "(BACKED, UNBACKED, BACKED_SIZE_OBLIVIOUS)",
    hint="for each toy and type, ask: does the trace need to know something about num_tokens that "
         "only a hint can tell, or can torch keep it symbolic?",
    deeper_hint="Two questions per cell. (1) Does the code need a concrete True/False about the "
                "size? A Python `if` does; a slice's min(8, n) does only if someone insists on "
                "settling it. (2) Who answers? A backed symbol answers from its hint (16) and "
                "records the answer as a guard; an unbacked one cannot answer, so a question that "
                "must be answered is a trace error; size-oblivious reasoning only changes how "
                "torch's own size checks (inside ops such as slicing) are answered. §6's table "
                "shows all three types on one toy.",
    solution=lambda: {"branch": {"BACKED": "guard", "UNBACKED": "trace error",
                                 "BACKED_SIZE_OBLIVIOUS": "guard"},
                      "slice": {"BACKED": "guard", "UNBACKED": "no guard",
                                "BACKED_SIZE_OBLIVIOUS": "no guard"}},
    wrong=lambda: {"branch": {"BACKED": "guard", "UNBACKED": "trace error",
                              "BACKED_SIZE_OBLIVIOUS": "no guard"},
                   "slice": {"BACKED": "guard", "UNBACKED": "no guard",
                             "BACKED_SIZE_OBLIVIOUS": "no guard"}},
    wrong_says="branch under BACKED_SIZE_OBLIVIOUS",
    gives_away="branch under BACKED_SIZE_OBLIVIOUS: guard",
)
def grade_types(answer: Any) -> str:
    form = ("answer with {toy: {type: outcome}}: toys 'branch' and 'slice', types BACKED, "
            "UNBACKED and BACKED_SIZE_OBLIVIOUS (names or DynamicShapesType members), "
            f"outcomes {list(OUTCOMES)}")
    if not isinstance(answer, dict) or set(answer) != set(TOYS):
        raise ExerciseFailed(form)
    predicted = {}
    for toy, row in answer.items():
        kinds = {_kind(k): v for k, v in row.items()} if isinstance(row, dict) else {}
        if set(kinds) != set(DynamicShapesType) or not all(v in OUTCOMES for v in kinds.values()):
            raise ExerciseFailed(f"{form} (the row {toy!r} is not)")
        predicted[toy] = kinds
    wrong, measured = [], []
    for toy, cls in TOYS.items():
        for kind in DynamicShapesType:
            got, seen = outcome(cls, kind)
            if predicted[toy][kind] != got:
                wrong.append(f"{toy} under {kind.name}: not {predicted[toy][kind]!r}. "
                             f"{_QUESTIONS[toy, kind.name]}")
                measured.append(f"{toy} under {kind.name}: {got} ({seen})")
    if wrong:
        raise ExerciseFailed("\n".join(wrong), measured="; ".join(measured))
    return ("A branch on num_tokens needs its answer: BACKED and BACKED_SIZE_OBLIVIOUS take it "
            "from the hint and guard it, UNBACKED cannot trace it; a slice's min(8, num_tokens) is "
            "settled (and guarded) only by BACKED, the other two keep it symbolic. BACKED's slice "
            "graph is valid only from 8 tokens up; with the guards dropped (the default) nothing "
            "would say so: evaluate_guards is how you find out.")
