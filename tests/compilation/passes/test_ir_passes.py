"""vLLM IR through the compiler: RMSNorm's IR ops as one node each under Dynamo, the pre-grad
functionalization, the lowering by priority after the fusion passes, the clone elimination, and the
outputs of every shipped checkpoint against the path they took before the IR (the in-place custom
ops called directly, as RMSNorm called them then)."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from minivllm_compile import CompilationConfig, CompilationMode, PassConfig, ir
from minivllm_compile.compilation.passes import InductorPass, make_pass_manager
from minivllm_compile.compilation.passes.ir import (
    UnsafeCloneEliminationPass,
    VllmIRInplaceFunctionalizationPass,
    VllmIRLoweringPass,
)
from minivllm_compile.config.kernel import IrOpPriorityConfig, KernelConfig
from minivllm_compile.models import build_model, load_model
from minivllm_compile.models.layers import RMSNorm

MAX = 16
# fp32 logits (|logit| up to ~18): the IR ops' native body and the old custom ops do the same fp32
# arithmetic, so eager agrees to the last bits; Inductor's fused code orders the sums its own way
EAGER_TOL = {"atol": 1e-5, "rtol": 1.3e-6}  # the IR ops' float32 tolerance (ir/tolerances.py)
COMPILED_TOL = {"atol": 1e-4, "rtol": 1e-5}

pytestmark = pytest.mark.usefixtures("compile_every_time")


def _kernels(*priority: str) -> KernelConfig:
    return KernelConfig(IrOpPriorityConfig.with_default(list(priority)))


def _cc(*priority: str, **kw) -> CompilationConfig:
    kw.setdefault("inductor_compile_config", {"fx_graph_cache": False})  # the passes really run
    return CompilationConfig(mode=CompilationMode.VLLM_COMPILE, max_num_batched_tokens=MAX,
                             kernel_config=_kernels(*priority), **kw)


def _ids(lm, n: int = 9) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(0, lm.config.vocab_size, (n,), generator=g), torch.arange(n)


def _old_forward(self, x, residual=None):
    """RMSNorm.forward before the IR: the in-place custom ops, called directly."""
    if residual is None:
        out = torch.empty_like(x)
        torch.ops.minivllm.rms_norm(out, x, self.weight, self.eps)
        return out
    torch.ops.minivllm.fused_add_rms_norm(x, residual, self.weight, self.eps)
    return x, residual


def _before(name: str, monkeypatch) -> torch.Tensor:
    with monkeypatch.context() as m:
        m.setattr(RMSNorm, "forward", _old_forward)
        lm = load_model(name)
        return lm(*_ids(lm))


# --- every model keeps its outputs; the three priorities agree -----------------------------------

def _triton_here() -> bool:
    return "triton" in ir.ops.rms_norm.supported_providers()  # a GPU, or the interpreter (conftest)


@pytest.mark.compiles
def test_tiny_llama_under_every_priority_keeps_its_logits(monkeypatch):
    before = _before("tiny-llama", monkeypatch)
    eager = load_model("tiny-llama")
    torch.testing.assert_close(eager(*_ids(eager)), before, **EAGER_TOL)
    priorities = ["native", "vllm_c"] + (["triton"] if _triton_here() else [])
    assert len(priorities) == 3  # this suite runs with Triton's interpreter on a CPU, or on a GPU
    for priority in priorities:
        lm = load_model("tiny-llama", compilation_config=_cc(priority, "native"))
        got = lm(*_ids(lm))
        torch.testing.assert_close(got, before, **COMPILED_TOL, msg=lambda m,
                                   p=priority: f"{p}: {m}")
        lowering = lm.model.backend.post_grad_pass_manager.ir_lowering
        # every norm of every compiled piece went to the priority's provider
        assert {p for (_, p) in lowering.lowered} == {priority}, lowering.lowered
        assert not lowering.unlowered


@pytest.mark.compiles
@pytest.mark.parametrize("name", ["tiny-hybrid", "tiny-llama-fp8"])
def test_the_other_checkpoints_keep_their_logits(name, monkeypatch):
    before = _before(name, monkeypatch)
    eager = load_model(name)
    torch.testing.assert_close(eager(*_ids(eager)), before, **EAGER_TOL)
    compiled = load_model(name, compilation_config=_cc("native"))
    torch.testing.assert_close(compiled(*_ids(compiled)), before, **COMPILED_TOL)


def test_eager_dispatch_follows_the_models_priority(monkeypatch):
    calls = []
    for op in (ir.ops.rms_norm, ir.ops.fused_add_rms_norm):
        impl = op.impls["vllm_c"]
        monkeypatch.setattr(impl, "impl_fn", lambda *a, _f=impl.impl_fn,
                            _n=op.name: calls.append(_n) or _f(*a))
    default = build_model("llama", num_layers=2,
                          compilation_config=CompilationConfig(mode=CompilationMode.NONE))
    # a CPU
    assert default.model.compilation_config.kernel_config.ir_op_priority.rms_norm == ["native"]
    default(*_ids(default))
    assert calls == []
    cc = CompilationConfig(mode=CompilationMode.NONE, kernel_config=_kernels("vllm_c", "native"))
    lm = build_model("llama", num_layers=2, compilation_config=cc)
    torch.testing.assert_close(lm(*_ids(lm)), default(*_ids(default)), **EAGER_TOL)
    # layer 0's input norm, then the other three norms and the final one add the residual
    assert calls == ["rms_norm"] + ["fused_add_rms_norm"] * 4
    assert ir.ops.rms_norm.get_priority() == []  # the call's scope is over


# --- under Dynamo ---------------------------------------------------------------------------------

def _ir_targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if "minivllm_ir" in str(n.target)]


@pytest.mark.compiles
def test_under_dynamo_the_ir_op_is_one_node_and_without_the_wrap_the_provider_is_traced():
    wrapped = build_model("llama", num_layers=2, compilation_config=_cc("native", backend="eager",
                                                                       ir_enable_torch_wrap=True))
    wrapped(*_ids(wrapped))
    graph = wrapped.model.backend.graphs[0]
    assert _ir_targets(graph) == ["minivllm_ir.rms_norm.default"] + [
        "minivllm_ir.fused_add_rms_norm.maybe_inplace"] * 4
    assert "torch.ops.minivllm.fused_add_rms_norm" not in graph.code
    for priority, marker in (("native", "torch.rsqrt"),
                             ("vllm_c", "torch.ops.minivllm.fused_add_rms_norm")):
        lm = build_model("llama", num_layers=2, compilation_config=_cc(priority, "native",
                                                                       backend="eager"))
        # vLLM's default without Inductor
        assert lm.model.compilation_config.ir_enable_torch_wrap is False
        lm(*_ids(lm))
        code = lm.model.backend.graphs[0].code
        assert _ir_targets(lm.model.backend.graphs[0]) == [] and marker in code, priority
        # the provider's file was traced: its edits invalidate the cache through traced_files
        traced = lm.model.compilation_config.traced_files
        assert any(p.endswith("ir/op.py") for p in traced)
        assert any(p.endswith("ir/kernels/vllm_c.py") for p in traced) == (priority == "vllm_c")


# --- the passes, on small graphs ------------------------------------------------------------------

def _piece(h, residual, w1, w2, donate: bool):
    """Two add+norms on a residual that is a graph input, as a piece after attention holds them."""
    add_norm = ir.ops.fused_add_rms_norm.maybe_inplace if donate else ir.ops.fused_add_rms_norm
    x, residual = add_norm(h * 2, residual, w1, 1e-6)
    return add_norm(x @ torch.ones(8, 8), residual, w2, 1e-6)


def _args():
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g), \
        torch.rand(8, generator=g) + 0.5, torch.rand(8, generator=g) + 0.5


@pytest.mark.parametrize("donate", [False, True])
def test_clone_elimination_frees_a_donated_input_and_keeps_the_callers(donate):
    args = _args()
    want = _piece(*(a.clone() for a in args), donate=False)
    gm = make_fx(lambda *a: _piece(*a, donate=donate), tracing_mode="fake")(*args)
    pre = VllmIRInplaceFunctionalizationPass()
    pre(gm.graph)  # maybe_inplace -> the default overload; records the donated placeholder
    assert pre.functionalized_ops == ({"fused_add_rms_norm": 2} if donate else {})
    lowering = VllmIRLoweringPass(
        ir_op_priority=IrOpPriorityConfig.with_default(["vllm_c", "native"]))
    lowering(gm.graph)

    def clones():
        return sum(n.target is torch.ops.aten.clone.default for n in gm.graph.nodes)

    # x and residual, per call
    assert lowering.summary() == "fused_add_rms_norm=vllm_c*2" and clones() == 4
    elim = UnsafeCloneEliminationPass()
    elim(gm.graph)
    gm.recompile()
    # the copies of values computed in the graph always go; the caller's
    # residual's only when donated
    assert (elim.removed, clones()) == ((4, 0) if donate else (3, 1))
    inputs = [a.clone() for a in args]
    for got, w in zip(gm(*inputs), want):
        torch.testing.assert_close(got, w)
    assert torch.equal(inputs[1], args[1]) != donate  # a donated residual was written in place


def test_the_lowering_logs_its_choices_and_warns_about_what_it_left(caplog):
    gm = make_fx(lambda *a: _piece(*a, donate=True), tracing_mode="fake")(*_args())
    lowering = VllmIRLoweringPass(ir_op_priority=IrOpPriorityConfig.with_default(["native"]))
    with caplog.at_level(logging.DEBUG,
                         logger="minivllm_compile.compilation.passes.ir.lowering_pass"):
        lowering(gm.graph)  # no pre-grad pass: the maybe_inplace overloads are not lowered
    assert len(lowering.unlowered) == 2
    assert "Failed to lower vLLM IR ops ['fused_add_rms_norm']" in caplog.text
    gm = make_fx(lambda *a: _piece(*a, donate=False), tracing_mode="fake")(*_args())
    caplog.clear()
    with caplog.at_level(logging.DEBUG,
                         logger="minivllm_compile.compilation.passes.ir.lowering_pass"):
        lowering(gm.graph)
    assert ("lowered 2 vLLM IR nodes; selected implementations: "
            "fused_add_rms_norm=native*2" in caplog.text)
    assert "Failed" not in caplog.text and not lowering.unlowered


# --- in the compiler: order, the in-place provider, the uuids
# --------------------------------------

@pytest.mark.compiles
def test_the_pass_order_is_vllms_and_the_backend_installs_the_pre_grad_pass():
    cc = _cc("native", pass_config=PassConfig(fuse_norm_quant=True, fuse_act_quant=True,
                                              enable_qk_norm_rope_fusion=True))
    names = [type(p).__name__ for p in make_pass_manager(cc).all_passes()]
    assert names == ["NoOpEliminationPass", "RMSNormQuantFusionPass", "ActivationQuantFusionPass",
                     "QKNormRoPEFusionPass", "PostCleanupPass", "VllmIRLoweringPass",
                     "UnsafeCloneEliminationPass", "PostCleanupPass", "FixFunctionalizationPass"]
    lm = build_model("llama", num_layers=1, compilation_config=_cc("native"))
    lm(*_ids(lm))
    config = lm.model.backend.inductor_config
    assert isinstance(config["pre_grad_custom_pass"], VllmIRInplaceFunctionalizationPass)
    assert "pre_grad_custom_pass" in config.get("_cache_config_ignore_prefix",
                                                torch._inductor.config._cache_config_ignore_prefix)
    # raised by the backend, which Dynamo reports as BackendCompilerFailed around the ValueError
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed,
                       match="pre_grad_custom_pass'\\] is the backend's"):
        bad = build_model("llama", num_layers=1, compilation_config=_cc(
            "native", inductor_compile_config={
                "pre_grad_custom_pass": VllmIRInplaceFunctionalizationPass()}))
        bad(*_ids(bad))


def _fix_norms(lm, stage: str = "before") -> dict[str, int]:
    """The norms wrapped in auto_functionalized when FixFunctionalization ran, over every piece."""
    from collections import Counter

    return dict(Counter(op for s, src in lm.model.backend.post_grad_pass_manager.records
                        if s.endswith(f"FixFunctionalizationPass.{stage}")
                        for op in re.findall(r"auto_functionalized\(torch\.ops\.minivllm\."
                                             r"(\w*rms_norm)\.default", src)))


# the name alone is 103 columns; renaming the test would change its id
@pytest.mark.compiles
def test_an_in_place_provider_is_lowered_in_place_and_the_seeds_path_still_needs_fix_functionalization():  # noqa: E501
    """vllm_c with the wrap on (vLLM 0.34): the lowering inserts the in-place calls itself, on
    copies the clone elimination then removes, so FixFunctionalization has no norm left to fix.
    With the wrap off (the seed's path) AOTAutograd wraps the custom ops in auto_functionalized and
    FixFunctionalization rewrites them, as before."""
    lm = build_model("llama", num_layers=1, compilation_config=_cc("vllm_c", "native"))
    lm(*_ids(lm))
    manager = lm.model.backend.post_grad_pass_manager
    code = "".join(c for e in lm.model.backend.compiler_manager.entries for c in e.code)
    assert manager.clone_elimination.removed > 0 and _fix_norms(lm) == {}
    assert re.search(r"torch\.ops\.minivllm\.fused_add_rms_norm\.default\(", code)
    assert not re.search(r"\.copy_\(|aten\.clone|\bclone\(", code)  # nothing copied for the norms
    seed = build_model("llama", num_layers=1, compilation_config=_cc("vllm_c", "native",
                                                                     ir_enable_torch_wrap=False))
    seed(*_ids(seed))
    assert _fix_norms(seed) == {"fused_add_rms_norm": 2,
                                "rms_norm": 1} and _fix_norms(seed, "after") == {}
    assert seed.model.backend.post_grad_pass_manager.ir_lowering.lowered == {}
    torch.testing.assert_close(lm(*_ids(lm)), seed(*_ids(seed)))


def test_each_ir_pass_uuid_covers_what_changes_its_output():
    def lowering(*priority):
        return VllmIRLoweringPass(
            ir_op_priority=IrOpPriorityConfig.with_default(list(priority))).uuid()

    assert lowering("native") == lowering("native") != lowering("vllm_c", "native")
    impl = ir.ops.rms_norm.impls["native"]
    old = impl.uuid()
    try:
        impl._uuid = "edited"  # as if the provider's file had changed
        edited = lowering("native")
    finally:
        impl._uuid = old
    assert edited != lowering("native")
    for cls in (VllmIRInplaceFunctionalizationPass, UnsafeCloneEliminationPass):
        # their output depends on their code only
        assert cls().uuid() == InductorPass.hash_source(cls)
    # the manager's uuid (Inductor's FX-graph key) moves with the priority
    assert make_pass_manager(_cc("native")).uuid() != make_pass_manager(
        _cc("vllm_c", "native")).uuid()
