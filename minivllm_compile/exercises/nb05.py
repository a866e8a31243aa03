"""Notebook 05's exercises: FixFunctionalizationPass (seed §1).

Both run the real pass on the functional graph AOTAutograd makes (Dynamo + AOTAutograd with
vLLM's `enable_auto_functionalized_v2=False`, the pass as the forward compiler, then the graph run
as plain FX): the graph Inductor's post-grad passes start from, without Inductor's compile time."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._higher_order_ops.auto_functionalize import auto_functionalized

from minivllm_compile.exercises import ExerciseFailed, exercise
from minivllm_compile.forward_context import set_forward_context
from minivllm_compile.models import build_model
from minivllm_compile.passes import FixFunctionalizationPass

minivllm = torch.ops.minivllm


def functional_graph(fn: Callable, call: Callable, fix: FixFunctionalizationPass | None) -> tuple[Any, torch.fx.GraphModule]:
    """Compile `fn` through AOTAutograd, run `fix` (if any) on its functional forward graph, and
    return (call(compiled fn), the graph module after the pass). Dynamo is reset before and after,
    as notebook 05's own aot_compile does."""
    graphs = []

    def fw_compiler(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        if fix is not None:
            fix(gm.graph)
        gm.recompile()
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(enable_auto_functionalized_v2=False):
            out = call(torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=fw_compiler)))
    finally:
        torch._dynamo.reset()
    (gm,) = graphs
    return out, gm


def wrapped(gm: torch.fx.GraphModule) -> Counter:
    """{op name: auto_functionalized nodes of it} left in a graph."""
    return Counter(n.args[0]._opname for n in gm.graph.nodes
                   if n.op == "call_function" and n.target is auto_functionalized)


# --- 05.1: what the pass rewrites in a two-layer Llama ---------------------------------------------

NUM_LAYERS, NUM_TOKENS = 2, 6


def llama_counts() -> dict[str, Any]:
    """The pass on the whole NUM_LAYERS-layer Llama decoder: what it rewrote, what it left wrapped."""
    from minivllm_compile import CompilationConfig, CompilationMode
    from minivllm_compile.kernel_config import IrOpPriorityConfig, KernelConfig, ir_dispatch_scope

    # notebook 05's path to the norms, the seed's: the custom ops (IR priority vllm_c), traced
    # directly (the torch wrap off), entered around the outer compile as the model itself would
    seed = CompilationConfig(mode=CompilationMode.NONE, ir_enable_torch_wrap=False,
                             kernel_config=KernelConfig(IrOpPriorityConfig.with_default(["vllm_c", "native"])))
    lm = build_model("llama", num_layers=NUM_LAYERS, compilation_config=seed)  # eager: the reference
    ids, pos = torch.arange(NUM_TOKENS) % 200 + 1, torch.arange(NUM_TOKENS)

    def run(fn: Callable) -> torch.Tensor:
        md = lm.metadata([NUM_TOKENS], [NUM_TOKENS], [0], lm.allocate_caches([NUM_TOKENS]))
        with torch.inference_mode(), set_forward_context(md, lm.model.static_forward_context), \
                ir_dispatch_scope(seed):
            return fn(ids, pos)

    fix = FixFunctionalizationPass()
    out, gm = functional_graph(lm.model, run, fix)
    torch.testing.assert_close(out, run(lm.model), atol=1e-5, rtol=1e-5)  # the rewritten graph computes the same
    rewritten = Counter({name.removeprefix("minivllm::"): n for name, n in fix.defunctionalized.items()})
    return {"rewritten": rewritten, "left wrapped": wrapped(gm)}


_WHY_COUNT = {
    "rms_norm": "only layer 0's input norm has no residual yet (LlamaDecoderLayer.forward: `if residual is "
                "None`); every later norm adds the residual, as fused_add_rms_norm",
    "fused_add_rms_norm": "each layer's post-attention norm, the input norm of every layer after the first, "
                          "and the final norm: 2 per layer in all",
    "rotary_embedding": "one per layer, on q and k (split out of the qkv matmul: the pass's special case)",
    "silu_and_mul": "one per layer, in the MLP",
    "unified_attention_with_output": "the attention op writes its output in place too, one per layer, but it "
                                     "is not in FixFunctionalizationPass.MUTATED_ARGS (a splitting op: under "
                                     "VLLM_COMPILE no piece the pass sees contains it)",
}


@exercise("05.1", "what the pass rewrites in a two-layer Llama",
          hint="count the custom-op calls per layer in models/llama.py (LlamaDecoderLayer.forward, and what "
               "the first layer does differently), then ask which of them are in MUTATED_ARGS",
          solution=lambda: {"rewritten": {"rms_norm": 1, "fused_add_rms_norm": 4, "rotary_embedding": 2,
                                          "silu_and_mul": 2},
                            "left wrapped": {"unified_attention_with_output": 2}},
          wrong=lambda: {"rewritten": {"rms_norm": 2, "fused_add_rms_norm": 4, "rotary_embedding": 2,
                                       "silu_and_mul": 2},
                         "left wrapped": {}},
          wrong_says="residual is None")
def grade_llama_counts(answer: Any) -> str:
    if not (isinstance(answer, dict) and set(answer) == {"rewritten", "left wrapped"}
            and all(isinstance(v, dict) for v in answer.values())):
        raise ExerciseFailed('answer with {"rewritten": {op: count}, "left wrapped": {op: count}}, ops by '
                             'their short name ("rms_norm"); an op you leave out counts as 0')
    truth = llama_counts()
    wrong = []
    for part, verb in (("rewritten", "the pass rewrote"), ("left wrapped", "the pass left wrapped")):
        said, got = Counter(answer[part]), truth[part]
        for op in sorted(set(said) | set(got)):
            if said[op] != got[op]:
                why = _WHY_COUNT.get(op, "look at which ops a layer calls")
                wrong.append(f"{part}: {op}: you predicted {said[op]}, {verb} {got[op]} ({why})")
    if wrong:
        raise ExerciseFailed("; ".join(wrong))
    per_layer = sum(truth["rewritten"].values())
    return (f"{per_layer} in-place calls rewritten in {NUM_LAYERS} layers (4 per layer plus the final norm), and "
            "the output unchanged; the attention op stays wrapped, once per layer, for Inductor to lower.")


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
    """rms_norm (in the pass's table), then the new op twice, each call reading the last one's writes."""
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
                {"MUTATED_ARGS": {**FixFunctionalizationPass.MUTATED_ARGS, accumulate: dict(table)}})


def run_with(fix: FixFunctionalizationPass) -> tuple[bool, Counter, Counter]:
    """(output matches eager, what `fix` rewrote, what it left wrapped) on running_stats."""
    x, w = _stats_inputs()
    ref = running_stats(x, w)
    out, gm = functional_graph(running_stats, lambda f: f(x, w), fix)
    right = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(out, ref))
    return right, Counter(fix.defunctionalized), wrapped(gm)


def _mutated() -> list[str]:
    return [a.name for a in accumulate._schema.arguments if a.alias_info is not None and a.alias_info.is_write]


@exercise("05.2", "teach the pass a new op",
          hint="print(accumulate._schema): which arguments carry `!`, and in which order? Section 3: getitem 0 "
               "is the op's return value, 1, 2, ... the mutated arguments",
          solution=lambda: {1: "total", 2: "peak"},
          wrong=lambda: {0: "total", 1: "peak"},
          wrong_says="index 0")
def grade_teach(answer: Any) -> str:
    names = [a.name for a in accumulate._schema.arguments]
    if not (isinstance(answer, dict) and answer and all(isinstance(k, int) for k in answer)
            and all(v in names for v in answer.values())):
        raise ExerciseFailed(f"answer with a dict {{getitem index (int): argument name}}, the argument names "
                             f"being those of the schema: {names}")
    mutated = _mutated()
    problems = []
    if 0 in answer:
        problems.append("index 0 is the op's own return value (accumulate returns nothing, `-> ()`); the "
                        "mutated arguments are numbered from 1")
    not_written = [v for v in answer.values() if v not in mutated]
    if not_written:
        problems.append(f"{not_written} {'is' if len(not_written) == 1 else 'are'} not written by the op (no `!` "
                        f"in the schema): the pass would point a reader of the new value at an unchanged tensor")
    stock_right, _, stock_left = run_with(FixFunctionalizationPass())
    assert stock_right and stock_left == {"accumulate": 2}, (stock_right, stock_left)  # not in the stock table
    try:
        right, done, left = run_with(teach(answer)())
    except Exception as e:  # noqa: BLE001  (torch wraps a pass's error in BackendCompilerFailed)
        right, done, left = False, Counter(), None
        inner = getattr(e, "inner_exception", None) or e.__cause__ or e
        if isinstance(inner, KeyError) and isinstance(inner.args[0], int):
            problems.append(f"the graph reads getitem {inner.args[0]} of each accumulate node (the new value of "
                            f"a mutated argument), and your table has no entry for {inner.args[0]}: the pass "
                            "failed with a KeyError")
        else:
            problems.append(f"the pass failed ({type(inner).__name__}: {str(inner).splitlines()[0][:160]})")
    if not problems and not right:
        problems.append(f"the rewritten graph computes something else: getitem i stands for the i-th mutated "
                        f"argument in schema order, here {dict(enumerate(mutated, 1))}")
    if problems:
        raise ExerciseFailed("with your table: " + "; ".join(problems) + f". The schema: {accumulate._schema}")
    return (f"The stock pass left both accumulate calls wrapped ({dict(stock_left)}); with your table it rewrote "
            f"{dict(done)} and left {dict(left) or 'nothing'} wrapped, and the output is unchanged.")
