"""Notebook 05's exercises: FixFunctionalizationPass (seed §1).

Both run the real pass on the functional graph AOTAutograd makes (Dynamo + AOTAutograd with
vLLM's `enable_auto_functionalized_v2=False`, the pass as the forward compiler, then the graph run
as plain FX): the graph Inductor's post-grad passes start from, without Inductor's compile time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch._higher_order_ops.auto_functionalize import auto_functionalized

from minivllm_compile.compilation.passes import FixFunctionalizationPass
from minivllm_compile.exercises import ExerciseFailed, exercise, measured_once
from minivllm_compile.forward_context import set_forward_context
from minivllm_compile.models import build_model
from minivllm_compile.viz.functional import functional_graph as viz_functional_graph

minivllm = torch.ops.minivllm


def functional_graph(fn: Callable, call: Callable, fix: FixFunctionalizationPass
                     | None) -> tuple[Any, torch.fx.GraphModule]:
    """Compile `fn` through AOTAutograd, run `fix` (if any) on its functional forward graph, and
    return (call(compiled fn), the graph module after the pass): `viz.functional_graph`, which
    notebook 05 uses, with vLLM's setting (auto_functionalized v1)."""
    return viz_functional_graph(fn, call, passes=[fix] if fix is not None else ())


def wrapped(gm: torch.fx.GraphModule) -> Counter:
    """{op name: auto_functionalized nodes of it} left in a graph."""
    return Counter(n.args[0]._opname for n in gm.graph.nodes
                   if n.op == "call_function" and n.target is auto_functionalized)


# --- 05.1: what the pass rewrites in a two-layer Llama
# ---------------------------------------------

NUM_LAYERS, NUM_TOKENS = 2, 6


@measured_once
def llama_counts() -> dict[str, Any]:
    """The pass on the whole NUM_LAYERS-layer Llama decoder: what it
    rewrote, what it left wrapped."""
    from minivllm_compile import CompilationConfig, CompilationMode
    from minivllm_compile.config.kernel import IrOpPriorityConfig, KernelConfig, ir_dispatch_scope

    # notebook 05's path to the norms, the seed's: the custom ops (IR priority vllm_c), traced
    # directly (the torch wrap off), entered around the outer compile as the model itself would
    seed = CompilationConfig(mode=CompilationMode.NONE, ir_enable_torch_wrap=False,
                             kernel_config=KernelConfig(
                                 IrOpPriorityConfig.with_default(["vllm_c", "native"])))
    # eager: the reference
    lm = build_model("llama", num_layers=NUM_LAYERS, compilation_config=seed)
    ids, pos = torch.arange(NUM_TOKENS) % 200 + 1, torch.arange(NUM_TOKENS)

    def run(fn: Callable) -> torch.Tensor:
        md = lm.metadata([NUM_TOKENS], [NUM_TOKENS], [0], lm.allocate_caches([NUM_TOKENS]))
        with torch.inference_mode(), set_forward_context(md, lm.model.static_forward_context), \
                ir_dispatch_scope(seed):
            return fn(ids, pos)

    fix = FixFunctionalizationPass()
    out, gm = functional_graph(lm.model, run, fix)
    # the rewritten graph computes the same
    torch.testing.assert_close(out, run(lm.model), atol=1e-5, rtol=1e-5)
    rewritten = Counter({name.removeprefix("minivllm::"): n
                         for name, n in fix.defunctionalized.items()})
    return {"rewritten": rewritten, "left wrapped": wrapped(gm)}


_QUESTION = {  # what a wrong count misses: where to count, never the count
    "rms_norm": "Which norms have no residual yet to add? "
                "(LlamaDecoderLayer.forward: `if residual is None`)",
    "fused_add_rms_norm": "Count every norm that adds a residual: in each layer, and after the "
                          "last layer (LlamaModel.forward).",
    "rotary_embedding": "Where does each layer apply RoPE, and to what?",
    "silu_and_mul": "Where does each layer call it?",
    "unified_attention_with_output": "The attention op writes its output in place too: is it in "
                                     "FixFunctionalizationPass.MUTATED_ARGS? (section 2, 'Why "
                                     "attention is not in the table')",
}


def _counts(c: Counter) -> str:
    return "{" + ", ".join(f"{op!r}: {n}" for op, n in sorted(c.items()) if n) + "}"


@exercise("05.1", "what the pass rewrites in a two-layer Llama", section="notebook 05 §2 (the "
          "post-grad graph of the tiny Llama, before and after)",
          hint="count the custom-op calls per layer in models/llama.py "
               "(LlamaDecoderLayer.forward, and what the first layer does differently), then ask "
               "which of them are in MUTATED_ARGS",
          deeper_hint="Write LlamaModel.forward out for two layers: the embedding, then per layer "
                      "the input norm (plain or fused with the residual? see `if residual is "
                      "None`), RoPE, attention, the post-attention norm, the MLP's activation; "
                      "then the final norm. Tick each custom op. The pass rewrites the ticked ops "
                      "listed in FixFunctionalizationPass.MUTATED_ARGS; whatever else writes in "
                      "place stays wrapped (§2 says why attention is not in the table).",
          solution=lambda: {"rewritten": {"rms_norm": 1, "fused_add_rms_norm": 4,
                                          "rotary_embedding": 2,
                                          "silu_and_mul": 2},
                            "left wrapped": {"unified_attention_with_output": 2}},
          wrong=lambda: {"rewritten": {"rms_norm": 2, "fused_add_rms_norm": 4,
                                       "rotary_embedding": 2,
                                       "silu_and_mul": 2},
                         "left wrapped": {}},
          wrong_says="residual is None",
          gives_away="left wrapped {'unified_attention_with_output': 2}")
def grade_llama_counts(answer: Any) -> str:
    if not (isinstance(answer, dict) and set(answer) == {"rewritten", "left wrapped"}
            and all(isinstance(v, dict) for v in answer.values())):
        raise ExerciseFailed('answer with {"rewritten": {op: count}, "left wrapped": '
                             '{op: count}}, ops by their short name ("rms_norm"); an op '
                             'you leave out counts as 0')
    truth = llama_counts()
    wrong = []
    for part in ("rewritten", "left wrapped"):
        said, got = Counter(answer[part]), truth[part]
        for op in sorted(set(said) | set(got)):
            if said[op] != got[op]:
                how = "too many" if said[op] > got[op] else "too few"
                wrong.append(f"{part}: {op}: you predicted {said[op]}, {how}. "
                             + _QUESTION.get(op, f"{op} is not a custom op the two-layer Llama "
                                                 "calls."))
    if wrong:
        raise ExerciseFailed("\n".join(wrong), measured=f"rewritten {_counts(truth['rewritten'])}; "
                             f"left wrapped {_counts(truth['left wrapped'])}")
    per_layer = sum(truth["rewritten"].values())
    return (f"{per_layer} in-place calls rewritten in {NUM_LAYERS} layers (4 per layer plus the "
            "final norm), and the output unchanged; the attention op stays wrapped, once per "
            "layer, for Inductor to lower.")


# --- 05.2: teach the pass a new op ---------------------------------------------------------------

@torch.library.custom_op("minivllm_ex::accumulate", mutates_args=("total", "peak"))
def _accumulate(x: torch.Tensor, total: torch.Tensor, peak: torch.Tensor, scale: float) -> None:
    """total += scale * x; peak = max(peak, total): two tensors written in place."""
    total.add_(x, alpha=scale)
    torch.maximum(peak, total, out=peak)


@_accumulate.register_fake
def _(x: torch.Tensor, total: torch.Tensor, peak: torch.Tensor, scale: float) -> None:
    return None


accumulate = torch.ops.minivllm_ex.accumulate.default


def running_stats(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rms_norm (in the pass's table), then the new op twice, each call reading
    the last one's writes."""
    normed = torch.empty_like(x)
    minivllm.rms_norm(normed, x, w, 1e-6)
    total, peak = torch.zeros_like(x), torch.full_like(x, -1e9)
    torch.ops.minivllm_ex.accumulate(normed, total, peak, 1.0)
    torch.ops.minivllm_ex.accumulate(x, total, peak, -0.5)
    return total * 1, peak * 1


def _stats_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.rand(8, generator=g) + 0.5


def teach(table: dict[int, str]) -> type[FixFunctionalizationPass]:
    """FixFunctionalizationPass with `accumulate` added to its table."""
    return type("TaughtFixFunctionalizationPass", (FixFunctionalizationPass,),
                {"MUTATED_ARGS": {**FixFunctionalizationPass.MUTATED_ARGS,
                                  accumulate: dict(table)}})


def run_with(fix: FixFunctionalizationPass) -> tuple[bool, Counter, Counter]:
    """(output matches eager, what `fix` rewrote, what it left wrapped) on running_stats."""
    x, w = _stats_inputs()
    ref = running_stats(x, w)
    out, gm = functional_graph(running_stats, lambda f: f(x, w), fix)
    right = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out, ref))
    return right, Counter(fix.defunctionalized), wrapped(gm)


def _mutated() -> list[str]:
    return [a.name for a in accumulate._schema.arguments if a.alias_info is not None
            and a.alias_info.is_write]


@exercise("05.2", "teach the pass a new op", section="notebook 05 §3 (vLLM's getitem → "
          "argument mapping, on one node)",
          hint="print(accumulate._schema): which arguments does the op write (`!`)? Section 3 "
               "shows what each getitem index of an auto_functionalized node stands for",
          deeper_hint="An auto_functionalized node returns a tuple, and the graph reads it "
                      "with getitem: what is at position 0 for an op that returns `()`, and in "
                      "which order come the tensors it mutated? Section 3 prints one node and "
                      "its getitems; MUTATED_ARGS maps each index the graph reads to the "
                      "argument whose new value it is.",
          solution=lambda: {1: "total", 2: "peak"},
          wrong=lambda: {0: "total", 1: "peak"},
          wrong_says="index 0",
          gives_away="{1: 'total', 2: 'peak'}")
def grade_teach(answer: Any) -> str:
    names = [a.name for a in accumulate._schema.arguments]
    if not (isinstance(answer, dict) and answer and all(isinstance(k, int) for k in answer)
            and all(v in names for v in answer.values())):
        raise ExerciseFailed("answer with a dict {getitem index (int): argument name}, the "
                             f"argument names being those of the schema: {names}")
    mutated = _mutated()
    problems = []
    if 0 in answer:
        problems.append("index 0 is the op's own return value (accumulate returns nothing, `-> "
                        "()`), not an argument it mutates")
    not_written = [v for v in answer.values() if v not in mutated]
    if not_written:
        problems.append(f"{not_written} {'is' if len(not_written) == 1 else 'are'} not written by "
                        "the op (no `!` in the schema): the pass would point a reader of the new "
                        "value at an unchanged tensor")
    stock_right, _, stock_left = run_with(FixFunctionalizationPass())
    # not in the stock table
    assert stock_right and stock_left == {"accumulate": 2}, (stock_right, stock_left)
    try:
        right, done, left = run_with(teach(answer)())
    except Exception as e:  # noqa: BLE001  (torch wraps a pass's error in BackendCompilerFailed)
        right, done, left = False, Counter(), None
        inner = getattr(e, "inner_exception", None) or e.__cause__ or e
        if isinstance(inner, KeyError) and isinstance(inner.args[0], int):
            problems.append(f"the graph reads getitem {inner.args[0]} of each accumulate node (the "
                            "new value of a mutated argument), and your table has no entry for "
                            f"{inner.args[0]}: the pass failed with a KeyError")
        else:
            problems.append(f"the pass failed ({type(inner).__name__}: "
                            f"{str(inner).splitlines()[0][:160]})")
    if not problems and not right:
        problems.append("the rewritten graph computes something else: does each index of your "
                        "table stand for the argument whose new value the graph reads there?")
    if problems:
        raise ExerciseFailed("with your table: " + "; ".join(problems)
                             + f". The schema: {accumulate._schema}",
                             measured=f"the table that works: {dict(enumerate(mutated, 1))}")
    return (f"The stock pass left both accumulate calls wrapped ({dict(stock_left)}); with "
            f"your table it rewrote {dict(done)} and left {dict(left) or 'nothing'} wrapped, "
            "and the output is unchanged.")
