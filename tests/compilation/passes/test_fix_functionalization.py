"""FixFunctionalizationPass on real pieces: a mutated graph input and its write-back, and chains
of in-place ops on one buffer (vLLM 0.34.0's passes/utility/fix_functionalization.py rewrites
every op it knows; ours does too, except where a genuine later reader needs the old value).

Under VLLM_COMPILE a piece after the attention op takes the residual as a graph *input* and
mutates it, so AOTAutograd ends the piece with a write-back `copy_(arg, <new value>)`. That copy
writes `arg`; it does not read the old value, and must not keep the op functional.

The models here take the seed's path to the in-place norms: the IR priority vllm_c with the torch
wrap off, so Dynamo traces RMSNorm straight into the custom ops (`torch.ops.minivllm.*`), which
AOTAutograd wraps in auto_functionalized. (With the wrap on, vLLM 0.34's default under VLLM_COMPILE
with Inductor, the norms reach the post-grad passes as IR ops and the lowering inserts the in-place
calls itself: tests/compilation/passes/test_ir_passes.py.)
"""

from __future__ import annotations

import logging
import operator
import re

import pytest
import torch
from torch import fx, nn
from torch._dynamo.backends.common import aot_autograd
from torch._higher_order_ops.auto_functionalize import auto_functionalized

from minivllm_compile import CompilationConfig, CompilationMode, support_torch_compile
from minivllm_compile.compilation.passes import FixFunctionalizationPass, make_pass_manager
from minivllm_compile.config.kernel import IrOpPriorityConfig, KernelConfig
from minivllm_compile.models import build_model

minivllm = torch.ops.minivllm
N = 9
LISTED = {op._opname for op in FixFunctionalizationPass.MUTATED_ARGS}
# its place in the pipeline: last, after the IR lowering and the clean-ups
_NAMES = [type(p).__name__ for p in make_pass_manager(
    CompilationConfig(mode=CompilationMode.VLLM_COMPILE)).all_passes()]
FIX = f"post_grad.{_NAMES.index('FixFunctionalizationPass')}.FixFunctionalizationPass"


@pytest.fixture(autouse=True)
def _quiet_standalone_compile():
    # with the FX graph cache off, standalone_compile has no artifact to save and warns about it
    logger = logging.getLogger("torch._inductor.standalone_compile")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def _vllm_compile_config() -> CompilationConfig:
    # no FX graph cache, so the post-grad passes really run on every piece; the seed's path to
    # the norms (the custom ops traced directly, see above)
    return CompilationConfig(mode=CompilationMode.VLLM_COMPILE, max_num_batched_tokens=16,
                             inductor_compile_config={"fx_graph_cache": False},
                             kernel_config=KernelConfig(IrOpPriorityConfig.with_default(["vllm_c"])),
                             ir_enable_torch_wrap=False)


def _pieces(manager) -> list[dict[str, str]]:
    """The manager's records, one {stage: graph source} per compiled piece."""
    pieces: list[dict[str, str]] = []
    for stage, text in manager.records:
        if stage == "post_grad.0.NoOpEliminationPass.before":
            pieces.append({})
        pieces[-1][stage] = text
    return pieces


def _wrapped_listed(text: str) -> list[str]:
    """The listed ops still `auto_functionalized` in a graph's source."""
    return [op for op in re.findall(r"\bauto_functionalized\(torch\.ops\.minivllm\.(\w+)\.default",
                                    text)
            if op in LISTED]


def _self_copies(text: str) -> list[str]:
    return re.findall(r"copy_\.default\((\w+), \1\)", text)


# --- the models, piece by piece ----------------------------------------------------------------

@pytest.mark.compiles
@pytest.mark.parametrize("name, num_layers", [("llama", 2), ("hybrid", 2)])
def test_no_listed_op_is_left_functional_in_any_piece(name, num_layers):
    """Before the fix, each piece after an attention (or conv) op kept its first
    `fused_add_rms_norm` wrapped: its residual is a graph input, written back by `copy_`."""
    lm = build_model(name, num_layers=num_layers, compilation_config=_vllm_compile_config())
    eager = build_model(name, num_layers=num_layers)
    ids = torch.randint(0, lm.config.vocab_size, (N,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(N)
    # two layers: the residual a middle piece mutates in place is the next piece's input
    torch.testing.assert_close(lm(ids, pos), eager(ids, pos), atol=1e-5, rtol=1e-5)

    pieces = _pieces(lm.model.backend.post_grad_pass_manager)
    assert len(pieces) >= 2
    written_back = 0
    for i, recs in enumerate(pieces):
        before, after = recs[f"{FIX}.before"], recs[f"{FIX}.after"]
        assert _wrapped_listed(after) == [], (i, after)
        assert ("fused_add_rms_norm" not in before
                or "torch.ops.minivllm.fused_add_rms_norm.default(" in after)
        # a write-back whose source the op now writes itself is a self-copy: erased
        written_back += len(re.findall(r"copy_\.default\(arg\d+_1, ", before))
        assert _self_copies(after) == [], (i, after)
    assert written_back > 0  # the case this file is about did occur


# --- a graph input written back, run as plain FX after the pass --------------------------------

def _aot(fn, args, passes):
    """Dynamo + AOTAutograd keeping input mutations in the graph (as Inductor does: the write-back
    `copy_`), the passes applied, then the graph run as plain FX. Returns (output, graph)."""
    graphs = []

    def fw_compiler(gm: fx.GraphModule, example_inputs):
        for p in passes:
            p(gm.graph)
        gm.recompile()
        graphs.append(gm.graph)
        return gm

    torch._dynamo.reset()
    with torch._inductor.config.patch(enable_auto_functionalized_v2=False):
        backend = aot_autograd(fw_compiler=fw_compiler, keep_inference_input_mutations=True)
        with torch.inference_mode():
            out = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    torch._dynamo.reset()
    (graph,) = graphs
    return out, graph


def _piece(h: torch.Tensor, residual: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Piece 1 of the tiny Llama in small: two add+norms on a residual that is a graph input."""
    x = h * 2
    minivllm.fused_add_rms_norm(x, residual, w, 1e-6)
    y = x + 1
    minivllm.fused_add_rms_norm(y, residual, w, 1e-6)
    return y


def test_a_mutated_graph_input_is_written_in_place_and_its_write_back_erased():
    g = torch.Generator().manual_seed(0)
    h, r, w = torch.randn(5, 8, generator=g), torch.randn(
        5, 8, generator=g), torch.rand(8, generator=g) + 0.5
    r_eager, r_fx, r_fixed = r.clone(), r.clone(), r.clone()
    ref = _piece(h, r_eager, w)

    out, graph = _aot(_piece, (h, r_fx, w), [])  # functional, for comparison
    copies = [n for n in graph.nodes if n.target is torch.ops.aten.copy_.default]
    assert [c.args[0].op for c in copies] == ["placeholder"]  # the write-back of `residual`
    assert len([n for n in graph.nodes if n.target is auto_functionalized]) == 2

    fix = FixFunctionalizationPass()
    out_fixed, graph = _aot(_piece, (h, r_fixed, w), [fix])
    assert fix.defunctionalized == {
        "minivllm::fused_add_rms_norm": 2} and not fix.skipped_read_later
    assert not [n for n in graph.nodes if n.target in (auto_functionalized,
                                                       torch.ops.aten.copy_.default)]
    # both calls now write the graph input itself
    calls = [n for n in graph.nodes if n.target is minivllm.fused_add_rms_norm.default]
    assert [c.args[1].op for c in calls] == ["placeholder", "placeholder"]
    for o, res in ((out, r_fx), (out_fixed, r_fixed)):
        torch.testing.assert_close(o, ref)
        torch.testing.assert_close(res, r_eager)  # the caller sees the residual written


@torch.library.custom_op("minivllm_test::scale_and_sum", mutates_args=("x",))
def scale_and_sum(x: torch.Tensor, s: float) -> torch.Tensor:
    """Mutates `x` and returns a value too: auto_functionalized's res[0] is that value."""
    x.mul_(s)
    return x.sum(-1)


@scale_and_sum.register_fake
def _(x, s):
    return x.new_empty(x.shape[:-1])


def test_an_op_that_returns_a_value_and_mutates_is_rewritten_too(monkeypatch):
    """vLLM's insert_defunctionalized points getitem[0] at the direct call (it used to be an
    AssertionError here)."""
    op = torch.ops.minivllm_test.scale_and_sum.default
    monkeypatch.setitem(FixFunctionalizationPass.MUTATED_ARGS, op, {1: "x"})

    def fn(h):
        x = h * 2
        total = torch.ops.minivllm_test.scale_and_sum(x, 3.0)
        return x + 1, total * 2

    h = torch.randn(5, 8, generator=torch.Generator().manual_seed(0))
    fix = FixFunctionalizationPass()
    (out, total), graph = _aot(fn, (h,), [fix])
    assert fix.defunctionalized == {"minivllm_test::scale_and_sum": 1}
    assert not [n for n in graph.nodes if n.target is auto_functionalized]
    (call,) = [n for n in graph.nodes if n.target is op]
    # total * 2 reads the call
    assert any(u.target is torch.ops.aten.mul.Tensor for u in call.users)
    ref_out, ref_total = fn(h)
    torch.testing.assert_close(out, ref_out)
    torch.testing.assert_close(total, ref_total)


# --- chains of in-place ops on one buffer, through VLLM_COMPILE -------------------------------

@support_torch_compile
class NormChain(nn.Module):
    """rms_norm into a buffer, then two add+norms that read and mutate that buffer and a residual
    the caller passes in (a graph input, written back). With `read_between`, a product of the
    rms_norm result is used only at the end: Inductor's reorder_for_locality then moves that
    read after the first add+norm, a genuine reader of the value that op overwrites."""

    def __init__(self, *, compilation_config=None, read_between: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.rand(8, generator=g) + 0.5)
        self.w2 = nn.Parameter(torch.rand(8, generator=g) + 0.5)
        self.read_between = read_between

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        minivllm.rms_norm(out, x, self.w1, 1e-6)
        y = out * 3 if self.read_between else None
        minivllm.fused_add_rms_norm(out, residual, self.w2, 1e-6)
        minivllm.fused_add_rms_norm(out, residual, self.w2, 1e-6)
        return out + y if self.read_between else out


def _chain(read_between: bool):
    """(compiled output, residual after, eager output, residual after, the pass's record)."""
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, max_num_batched_tokens=16,
                           splitting_ops=[],
                           inductor_compile_config={"fx_graph_cache": False})
    compiled = NormChain(compilation_config=cc, read_between=read_between)
    eager = NormChain(compilation_config=CompilationConfig(mode=CompilationMode.NONE),
                      read_between=read_between)
    g = torch.Generator().manual_seed(1)
    x, r = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    r_compiled, r_eager = r.clone(), r.clone()
    with torch.no_grad():
        out, ref = compiled(x, r_compiled), eager(x, r_eager)
    (piece,) = _pieces(compiled.backend.post_grad_pass_manager)
    return (out, r_compiled, ref, r_eager, piece,
            compiled.backend.post_grad_pass_manager.fix_functionalization)


@pytest.mark.compiles
@pytest.mark.parametrize("read_between", [False, True])
def test_chained_in_place_ops_on_one_buffer_match_eager(read_between):
    out, r_compiled, ref, r_eager, piece, fix = _chain(read_between)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(r_compiled, r_eager)  # the written-back residual
    before, after = piece[f"{FIX}.before"], piece[f"{FIX}.after"]
    assert "copy_.default(arg" in before  # residual is a graph input, written back
    if read_between:
        # the rms_norm result (getitem_1) is read after the first add+norm mutated it: that op
        # must stay functional (Inductor clones the buffer); the other two are rewritten
        assert re.search(r"auto_functionalized_1 = .*fused_add_rms_norm.*input = getitem_1.*\n"
                         r"(?:.*\n)*.*= torch\.ops\.aten\.mul\.Tensor\(getitem_1, 3\)", before)
        assert _wrapped_listed(after) == ["fused_add_rms_norm"]
        assert fix.skipped_read_later == {"minivllm::fused_add_rms_norm": 1}
        assert fix.defunctionalized == {"minivllm::rms_norm": 1, "minivllm::fused_add_rms_norm": 1}
    else:
        assert _wrapped_listed(after) == [] and not fix.skipped_read_later
        assert fix.defunctionalized == {"minivllm::rms_norm": 1, "minivllm::fused_add_rms_norm": 2}
        assert "copy_" not in after  # the write-back became a self-copy and was erased


@pytest.mark.compiles
def test_without_the_read_later_guard_the_chain_computes_a_wrong_result(monkeypatch):
    """vLLM's pass rewrites every listed node; on the reordered chain that overwrites a value a
    later node still reads. The test above would catch it."""
    monkeypatch.setattr(FixFunctionalizationPass, "_read_later", lambda self, node, order: None)
    out, r_compiled, ref, r_eager, piece, fix = _chain(read_between=True)
    assert _wrapped_listed(piece[f"{FIX}.after"]) == []
    assert not torch.allclose(out, ref, atol=1e-3)
    torch.testing.assert_close(r_compiled, r_eager)  # the residual chain itself is still right


# --- hand-made graphs: which copy_ counts as a read ---------------------------------------------

def _write_back_graph(reader: str) -> fx.GraphModule:
    """res = auto_functionalized(fused_add_rms_norm, input=h, residual=r); then, per `reader`:
    "write_back": copy_(r, res[2]), r's write-back (writes r, reads nothing of it);
    "copy_from": copy_(other, r), which reads r's old value."""
    g = fx.Graph()
    h0, r, w, other = (g.placeholder(n) for n in ("h0", "r", "w", "other"))
    h = g.call_function(torch.ops.aten.mul.Tensor, (h0, 2))
    res = g.call_function(auto_functionalized, (minivllm.fused_add_rms_norm.default,),
                          {"input": h, "residual": r, "weight": w, "eps": 1e-6})
    y = g.call_function(operator.getitem, (res, 1))
    new_r = g.call_function(operator.getitem, (res, 2))
    if reader == "copy_from":
        g.call_function(torch.ops.aten.copy_.default, (other, r))
    g.call_function(torch.ops.aten.copy_.default, (r, new_r))
    g.output(y)
    return fx.GraphModule(nn.Module(), g)


@pytest.mark.parametrize("reader", ["write_back", "copy_from"])
def test_a_write_back_copy_is_no_read_but_a_copy_from_the_buffer_is(reader):
    gm = _write_back_graph(reader)
    gen = torch.Generator().manual_seed(0)
    h0, r, w = torch.randn(3, 8, generator=gen), torch.randn(
        3, 8, generator=gen), torch.rand(8, generator=gen)
    args = lambda: (h0, r.clone(), w, torch.zeros(3, 8))  # noqa: E731
    ref_args = args()
    ref = gm(*ref_args)
    fix = FixFunctionalizationPass()
    fix(gm.graph)
    gm.recompile()
    got_args = args()
    torch.testing.assert_close(gm(*got_args), ref)
    for got, want in zip(got_args, ref_args):
        torch.testing.assert_close(got, want)
    left = [n for n in gm.graph.nodes if n.target is auto_functionalized]
    if reader == "write_back":
        assert not left and not fix.skipped_read_later
        # self-copy erased
        assert not [n for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default]
    else:
        assert len(left) == 1 and fix.skipped_read_later == {"minivllm::fused_add_rms_norm": 1}
