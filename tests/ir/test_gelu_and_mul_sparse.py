"""`gelu_and_mul_sparse`, vLLM 0.34's third IR op, and its `triton` provider (the only op whose
`triton` provider vLLM ships), after vLLM's tests/kernels/ir/test_activation.py: the providers
agree within the op's tolerances (vLLM's defaults), supports_args sends what the kernel lacks to
native, and the priority picks the provider in eager dispatch and in the lowering. On the CPU the
kernel runs in Triton's interpreter (conftest)."""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import minivllm_compile.ir.kernels  # noqa: F401  (the providers)
from minivllm_compile import ir
from minivllm_compile.config.kernel import IrOpPriorityConfig, KernelConfig
from minivllm_compile.ir.kernels.triton_ops import TRITON_RUNS
from minivllm_compile.ir.tolerances import DEFAULT_TOLERANCES
from minivllm_compile.kernels.activation import gelu_and_mul_sparse_ref

op = ir.ops.gelu_and_mul_sparse
native = op.impls["native"].impl_fn
STD = 1.6448536269514722  # the normal 0.95 quantile: vLLM's default in the input generator
DTYPES = [torch.float16, torch.bfloat16, torch.float32]

needs_triton = pytest.mark.skipif(not TRITON_RUNS, reason="no GPU and no Triton interpreter")


def _inputs(num_tokens, hidden_size, dtype, device, seed=0):
    torch.manual_seed(seed)
    x, std_multiplier, approximate = op.generate_inputs(
        num_tokens=num_tokens, hidden_size=hidden_size, dtype=dtype)
    return x.to(device), std_multiplier, approximate


def _assert_close(actual, expected):
    """With the op's tolerance, as vLLM's tests/ir/ir_test_utils.assert_close."""
    torch.testing.assert_close(actual, expected, **op.get_tolerance(actual.dtype))


def test_registration_as_vllm_declares_it():
    assert {p: impl.supported for p, impl in op.impls.items()} == {
        "native": True, "triton": TRITON_RUNS}
    assert str(op.torch_op._schema) == ("minivllm_ir::gelu_and_mul_sparse(Tensor x, float "
                                        "std_multiplier, str approximate=\"none\") -> Tensor")
    assert op.activations == ["x"] and not op.allow_inplace
    assert op.has_input_generator
    x, std_multiplier, approximate = op.generate_inputs(num_tokens=3, hidden_size=8,
                                                        dtype=torch.float16)
    assert x.shape == (3, 16) and (std_multiplier, approximate) == (STD, "tanh")
    for dtype in DTYPES:  # vLLM registers no tolerance of its own for this op
        assert op.get_tolerance(dtype) == DEFAULT_TOLERANCES[dtype]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens, intermediate_size",
                         [(1, 2048), (8, 4096), (3, 13824), (1, 32768)])
def test_triton_matches_native(dtype, num_tokens, intermediate_size, kernel_device):
    args = _inputs(num_tokens, intermediate_size, dtype, kernel_device)
    impl = op.impls["triton"]
    assert impl.supports_args(*args)
    expected = native(*args)
    actual = impl.impl_fn(*args)
    _assert_close(actual, expected)
    # which entries the sparsification kept: the same, but for a rare tie at the cut-off
    assert torch.count_nonzero((actual == 0) != (expected == 0)) / actual.numel() < 1e-3
    # and the kernel's plain-torch reference is the native body (tanh), to the bit
    ref = torch.empty_like(expected)
    gelu_and_mul_sparse_ref(ref, args[0], args[1])
    assert torch.equal(ref, expected)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("intermediate_size", [1, 31, 128])
def test_triton_small_sizes_keep_the_same_entries(dtype, intermediate_size, kernel_device):
    args = _inputs(5, intermediate_size, dtype, kernel_device)
    actual, expected = op.impls["triton"].impl_fn(*args), native(*args)
    _assert_close(actual, expected)
    assert torch.equal(actual == 0, expected == 0)


@needs_triton
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's
def test_triton_nd_empty_constant_and_nonfinite_rows(kernel_device):
    impl = op.impls["triton"]
    x = torch.randn(2, 3, 4096, dtype=torch.bfloat16, device=kernel_device)
    actual = impl.impl_fn(x, STD, "tanh")
    assert actual.shape == (2, 3, 2048)
    _assert_close(actual, native(x, STD, "tanh"))
    empty = impl.impl_fn(torch.empty(0, 4096, dtype=torch.bfloat16, device=kernel_device), STD,
                         "tanh")
    assert empty.shape == (0, 2048) and empty.dtype == torch.bfloat16
    for dtype in DTYPES:  # a constant gate has no entry above its mean: all zero, as native
        gate = torch.full((4, 1024), 3.0, dtype=dtype, device=kernel_device)
        x = torch.cat((gate, torch.randn_like(gate)), dim=-1)
        actual = impl.impl_fn(x, STD, "tanh")
        torch.testing.assert_close(actual, native(x, STD, "tanh"), rtol=0.0, atol=0.0)
        assert torch.count_nonzero(actual) == 0
    for nonfinite in (float("nan"), float("inf")):
        x = torch.randn(2, 4096, dtype=torch.bfloat16, device=kernel_device)
        x[0, 0] = nonfinite
        torch.testing.assert_close(impl.impl_fn(x, STD, "tanh"), native(x, STD, "tanh"),
                                   equal_nan=True)


@needs_triton
def test_supports_args_sends_what_the_kernel_lacks_to_native(kernel_device, monkeypatch):
    impl = op.impls["triton"]
    x = torch.randn(4, 4096, dtype=torch.bfloat16, device=kernel_device)
    assert impl.supports_args(x, 1.0, "tanh")
    assert not impl.supports_args(x, 1.0, "none")  # the kernel is GELU's tanh approximation
    assert not impl.supports_args(x, 1.0)  # "none" by default, as native's
    assert not impl.supports_args(x[:, ::2], 1.0, "tanh")  # not contiguous
    assert not impl.supports_args(x[:, :-1], 1.0, "tanh")  # an odd last dimension
    assert not impl.supports_args(x.double(), 1.0, "tanh")
    # a row wider than one program's block
    assert not impl.supports_args(torch.randn(1, 65538, dtype=torch.bfloat16,
                                              device=kernel_device), 1.0, "tanh")
    with op.set_priority(["triton", "native"]):
        assert op.dispatch(x, 1.0, "tanh") is impl
        assert op.dispatch(x, 1.0, "none") is op.impls["native"]
        torch.testing.assert_close(op(x, 1.0, "none"), native(x, 1.0, "none"), rtol=0, atol=0)
    if kernel_device == "cpu":  # a CPU tensor without the interpreter is not launchable
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        assert not impl.supports_args(x, 1.0, "tanh")


@needs_triton
def test_dispatch_matches_the_direct_call_and_opcheck_passes(kernel_device):
    args = _inputs(8, 1024, torch.bfloat16, kernel_device)
    impl = op.impls["triton"]
    with op.set_priority(["triton", "native"]):
        dispatched = op(*args)  # through torch.ops.minivllm_ir.gelu_and_mul_sparse
        torch.library.opcheck(op.torch_op, args)
        with ir.enable_torch_wrap(False):
            unwrapped = op(*args)
    direct = impl.impl_fn(*args)
    torch.testing.assert_close(dispatched, direct, rtol=0.0, atol=0.0)
    torch.testing.assert_close(unwrapped, direct, rtol=0.0, atol=0.0)
    torch.library.opcheck(torch.ops.minivllm_triton.gelu_and_mul_sparse, args[:2])


@needs_triton
def test_the_priority_config_picks_the_provider():
    from minivllm_compile import CompilationConfig, CompilationMode

    user = KernelConfig(IrOpPriorityConfig(gelu_and_mul_sparse=["triton"]))
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, kernel_config=user)
    assert cc.kernel_config.ir_op_priority.gelu_and_mul_sparse == ["triton", "native"]
    args = _inputs(2, 64, torch.float32, "cpu")
    with cc.kernel_config.ir_op_priority.set_priority():
        assert op.get_priority() == ["triton", "native"] and op.dispatch(*args).provider == "triton"
        assert ir.ops.rms_norm.get_priority() == ["native"]
    assert op.get_priority() == []
    # the norms' custom ops for every op: gelu_and_mul_sparse has none, so native
    both = IrOpPriorityConfig.with_default(["vllm_c", "native"])
    assert (both.rms_norm, both.gelu_and_mul_sparse) == (["vllm_c", "native"], ["native"])
    assert IrOpPriorityConfig.with_default(["triton", "native"]).gelu_and_mul_sparse == [
        "triton", "native"]
    with pytest.raises(ValueError, match="op gelu_and_mul_sparse names 'vllm_c', which is not a "
                                         "provider of it"):
        CompilationConfig(kernel_config=KernelConfig(
            IrOpPriorityConfig(gelu_and_mul_sparse=["vllm_c"])))
    with pytest.raises(ValueError, match="names 'tritn', which is not a provider"):  # a typo
        CompilationConfig(kernel_config=KernelConfig(IrOpPriorityConfig.with_default(["tritn"])))


@needs_triton
@pytest.mark.parametrize("provider, approximate, want", [
    ("triton", "tanh", "triton"),
    ("triton", "none", "native"),  # supports_args sends it on
    ("native", "tanh", "native"),
])
def test_the_lowering_replaces_the_node_by_the_chosen_provider(provider, approximate, want):
    from minivllm_compile.compilation.passes.ir import VllmIRLoweringPass

    x = _inputs(4, 96, torch.float32, "cpu")[0]

    def fn(x):
        return ir.ops.gelu_and_mul_sparse(x * 2, STD, approximate) + 1

    gm = make_fx(fn, tracing_mode="fake")(x)
    assert any(n.target is op.torch_op for n in gm.graph.nodes)
    lowering = VllmIRLoweringPass(ir_op_priority=IrOpPriorityConfig.with_default(
        ["native"], gelu_and_mul_sparse=[provider, "native"]))
    lowering(gm.graph)
    gm.recompile()
    assert lowering.summary() == f"gelu_and_mul_sparse={want}" and not lowering.unlowered
    targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
    # the kernel's op, one opaque call; or native's body, in aten ops Inductor can fuse
    assert ("minivllm_triton.gelu_and_mul_sparse.default" in targets) == (want == "triton")
    assert ("aten.relu.default" in targets) == (want == "native"), targets
    _assert_close(gm(x), fn(x))
