"""vLLM IR (minivllm_compile/ir/): every provider of every op against `native`, within the op's
tolerance, and every refusal the issue lists, each naming the op and the fix. Nothing compiles
here (tests/compilation/passes/test_ir_passes.py compiles)."""

from __future__ import annotations

import pytest
import torch

import minivllm_compile.ir.kernels  # noqa: F401  (the providers)
from minivllm_compile import ir
from minivllm_compile.config.kernel import IrOpPriorityConfig, KernelConfig
from minivllm_compile.ir.op import IrOp, register_op

OPS = [ir.ops.rms_norm, ir.ops.fused_add_rms_norm]  # the third: test_gelu_and_mul_sparse.py
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _clone(args):
    return tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


# --- every provider against native --------------------------------------------------------------

@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens, hidden_size", [(1, 64), (7, 192), (33, 100)])
def test_every_supported_provider_matches_native(op, dtype, num_tokens, hidden_size, kernel_device):
    """Inputs from the op's own generator; the tolerance from the op (its float16 override) or
    the defaults. On the CPU the triton provider runs in Triton's interpreter (conftest)."""
    torch.manual_seed(0)
    args = op.generate_inputs(num_tokens=num_tokens, hidden_size=hidden_size, dtype=dtype,
                              device=kernel_device)
    want = _as_tuple(op.impls["native"].impl_fn(*_clone(args)))
    providers = op.supported_providers()
    assert {"native", "vllm_c", "triton"} <= set(op.impls)
    assert "vllm_c" in providers  # the custom ops run on the CPU too
    for provider in providers:
        impl = op.impls[provider]
        assert impl.supports_args(*args), provider
        inputs = _clone(args)
        got = _as_tuple(impl.func_impl_fn(*inputs))
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, **op.get_tolerance(dtype), msg=lambda m,
                                       p=provider: f"{p}: {m}")
        # the functional form never writes its inputs, in-place provider or not
        for a, b in zip(inputs, args):
            if isinstance(a, torch.Tensor):
                assert torch.equal(a, b), provider


def test_the_in_place_providers_write_into_the_activations_through_maybe_inplace():
    op = ir.ops.fused_add_rms_norm
    args = op.generate_inputs(num_tokens=4, hidden_size=32, dtype=torch.float32)
    want = op.impls["native"].impl_fn(*_clone(args))
    assert [p for p in op.impls if op.impls[p].inplace] == ["triton", "vllm_c"]
    with op.set_priority(["vllm_c", "native"]):
        x, residual = _clone(args)[:2]
        out, new_residual = op.maybe_inplace(x, residual, *args[2:])
        assert out is x and new_residual is residual  # written where they were
        x2, r2 = _clone(args)[:2]
        out2, _ = op(x2, r2, *args[2:])  # the default overload: copies, inputs untouched
        assert out2.data_ptr() != x2.data_ptr() and torch.equal(x2, args[0])
    for g, w in zip((out, new_residual), want):
        torch.testing.assert_close(g, w, **op.get_tolerance(torch.float32))


def test_supports_args_sends_what_a_kernel_lacks_to_the_next_provider():
    op = ir.ops.rms_norm
    x, w, eps = op.generate_inputs(num_tokens=3, hidden_size=16, dtype=torch.float32)
    with op.set_priority(["vllm_c", "native"]):
        assert op.dispatch(x, w, eps).provider == "vllm_c"
        assert op.dispatch(x, w, eps, 8).provider == "native"  # variance_size: not in the kernel
        assert op.dispatch(x, w.double(), eps).provider == "native"  # another weight dtype
        assert op.dispatch(x, None, eps).provider == "vllm_c"  # no weight: vLLM's takes it too
        torch.testing.assert_close(op(x, w, eps, 8), op.impls["native"].impl_fn(x, w, eps, 8))


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_kernel_providers_take_no_weight_as_native_does(op, dtype, kernel_device):
    """weight=None: vLLM's providers accept it (tests/kernels/ir/test_layernorm.py, "test
    weight=None behavior": the provider without a weight against it with a weight of ones); here
    they failed on it (an AttributeError), and supports_args sent it to native."""
    torch.manual_seed(0)
    args = op.generate_inputs(num_tokens=5, hidden_size=48, dtype=dtype, device=kernel_device)
    w = list(op.py_signature.parameters).index("weight")
    no_weight = args[:w] + (None,) + args[w + 1:]
    unit_weight = args[:w] + (torch.ones_like(args[w]),) + args[w + 1:]
    want = _as_tuple(op.impls["native"].impl_fn(*_clone(no_weight)))
    for provider in ("vllm_c", "triton"):
        impl = op.impls[provider]
        if not impl.supported:
            continue
        assert impl.supports_args(*no_weight), provider
        got = _as_tuple(impl.func_impl_fn(*_clone(no_weight)))
        for g, u, n in zip(got, _as_tuple(impl.func_impl_fn(*_clone(unit_weight))), want):
            torch.testing.assert_close(g, u, rtol=0, atol=0)  # no weight is a weight of ones
            torch.testing.assert_close(g, n, **op.get_tolerance(dtype))
        with op.set_priority([provider, "native"]):
            assert op.dispatch(*no_weight) is impl


def test_dispatch_follows_the_priority_and_the_scope_restores_it():
    op = ir.ops.rms_norm
    args = op.generate_inputs(num_tokens=2, hidden_size=8, dtype=torch.float32)
    before = op.get_priority()
    with op.set_priority(["vllm_c"]):
        # no provider but native takes every argument: native is tried last
        assert op.get_priority() == ["vllm_c", "native"]
        assert op.dispatch(*args).provider == "vllm_c"
        with op.set_priority(["native"]):
            assert op.dispatch(*args).provider == "native"
        assert op.get_priority() == ["vllm_c", "native"]
    assert op.get_priority() == before


def test_the_config_scopes_every_op_and_the_torch_wrap_routes_the_call(monkeypatch):
    calls = []
    impl = ir.ops.rms_norm.impls["vllm_c"]
    monkeypatch.setattr(impl, "impl_fn", lambda *a: calls.append("vllm_c") or ir.ops.rms_norm.impls[
        "native"].impl_fn(*a))
    args = ir.ops.rms_norm.generate_inputs(num_tokens=2, hidden_size=8, dtype=torch.float32)
    with IrOpPriorityConfig.with_default(["vllm_c", "native"]).set_priority():
        assert ir.ops.fused_add_rms_norm.get_priority() == ["vllm_c", "native"]
        ir.ops.rms_norm(*args)  # through torch.ops.minivllm_ir.rms_norm
        with ir.enable_torch_wrap(False):
            assert not ir.torch_wrap_enabled()
            ir.ops.rms_norm(*args)  # straight to the implementation
    assert calls == ["vllm_c", "vllm_c"] and ir.torch_wrap_enabled()


def test_schema_and_names_as_vllm_declares_them():
    assert str(ir.ops.rms_norm.torch_op._schema) == (
        "minivllm_ir::rms_norm(Tensor x, Tensor? weight, float epsilon, SymInt? "
        "variance_size=None) -> Tensor")
    inplace = str(ir.ops.fused_add_rms_norm.maybe_inplace.torch_op._schema)
    assert inplace.startswith("minivllm_ir::fused_add_rms_norm.maybe_inplace(Tensor(a0!) "
                              "x, Tensor(a1!) x_residual")
    assert ir.ops.fused_add_rms_norm.activations == ["x", "x_residual"]
    assert not hasattr(ir.ops.rms_norm, "maybe_inplace")
    assert ir.RESERVED_PROVIDERS == ["native", "unfused"]
    assert (str(ir.ops.rms_norm) == "IrOp('rms_norm') - Weighted "
                                    "root-mean-square layer normalization.")
    assert ir.ops.rms_norm.get_tolerance(torch.float16) == {"atol": 1e-2, "rtol": 2e-3}
    assert ir.ops.rms_norm.get_tolerance(torch.bfloat16) == {"atol": 1e-3, "rtol": 1.6e-2}


# --- the platform defaults and the user's list ----------------------------------------------------

def test_platform_defaults_go_behind_the_users_list():
    from minivllm_compile import CompilationConfig, CompilationMode

    cc = CompilationConfig(mode=CompilationMode.NONE)
    assert cc.kernel_config.ir_op_priority == IrOpPriorityConfig(
        ["native"], ["native"], ["native"])  # this CPU
    assert cc.ir_enable_torch_wrap is False
    user = KernelConfig(IrOpPriorityConfig(
        rms_norm="vllm_c",
        fused_add_rms_norm=["triton", "native"]
        if "triton" in ir.ops.fused_add_rms_norm.supported_providers() else ["native"]))
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, kernel_config=user)
    assert cc.kernel_config.ir_op_priority.rms_norm == ["vllm_c", "native"]
    assert cc.kernel_config.ir_op_priority.fused_add_rms_norm[-1] == "native"
    assert cc.ir_enable_torch_wrap is True
    again = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, kernel_config=cc.kernel_config)
    assert again.kernel_config.ir_op_priority.rms_norm == ["vllm_c", "native"]  # appended once
    assert CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                             backend="eager").ir_enable_torch_wrap is False
    assert CompilationConfig(kernel_config={"ir_op_priority": {"rms_norm": ["vllm_c"]}}
                             ).kernel_config.ir_op_priority.rms_norm == ["vllm_c", "native"]


@pytest.mark.parametrize("mode, backend, want", [
    ("NONE", "inductor", ["vllm_c", "native"]),
    ("VLLM_COMPILE", "eager", ["vllm_c", "native"]),
    ("VLLM_COMPILE", "inductor", ["native"]),
    ("STOCK_TORCH_COMPILE", "inductor", ["native"]),
])
def test_cuda_defaults_follow_vllms_cuda_platform(monkeypatch, mode, backend, want):
    """vLLM's CudaPlatform.get_default_ir_op_priority: native when Inductor compiles, the kernels
    when nothing would fuse the norm (the platform read as CUDA here, no GPU needed)."""
    from minivllm_compile import CompilationConfig, CompilationMode, envs

    monkeypatch.setattr(envs, "default_device", lambda: "cuda")
    cc = CompilationConfig(mode=CompilationMode[mode], backend=backend)
    assert cc.kernel_config.ir_op_priority == IrOpPriorityConfig.with_default(
        want, gelu_and_mul_sparse=["triton", "native"])  # vLLM's Triton kernel, on CUDA always


# --- bad input: each error names the op and the fix ---------------------------------------------

def test_a_reserved_malformed_or_taken_provider_name_is_refused():
    """vLLM's types: it asserts a reserved and a taken name (AssertionError, raised here so that
    `python -O` keeps it), and raises ValueError for a malformed one; its words first."""
    op = ir.ops.rms_norm
    for name, error, words in (
            ("native", AssertionError, ["Provider name native is reserved.", "rms_norm",
                                        "another name"]),
            ("unfused", AssertionError, ["Provider name unfused is reserved.", "rms_norm"]),
            ("My-Kernel", ValueError, ["invalid", "rms_norm", "lowercase"]),
            ("vllm_c", AssertionError, ["Implementation for provider vllm_c already registered",
                                        "rms_norm", "Choose another name"])):
        with pytest.raises(error) as e:
            op.register_impl(name)
        for w in words:
            assert w in str(e.value), (name, str(e.value))
    assert list(op.impls) == ["native", "triton", "vllm_c"]  # nothing was added


def test_a_priority_naming_an_unknown_or_unsupported_provider_is_refused(monkeypatch):
    from minivllm_compile import CompilationConfig

    with pytest.raises(ValueError, match=r"op rms_norm names 'tritn', which is not a provider "
                                         r"of it \(registered: \['native', 'triton', "
                                         r"'vllm_c'\]\): fix the name"):
        CompilationConfig(kernel_config=KernelConfig(IrOpPriorityConfig(rms_norm=["tritn"])))
    # as on a CPU, no interpreter
    monkeypatch.setattr(ir.ops.rms_norm.impls["triton"], "supported", False)
    with pytest.raises(ValueError, match=r"op rms_norm names 'triton', which is not supported on "
                                         r"this machine .*remove it from the priority"):
        CompilationConfig(kernel_config=KernelConfig(IrOpPriorityConfig(rms_norm="triton,native")))
    with pytest.raises(ValueError, match="fused_add_rms_norm must be a list of provider names"):
        IrOpPriorityConfig(fused_add_rms_norm=[1])
    with pytest.raises(ValueError, match=r"\['gelu'\] are not IR ops"):
        KernelConfig(ir_op_priority={"gelu": ["native"]})


def test_an_implementation_whose_schema_differs_is_refused():
    op = ir.ops.rms_norm

    def other_names(x: torch.Tensor, w: torch.Tensor | None, epsilon: float,
                    variance_size: int | None = None) -> torch.Tensor: ...

    def no_default(x: torch.Tensor, weight: torch.Tensor | None, epsilon: float,
                   variance_size: int | None) -> torch.Tensor: ...

    def unannotated(x, weight, epsilon, variance_size=None): ...

    for fn in (other_names, no_default):
        with pytest.raises(ValueError, match=r"Implementation for provider mine has schema .* "
                                             r"which does not match native schema .* for op "
                                             r"rms_norm\. Give it the same parameter names, types "
                                             r"and defaults"):
            op.register_impl("mine")(fn)
    with pytest.raises(ValueError, match=r"Implementation for provider mine of op rms_norm: its "
                                         r"schema cannot be inferred .*Annotate it exactly as the "
                                         r"native function: \(x: 'Tensor'"):
        op.register_impl("mine")(unannotated)
    with pytest.raises(ValueError, match=r"supports_args for provider mine must have the same "
                                         r"number of parameters \(2\) as the native "
                                         r"implementation \(4\) \(op rms_norm\)"):
        op.register_impl("mine", supports_args=lambda x, weight: True)(op.impls["vllm_c"].impl_fn)
    with pytest.raises(ValueError, match="inplace=True, but op rms_norm was not "
                                         "registered with allow_inplace"):
        op.register_impl("mine", inplace=True)(op.impls["vllm_c"].impl_fn)
    assert "mine" not in op.impls


def test_a_maybe_inplace_activation_read_after_the_call_is_refused():
    """VllmIRInplaceFunctionalizationPass, on a graph where x is read after the call."""
    from torch import fx

    from minivllm_compile.compilation.passes.ir import VllmIRInplaceFunctionalizationPass

    g = fx.Graph()
    x, r, w = (g.placeholder(n) for n in ("x", "r", "w"))
    call = g.call_function(ir.ops.fused_add_rms_norm.maybe_inplace.torch_op, (x, r, w, 1e-6))
    g.call_function(torch.ops.aten.add.Tensor, (x, 1))  # x read again: it was donated
    g.output(call)
    # vLLM's words (its tests match "is used again after the node"), then which op and activation
    with pytest.raises(ValueError, match=r"(?s)Input x to maybe_inplace node fused_add_rms_norm\w* "
                                         r"is used again after the node \(by \['add_tensor'\]\)"
                                         r"\. This is not allowed.*x is fused_add_rms_norm's "
                                         r"activation 'x'.*use the default overload "
                                         r"\(ir\.ops\.fused_add_rms_norm\(\.\.\.\)\) or clone"):
        VllmIRInplaceFunctionalizationPass()(g)


def test_ops_are_registered_once_with_names_as_vllm_checks_them(scratch_registry):
    @register_op
    def my_scale(x: torch.Tensor, factor: float) -> torch.Tensor:
        return x * factor

    assert my_scale.torch_op is getattr(torch.ops, scratch_registry.ns).my_scale.default
    assert torch.equal(my_scale(torch.ones(2), 3.0), torch.full((2,), 3.0))
    with pytest.raises(AssertionError, match="Op 'my_scale' is already registered"):
        register_op(my_scale.impls["native"].impl_fn)
    with pytest.raises(ValueError, match="Op name 'MyOp' is invalid"):
        register_op(name="MyOp")(lambda x: x)
    with pytest.raises(ValueError, match="keyword-only arguments"):
        @register_op
        def kw_only(x: torch.Tensor, *, k: float) -> torch.Tensor:
            return x
    with pytest.raises(ValueError, match="allow_inplace needs one Tensor output per activation"):
        @register_op(allow_inplace=True)
        def two_in_one_out(x: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
            return x + x2
    assert "MyOp" not in IrOp.registry and "kw_only" not in IrOp.registry


def test_a_provider_registered_later_is_not_in_a_priority_already_set(scratch_registry, caplog):
    @register_op
    def my_double(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    with my_double.set_priority(["native"]):
        @my_double.register_impl("fast")
        def fast(x: torch.Tensor) -> torch.Tensor:
            return x + x

        assert "registering provider fast for op my_double while a priority is set" in caplog.text
        assert my_double.dispatch(torch.ones(1)).provider == "native"
    with my_double.set_priority(["fast"]):
        assert my_double.dispatch(torch.ones(1)).provider == "fast"


def test_overlapping_model_scopes_of_two_threads_leave_the_process_settings_as_they_were():
    """Thread A enters a scope (wrap off, vllm_c), thread B another (wrap on, native); A closes
    first, then B. The newest open scope stays in force while it runs, and at the end the wrap and
    the priority are what they were before either opened (they used to end as A's had found them,
    that is B's)."""
    import threading

    from minivllm_compile import CompilationConfig, CompilationMode
    from minivllm_compile.config.kernel import IrOpPriorityConfig, KernelConfig, ir_dispatch_scope
    from minivllm_compile.ir import op as op_module

    def cc(priority, mode):
        return CompilationConfig(mode=mode, kernel_config=KernelConfig(
            IrOpPriorityConfig.with_default(priority)))

    a_cc = cc(["vllm_c", "native"], CompilationMode.NONE)  # the wrap resolves off
    b_cc = cc(["native"], CompilationMode.VLLM_COMPILE)  # on
    before = (op_module._ENABLE_TORCH_WRAP, list(ir.ops.rms_norm._priority_impls))
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def thread_a():
        with ir_dispatch_scope(a_cc):
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def thread_b():
        a_in.wait(10)
        with ir_dispatch_scope(b_cc):
            b_in.set()
            a_out.wait(10)
            seen["b_after_a_closed"] = (op_module._ENABLE_TORCH_WRAP,
                                        ir.ops.rms_norm.get_priority()[0])

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads)
    assert seen["b_after_a_closed"] == (True, "native")  # B's settings, still in force
    assert (op_module._ENABLE_TORCH_WRAP, list(ir.ops.rms_norm._priority_impls)) == before
