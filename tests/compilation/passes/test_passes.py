"""Post-grad passes (seed §1): FixFunctionalizationPass, NoOpEliminationPass, PostGradPassManager.

Two ways to get the graph the passes see:
- Inductor (two compiles, module-scoped): the real post-grad graph, the generated code, and the
  manager installed exactly as the backend installs it.
- aot_autograd with a forward compiler that applies passes to the functionalized graph and runs
  it as plain FX: cheap, and it executes the graph *after* the pass, so a pass that breaks the
  graph shows up as wrong numbers.

The model takes the seed's path to the norms: IR priority vllm_c with the torch wrap off, so Dynamo
traces RMSNorm straight into the in-place custom ops (vLLM 0.34's default path, the IR ops lowered
after the fusion passes, is tests/compilation/passes/test_ir_passes.py's).
"""

from __future__ import annotations

import inspect
import logging
import operator
import re
from typing import ClassVar

import pytest
import torch
from torch import fx
from torch._dynamo.backends.common import aot_autograd
from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2
from torch._inductor.utils import run_and_get_code
from torch.fx.experimental.proxy_tensor import make_fx

from minivllm_compile import CompilationConfig, CompilationMode, PassConfig, Range
from minivllm_compile.compilation.passes import (
    CallableInductorPass,
    FixFunctionalizationPass,
    InductorPass,
    NoOpEliminationPass,
    PostGradPassManager,
    VllmInductorPass,
    get_pass_context,
    pass_context,
)
from minivllm_compile.config.kernel import IrOpPriorityConfig, KernelConfig, ir_dispatch_scope
from minivllm_compile.forward_context import set_forward_context
from minivllm_compile.models import build_model
from minivllm_compile.viz.kernels import call_stats

# every test here compiles, or shares a module fixture that does: whole suite only
pytestmark = pytest.mark.compiles

N = 9
OURS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul")
# one Llama layer: input norm, post-attention add+norm, final add+norm, RoPE, SiLU-and-mul
EXPECTED_CALLS = {"rms_norm": 1, "fused_add_rms_norm": 2, "rotary_embedding": 1, "silu_and_mul": 1}


# the norms as the in-place custom ops, traced directly (see above)
SEED_PATH = CompilationConfig(mode=CompilationMode.NONE, ir_enable_torch_wrap=False,
                              kernel_config=KernelConfig(IrOpPriorityConfig.with_default(["vllm_c"])))


@pytest.fixture(scope="module")
def lm():
    return build_model("llama", num_layers=1, compilation_config=SEED_PATH)


@pytest.fixture(scope="module")
def inputs(lm):
    ids = torch.randint(0, lm.config.vocab_size, (N,), generator=torch.Generator().manual_seed(0))
    return ids, torch.arange(N)


@pytest.fixture(scope="module")
def eager_out(lm, inputs):
    return _run(lm, lm.model, *inputs)


def _run(lm, fn, ids, pos):
    md = lm.metadata([N], [N], [0], lm.allocate_caches([N]))
    # the model's IR priority and torch wrap, for the torch.compile of lm.model below too (the
    # decorated model enters them itself, but not while an outer compile traces it)
    with torch.inference_mode(), set_forward_context(md, lm.model.static_forward_context), \
            ir_dispatch_scope(lm.model.compilation_config):
        return fn(ids, pos)


def _manager(**pass_config) -> PostGradPassManager:
    mgr = PostGradPassManager()
    mgr.configure(PassConfig(**pass_config))
    return mgr


def _compile_aot(lm, inputs, graph_passes, v2: bool = False):
    """Dynamo + AOT functionalization; `graph_passes` run on the forward graph, which then runs
    as FX. Returns (output, graph)."""
    graphs = []

    def fw_compiler(gm: fx.GraphModule, example_inputs):
        for p in graph_passes:
            p(gm.graph)
        gm.recompile()
        graphs.append(gm.graph)
        return gm

    torch._dynamo.reset()
    with torch._inductor.config.patch(enable_auto_functionalized_v2=v2):
        compiled = torch.compile(lm.model, fullgraph=True,
                                 backend=aot_autograd(fw_compiler=fw_compiler))
        out = _run(lm, compiled, *inputs)
    torch._dynamo.reset()
    (graph,) = graphs
    return out, graph


def _direct_calls(graph: fx.Graph) -> dict[str, int]:
    counts = {op: 0 for op in OURS}
    for n in graph.nodes:
        for op in OURS:
            if n.op == "call_function" and n.target == getattr(torch.ops.minivllm, op).default:
                counts[op] += 1
    return counts


def _functionalized(graph: fx.Graph, hop=auto_functionalized) -> list[str]:
    return sorted(n.args[0].name() for n in graph.nodes if n.op == "call_function"
                  and n.target is hop)


# --- Inductor: the real post-grad graph and the code generated from it ----------------------

@pytest.fixture(scope="module")
def inductor_runs(lm, inputs):
    """Two Inductor compiles of the decoder, FixFunctionalization off and on; for each: the
    output, the generated module source, and the manager (with its records)."""
    runs = {}
    for fix in (False, True):
        mgr = _manager(enable_fix_functionalization=fix)
        torch._dynamo.reset()
        # installed as the backend installs it; no FX-graph cache so the passes really run
        with torch._inductor.config.patch(post_grad_custom_post_pass=mgr,
                                          enable_auto_functionalized_v2=False,
                                          fx_graph_cache=False):
            compiled = torch.compile(lm.model, backend="inductor", fullgraph=True)
            out, codes = run_and_get_code(_run, lm, compiled, *inputs)
        runs[fix] = (out, "\n".join(codes), mgr)
    torch._dynamo.reset()
    return runs


def test_inductor_output_equals_eager_with_and_without_the_pass(inductor_runs, eager_out):
    for fix, (out, _, _) in inductor_runs.items():
        torch.testing.assert_close(out, eager_out, atol=1e-5, rtol=1e-5, msg=f"fix={fix}")


def test_post_grad_graph_calls_our_ops_directly(inductor_runs):
    """After the pass, the graph Inductor lowers calls each of our ops in place; the attention op
    (not ours to fix) stays auto_functionalized for Inductor to handle."""
    _, _, mgr = inductor_runs[True]
    before, after = mgr.records[0][1], mgr.records[-1][1]
    for op in OURS:
        assert f"auto_functionalized(torch.ops.minivllm.{op}.default" in before, op
        assert f"auto_functionalized(torch.ops.minivllm.{op}.default" not in after, op
        assert len(re.findall(rf"= torch\.ops\.minivllm\.{op}\.default\(",
                              after)) == EXPECTED_CALLS[op], op
    assert "auto_functionalized(torch.ops.minivllm.unified_attention_with_output.default" in after
    # RoPE rotated q and k in place inside the qkv matmul's output: no scatter back into a copy
    assert "slice_scatter" in before and "slice_scatter" not in after
    assert mgr.fix_functionalization.defunctionalized == {f"minivllm::{k}": v
                                                          for k, v in EXPECTED_CALLS.items()}


def test_generated_code_has_fewer_copies_and_buffers_with_the_pass(inductor_runs):
    off, on = (call_stats(inductor_runs[fix][1]) for fix in (False, True))  # as notebook 05 counts
    print(f"\ngenerated code, FixFunctionalization off: {off}; on: {on}")
    # Inductor's own reinplacing already removes the clones of the norms' and silu's fresh
    # outputs; what it cannot reinplace is RoPE on q/k, slices of the qkv matmul: a clone of
    # q/k before the op and a copy back into qkv after it. The pass removes both.
    assert on["copy_kernels"] == 0 < off["copy_kernels"]
    assert on["buffers"] < off["buffers"]
    assert on["generated_kernels"] < off["generated_kernels"]


def test_every_pass_records_the_graph_before_and_after_itself(inductor_runs):
    _, _, mgr = inductor_runs[True]
    assert [name for name, _ in mgr.records] == [
        "post_grad.0.NoOpEliminationPass.before", "post_grad.0.NoOpEliminationPass.after",
        "post_grad.1.PostCleanupPass.before", "post_grad.1.PostCleanupPass.after",
        "post_grad.2.VllmIRLoweringPass.before", "post_grad.2.VllmIRLoweringPass.after",
        "post_grad.3.UnsafeCloneEliminationPass.before",
        "post_grad.3.UnsafeCloneEliminationPass.after",
        "post_grad.4.PostCleanupPass.before", "post_grad.4.PostCleanupPass.after",
        "post_grad.5.FixFunctionalizationPass.before",
        "post_grad.5.FixFunctionalizationPass.before_cleanup",
        "post_grad.5.FixFunctionalizationPass.after",
    ]
    assert all(text.lstrip().startswith("def forward(self") for _, text in mgr.records)
    _, _, mgr_off = inductor_runs[False]
    assert [name for name, _ in mgr_off.records][-1] == "post_grad.4.PostCleanupPass.after"


# --- aot_autograd: run the graph after the pass ------------------------------------------------

def test_defunctionalized_graph_runs_and_matches_eager(lm, inputs, eager_out):
    fix = FixFunctionalizationPass()
    out, graph = _compile_aot(lm, inputs, [fix])
    torch.testing.assert_close(out, eager_out, atol=1e-5, rtol=1e-5)
    assert _direct_calls(graph) == EXPECTED_CALLS
    assert _functionalized(graph) == ["minivllm::unified_attention_with_output"]
    assert sum(fix.defunctionalized.values()) == sum(EXPECTED_CALLS.values())


def test_hybrid_model_q_k_norms_and_rope_too_and_the_conv_op_is_left_alone():
    """The hybrid's attention norms q and k per head (two rms_norm) before RoPE, unfused as vLLM
    writes it (QKNormRoPEFusionPass, tests/compilation/passes/test_qk_norm_rope_fusion.py,
    fuses them under Inductor)."""
    # conv, then attention
    hybrid = build_model("hybrid", num_layers=2, compilation_config=SEED_PATH)
    inputs = (torch.randint(0, hybrid.config.vocab_size, (N,)), torch.arange(N))
    fix = FixFunctionalizationPass()
    out, graph = _compile_aot(hybrid, inputs, [fix])
    torch.testing.assert_close(out, _run(hybrid, hybrid.model, *inputs), atol=1e-5, rtol=1e-5)
    # the conv layer's input norm (the attention layer's is fused_add_rms_norm), then q's and k's
    assert fix.defunctionalized["minivllm::rms_norm"] == 3
    assert fix.defunctionalized["minivllm::rotary_embedding"] == 1
    assert "minivllm::fused_qk_norm_rope" not in fix.defunctionalized
    assert _functionalized(graph) == ["minivllm::short_conv",
                                      "minivllm::unified_attention_with_output"]


def test_dead_code_elimination_after_the_pass_deletes_the_in_place_ops(lm, inputs, eager_out):
    """Why nothing may run DCE after FixFunctionalization: an in-place call returns None and has
    no users. A DCE that goes by users deletes every one of them and the output is garbage.
    torch 2.13's own `Graph.eliminate_dead_code()` happens to keep them (it treats ops with a
    mutable schema as impure), but vLLM's passes cannot count on every DCE doing that."""

    def default_dce(graph: fx.Graph) -> None:
        graph.eliminate_dead_code()

    out, graph = _compile_aot(lm, inputs, [FixFunctionalizationPass(), default_dce])
    assert _direct_calls(graph) == EXPECTED_CALLS
    torch.testing.assert_close(out, eager_out, atol=1e-5, rtol=1e-5)

    def users_only_dce(graph: fx.Graph) -> None:
        graph.eliminate_dead_code(is_impure_node=lambda n: n.op in ("placeholder", "output"))

    out, graph = _compile_aot(lm, inputs, [FixFunctionalizationPass(), users_only_dce])
    assert _direct_calls(graph) == {op: 0 for op in OURS}
    assert not torch.allclose(out, eager_out, atol=1e-3)

    # the functional graph, by contrast, survives the same DCE: every result is used via getitem
    out, graph = _compile_aot(lm, inputs, [users_only_dce])
    torch.testing.assert_close(out, eager_out, atol=1e-5, rtol=1e-5)


def test_auto_functionalized_v2_is_left_to_inductor_with_a_warning(lm, inputs, eager_out, caplog):
    fix = FixFunctionalizationPass()
    with caplog.at_level(logging.WARNING,
                         logger="minivllm_compile.compilation.passes.utility.fix_functionalization"):
        out, graph = _compile_aot(lm, inputs, [fix], v2=True)
    assert "enable_auto_functionalized_v2=False" in caplog.text
    assert sum(fix.skipped_v2.values()) == sum(EXPECTED_CALLS.values())
    assert not fix.defunctionalized
    assert len(_functionalized(graph, auto_functionalized_v2)) == sum(EXPECTED_CALLS.values()) + 1
    torch.testing.assert_close(out, eager_out, atol=1e-5, rtol=1e-5)


# --- hand-made graphs --------------------------------------------------------------------------

def _rms_norm_graph(read_buf_later: bool) -> fx.GraphModule:
    """buf = clone(x); res = auto_functionalized(rms_norm, out=buf, ...); return res[1] (+ buf)"""
    g = fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    buf = g.call_function(torch.ops.aten.clone.default, (x,))
    res = g.call_function(auto_functionalized, (torch.ops.minivllm.rms_norm.default,),
                          {"out": buf, "input": x, "weight": w, "eps": 1e-6})
    y = g.call_function(operator.getitem, (res, 1))
    if read_buf_later:  # the old value of buf, as after a CSE that merged two clones
        y = g.call_function(torch.ops.aten.add.Tensor, (y, buf))
    g.output(y)
    return fx.GraphModule(torch.nn.Module(), g)


@pytest.mark.parametrize("read_buf_later", [False, True])
def test_an_op_whose_input_is_read_later_stays_functional(read_buf_later, caplog):
    gm = _rms_norm_graph(read_buf_later)
    x, w = torch.randn(3, 8), torch.rand(8)
    ref = gm(x, w)
    fix = FixFunctionalizationPass()
    with caplog.at_level(logging.INFO):
        fix(gm.graph)
    gm.recompile()
    torch.testing.assert_close(gm(x, w), ref)
    assert (_direct_calls(gm.graph)["rms_norm"], len(_functionalized(gm.graph))) == (
        (0, 1) if read_buf_later else (1, 0))
    assert ("is read after" in caplog.text) == read_buf_later
    assert sum(fix.skipped_read_later.values()) == int(read_buf_later)


def test_noop_elimination_removes_same_shape_views_and_full_slices():
    def f(x, y):
        n = x.shape[0]
        a = torch.ops.aten.view.default(x, [n, 6])  # same shape: gone
        b = torch.ops.aten.view.default(a, [-1, 3, 2])  # a real reshape: kept, rebased on x
        c = torch.ops.aten.view.default(b, [n, 6])  # back to x's shape: gone (chain), b with it
        s = torch.ops.aten.slice.Tensor(c, 1, 0, 9223372036854775807)  # the full extent: gone
        p = torch.ops.aten.slice.Tensor(s, 1, 0, 3)  # a real slice: kept
        sc = torch.ops.aten.slice_scatter.default(s, y, 0, 0, n)  # y overwrites everything: y
        return p, sc

    x, y = torch.randn(4, 6), torch.randn(4, 6)
    gm = make_fx(f, tracing_mode="symbolic")(x, y)  # symbolic n: equal only when provably so
    ref = gm(x, y)
    noop = NoOpEliminationPass()
    noop(gm.graph)
    gm.recompile()
    for r, o in zip(ref, gm(x, y)):
        torch.testing.assert_close(o, r)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count(torch.ops.aten.view.default) == 0
    assert targets.count(torch.ops.aten.slice.Tensor) == 1
    assert torch.ops.aten.slice_scatter.default not in targets
    assert noop.removed == 5


# --- the manager: order, records, uuid ----------------------------------------------------------

class _CountNodes(VllmInductorPass):
    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        self.seen = len(graph.nodes)


class _SingleSizeOnly(InductorPass):
    def __call__(self, graph: fx.Graph) -> None:
        graph.owning_module.ran = True

    def is_applicable_for_range(self, compile_range: Range | None) -> bool:
        return compile_range is not None and compile_range.is_single_size()


def _tiny_gm() -> fx.GraphModule:
    return make_fx(lambda x: x.view(x.shape) + 1)(torch.randn(2, 3))


def test_manager_order_records_and_range_filter():
    mgr = _manager()
    mgr.add(_CountNodes())
    mgr.add(CallableInductorPass(lambda graph: None))  # a plain function, wrapped explicitly
    mgr.add(_SingleSizeOnly())
    assert [type(p).__name__ for p in mgr.all_passes()] == [
        "NoOpEliminationPass", "_CountNodes", "CallableInductorPass", "_SingleSizeOnly",
        "PostCleanupPass", "VllmIRLoweringPass", "UnsafeCloneEliminationPass", "PostCleanupPass",
        "FixFunctionalizationPass"]
    gm = _tiny_gm()
    with pass_context(Range(1, 8)):  # as CompilerManager.compile_context sets it around a compile
        mgr(gm.graph)
    names = [name for name, _ in mgr.records]
    assert names[:2] == ["post_grad.0.NoOpEliminationPass.before",
                         "post_grad.0.NoOpEliminationPass.after"]
    # a plain InductorPass is recorded by the manager; the range filter skipped _SingleSizeOnly
    assert "post_grad.2.CallableInductorPass.after" in names
    assert not any("_SingleSizeOnly" in n for n in names) and not hasattr(gm, "ran")
    assert "view" in mgr.records[0][1] and "view" not in mgr.records[1][1]  # NoOp did its job
    with pass_context(Range(4, 4)):
        mgr(gm.graph)
    assert gm.ran
    with pytest.raises(TypeError, match="takes an InductorPass.*give an InductorPass"):
        mgr.add(42)
    # the IR lowering and its clean-ups always run (vLLM 0.34 has no switch for them)
    assert [type(p).__name__ for p in _manager(eliminate_noops=False,
                                               enable_fix_functionalization=False)
            .all_passes()] == ["PostCleanupPass", "VllmIRLoweringPass",
                               "UnsafeCloneEliminationPass",
                               "PostCleanupPass"]


def test_manager_uuid_depends_on_pass_config_compile_range_and_passes():
    base = _manager().uuid()
    assert base == _manager().uuid()  # deterministic, so Inductor's cache can hit
    assert _manager(enable_fix_functionalization=False).uuid() != base
    assert _manager(eliminate_noops=False).uuid() != base
    with pass_context(Range(1, 8)):  # Inductor asks for it inside a piece's compile
        assert _manager().uuid() != base
    with_user_pass = _manager()
    with_user_pass.add(_CountNodes())
    assert with_user_pass.uuid() != base


def test_pass_uuid_is_the_hash_of_its_source():
    def a(graph):
        pass

    def b(graph):
        graph.lint()

    assert CallableInductorPass(a).uuid() == CallableInductorPass(a).uuid()
    assert CallableInductorPass(a).uuid() != CallableInductorPass(b).uuid()
    assert CallableInductorPass(a, uuid="fixed").uuid() == "fixed"
    assert FixFunctionalizationPass().uuid() == InductorPass.hash_source(FixFunctionalizationPass)
    assert FixFunctionalizationPass().uuid() != NoOpEliminationPass().uuid()
    # the op table is a class attribute, so it is part of the hashed source; a subclass that
    # changes it has its own source and so its own uuid (as in vLLM, only the class's own source
    # counts, not its bases')
    assert "minivllm.rotary_embedding.default" in inspect.getsource(FixFunctionalizationPass)

    class Edited(FixFunctionalizationPass):
        MUTATED_ARGS: ClassVar = {**FixFunctionalizationPass.MUTATED_ARGS}

    assert Edited().uuid() != FixFunctionalizationPass().uuid()


def test_mutated_args_table_follows_each_schema():
    """getitem i (i >= 1) is the i-th mutated argument in schema order: the table must agree."""
    for op, table in FixFunctionalizationPass.MUTATED_ARGS.items():
        mutated = [a.name for a in op._schema.arguments if a.alias_info is not None
                   and a.alias_info.is_write]
        assert table == {i + 1: name for i, name in enumerate(mutated)}, op
        assert not op._schema.returns, op  # index 0, the return value, is None


def test_the_backend_compiles_each_entry_inside_its_pass_context():
    """CompilerManager.compile_context puts each piece's compile range in the pass context, where a
    pass reads it (vLLM's get_pass_context); outside a compile there is none, and the manager runs
    every pass."""
    import torch._dynamo

    from minivllm_compile import CompilationConfig, CompilationMode
    from minivllm_compile.compilation.backends import VllmBackend

    seen = []

    class RecordRange(InductorPass):
        def __call__(self, graph: fx.Graph) -> None:
            seen.append(get_pass_context().compile_range)

    with pytest.raises(RuntimeError, match="pass_context"):
        get_pass_context()
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, compile_sizes=[4],
                           compile_ranges_endpoints=[], max_num_batched_tokens=16,
                           inductor_compile_config={"post_grad_custom_post_pass": RecordRange(),
                                                    "fx_graph_cache": False})
    x = torch.randn(8, 4)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.reset()
    backend = VllmBackend(cc)
    out = torch.compile(lambda t: torch.relu(t) * 2, backend=backend, fullgraph=True)(x)
    torch._dynamo.reset()
    torch.testing.assert_close(out, torch.relu(x) * 2)
    assert sorted(seen, key=lambda r: (r.start, r.end)) == [Range(1, 16), Range(4, 4)]
    mgr = _manager(eliminate_noops=False, enable_fix_functionalization=False)
    mgr.add(RecordRange())
    with pytest.raises(RuntimeError, match="pass_context"):
        mgr(_tiny_gm().graph)  # the pass itself asks for the context: none outside a compile
    assert PostGradPassManager.compile_range() is None


def test_add_takes_an_inductor_pass_only_and_the_config_wraps_a_function():
    """As vLLM's PostGradPassManager.add (it asserts isinstance InductorPass): a plain function or a
    bare CustomGraphPass is refused, naming the wrapper; a function given as the config's
    post_grad_custom_post_pass is wrapped on the way in, keyed by its source."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    from minivllm_compile import CompilationConfig
    from minivllm_compile.compilation.passes import make_pass_manager

    class Bare(CustomGraphPass):
        def __call__(self, graph):
            pass

        def uuid(self):
            return "bare"

    def user_pass(graph):
        pass

    mgr = _manager()
    for bad in (user_pass, Bare()):
        with pytest.raises(TypeError, match=r"takes an InductorPass.*CallableInductorPass\(fn\)"):
            mgr.add(bad)
    assert [type(p).__name__ for p in mgr.passes] == ["NoOpEliminationPass"]
    for given, uuid in ((user_pass, InductorPass.hash_source(user_pass)), (Bare(), "bare")):
        cc = CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": given})
        wrapped = make_pass_manager(cc).passes[-1]
        assert isinstance(wrapped, CallableInductorPass) and wrapped.uuid() == uuid
    with pytest.raises(TypeError, match="post_grad_custom_post_pass"):
        make_pass_manager(CompilationConfig(
            inductor_compile_config={"post_grad_custom_post_pass": 42}))
