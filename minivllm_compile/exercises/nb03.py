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
from minivllm_compile.exercises import ExerciseFailed, env, exercise




@contextmanager
def _fresh_cache(cls: type) -> Iterator[None]:
    # this grader's models are its own: drop their Dynamo cache entries when done, so that gradings do
    # not pile up entries on the toy's forward
    try:
        yield
    finally:
        torch._dynamo.eval_frame.remove_from_cache(cls.forward.__code__)


def _compile(cls: type, kind: DynamicShapesType, evaluate: bool) -> nn.Module:
    return cls(compilation_config=CompilationConfig(
        mode=CompilationMode.DYNAMO_TRACE_ONCE, backend="eager",
        dynamic_shapes_config=DynamicShapesConfig(type=kind, evaluate_guards=evaluate)))


def _failed_guard(error: RuntimeError) -> str:
    """`guard  <- source line` from Dynamo's fail_on_recompile message (its first failing guard)."""
    line = next((l for l in str(error).splitlines() if "x.size()" in l), "")
    parts = line.strip().split("  # ")
    if len(parts) < 2:
        return "a shape guard"
    return f"`{parts[0].split(': ', 1)[-1]}` (from `{parts[1].strip()}`)"


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


def refusals() -> dict[int, str]:
    """Chunked with evaluate_guards=True, traced at TRACED_AT tokens, then called at each of
    PROBE_SIZES: {size: the guard that refused it}, for the refused sizes only."""
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
    "03.1", "which calls does evaluate_guards refuse?",
    hint="list the questions forward asks about x.shape[0] while it is traced at 24 tokens (a branch is "
         "one; so is a view that must divide the size), what 24 answers to each, and which probe sizes "
         "answer one of them differently",
    solution=lambda: {4, 8, 12, 18, 30},
    wrong=lambda: {4, 8, 12},
    wrong_says="18",
)
def grade_refusals(answer: Any) -> str:
    if not isinstance(answer, (set, frozenset, list, tuple)) or not all(isinstance(n, int) for n in answer):
        raise ExerciseFailed(f"answer with a set of sizes: those of {list(PROBE_SIZES)} that the strict "
                             "model refuses")
    truth = refusals()
    predicted = set(answer)
    wrong = []
    for n in sorted(predicted - set(PROBE_SIZES)):
        wrong.append(f"{n} is not one of the probe sizes {list(PROBE_SIZES)}")
    for n in sorted(set(truth) - predicted):
        wrong.append(f"{n} tokens is refused: its call fails the shape guard {truth[n]}")
    for n in sorted((predicted & set(PROBE_SIZES)) - set(truth)):
        wrong.append(f"{n} tokens runs (= eager): it answers every question the trace asked as 24 did")
    if wrong:
        raise ExerciseFailed("; ".join(wrong) + ". The trace at 24 recorded one shape guard per question it "
                             "asked about the size (all folded into the frame's one SHAPE_ENV guard); a call is "
                             "refused when it fails any of them.")
    guards = sorted(set(truth.values()))
    return (f"Refused {sorted(truth)}. The guards that refused them: {' and '.join(guards)}. A "
            "branch on the size and a view that must divide it both become guards, and with evaluate_guards a "
            "call that fails one raises instead of silently running the graph traced at 24.")


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
                      if n.op == "placeholder" and isinstance(n.meta.get("example_value"), torch.SymInt))
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
        refusing = f"refuses the calls at {_sizes(refused)} tokens" if refused else "refuses none of 2..15 tokens"
        return "guard", f"the trace (symbol {symbol}) recorded the shape guard(s) {guards}; evaluate_guards {refusing}"
    return "no guard", f"the trace (symbol {symbol}) recorded no shape guard; every size from 2 to 15 runs, = eager"


def _sizes(sizes: list[int]) -> str:
    contiguous = sizes == list(range(sizes[0], sizes[-1] + 1))
    return f"{sizes[0]}..{sizes[-1]}" if contiguous and len(sizes) > 2 else ", ".join(map(str, sizes))


_WHY = {
    ("branch", "BACKED"): "a Python `if` needs True or False; a backed symbol answers from its hint (16) "
                          "and records the answer as a guard",
    ("branch", "BACKED_SIZE_OBLIVIOUS"): "size-oblivious reasoning changes only the checks torch's ops make "
                                         "about sizes (could it be 0 or 1? is the slice end past it?); a "
                                         "Python `if` on the size is still answered from the hint, and guarded",
    ("branch", "UNBACKED"): "an unbacked symbol has no hint to answer `u0 > 4` from, and the trace cannot "
                            "take both sides: Dynamo refuses ('Could not guard on data-dependent expression'; "
                            "torch._check is the way to tell it)",
    ("slice", "BACKED"): "x[:8] has min(8, num_tokens) rows; a backed symbol settles the min from its hint "
                         "(16 >= 8), so the graph takes 8 rows, and guards num_tokens >= 8",
    ("slice", "BACKED_SIZE_OBLIVIOUS"): "the slicing code asks its question size-obliviously, so the min "
                                        "stays symbolic: no guard, and 2..7 tokens run, correct",
    ("slice", "UNBACKED"): "with no hint the min stays symbolic: the slice needs no guard and traces fine",
}


def _kind(key: Any) -> DynamicShapesType | None:
    if isinstance(key, DynamicShapesType):
        return key
    try:
        return DynamicShapesType(str(key).lower())
    except ValueError:
        return DynamicShapesType.__members__.get(str(key).upper())


@exercise(
    "03.2", "what each DynamicShapesType makes of a branch and a slice",
    hint="for each toy and type, ask: does the trace need to know something about num_tokens that only a "
         "hint can tell (then BACKED guards on it and UNBACKED fails), or can torch keep it symbolic?",
    solution=lambda: {"branch": {"BACKED": "guard", "UNBACKED": "trace error", "BACKED_SIZE_OBLIVIOUS": "guard"},
                      "slice": {"BACKED": "guard", "UNBACKED": "no guard", "BACKED_SIZE_OBLIVIOUS": "no guard"}},
    wrong=lambda: {"branch": {"BACKED": "guard", "UNBACKED": "trace error", "BACKED_SIZE_OBLIVIOUS": "no guard"},
                   "slice": {"BACKED": "guard", "UNBACKED": "no guard", "BACKED_SIZE_OBLIVIOUS": "no guard"}},
    wrong_says="branch under BACKED_SIZE_OBLIVIOUS",
)
def grade_types(answer: Any) -> str:
    form = ("answer with {toy: {type: outcome}}: toys 'branch' and 'slice', types BACKED, UNBACKED and "
            f"BACKED_SIZE_OBLIVIOUS (names or DynamicShapesType members), outcomes {list(OUTCOMES)}")
    if not isinstance(answer, dict) or set(answer) != set(TOYS):
        raise ExerciseFailed(form)
    predicted = {}
    for toy, row in answer.items():
        kinds = {_kind(k): v for k, v in row.items()} if isinstance(row, dict) else {}
        if set(kinds) != set(DynamicShapesType) or not all(v in OUTCOMES for v in kinds.values()):
            raise ExerciseFailed(f"{form} (the row {toy!r} is not)")
        predicted[toy] = kinds
    wrong = []
    for toy, cls in TOYS.items():
        for kind in DynamicShapesType:
            got, seen = outcome(cls, kind)
            if predicted[toy][kind] != got:
                wrong.append(f"{toy} under {kind.name}: you said {predicted[toy][kind]!r}, it is {got!r}: {seen}. "
                             f"Why: {_WHY[toy, kind.name]}")
    if wrong:
        raise ExerciseFailed("; ".join(wrong) + ".")
    return ("A branch on num_tokens needs its answer: BACKED and BACKED_SIZE_OBLIVIOUS take it from the hint "
            "and guard it, UNBACKED cannot trace it; a slice's min(8, num_tokens) is settled (and guarded) only "
            "by BACKED, the other two keep it symbolic. BACKED's slice graph is valid only from 8 tokens up; "
            "with the guards dropped (the default) nothing would say so: evaluate_guards is how you find out.")
