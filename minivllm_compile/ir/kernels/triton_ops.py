"""The `triton` provider: Triton kernels behind ops of their own, `torch.ops.minivllm_triton.*`
(vLLM 0.34's vllm/kernels/triton/).

`gelu_and_mul_sparse`'s is vLLM's: vLLM 0.34 ships a `triton` provider for that op only, its
kernel (vllm/kernels/triton/activation.py) is kernels/activation.py's, and its `supports_args` is
vLLM's (on a CUDA tensor or, here, one the interpreter runs). The norms' `triton` provider is this
project's own (vLLM has none; its norms' providers are `vllm_c`, `aiter`, `oink`): the kernels of
kernels/layernorm.py. `rms_norm` is functional (it allocates its output); `fused_add_rms_norm`
writes into its inputs, as the kernel does, and is registered inplace=True like vllm_c's. They
take a `weight` of None, as vLLM's norm providers do, by passing the kernels a weight of ones.

Supported where Triton runs for real: on a GPU, or on the CPU under Triton's interpreter
(TRITON_INTERPRET=1, which the tests set; it is far too slow for anything else). On a CPU without
it, asking for `triton` in a priority is refused with an error naming the provider.

vLLM's triton provider is a `torch.library.triton_op`, which Inductor can see into and launch
itself. Here each kernel sits behind an opaque custom op, which Inductor calls as an extern kernel:
`wrap_triton`, which a triton_op needs, cannot trace an interpreted kernel, and one form serves
both the GPU and the interpreted tests.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import Library

from minivllm_compile.ir import ops
from minivllm_compile.kernels import activation, layernorm
from minivllm_compile.kernels._compat import HAS_TRITON, triton_interpret_enabled
from minivllm_compile.ops import direct_register_custom_op

minivllm_triton_lib = Library("minivllm_triton", "FRAGMENT")

# a platform check, made once at import (vLLM's supported= is one too)
TRITON_RUNS = HAS_TRITON and (torch.cuda.is_available() or triton_interpret_enabled())


def _triton_rms_norm(x: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    layernorm.rms_norm_triton(out, x, weight, epsilon)
    return out


def _triton_rms_norm_fake(x: Tensor, weight: Tensor, epsilon: float) -> Tensor:
    return torch.empty(x.shape, device=x.device, dtype=x.dtype)


def _triton_fused_add_rms_norm(
    x: Tensor, x_residual: Tensor, weight: Tensor, epsilon: float
) -> None:
    layernorm.fused_add_rms_norm_triton(x, x_residual, weight, epsilon)


def _returns_nothing(*args, **kwargs) -> None:
    return None


def _triton_gelu_and_mul_sparse(x: Tensor, std_multiplier: float) -> Tensor:
    out = torch.empty((*x.shape[:-1], x.shape[-1] // 2), device=x.device, dtype=x.dtype)
    activation.gelu_and_mul_sparse_triton(out, x, std_multiplier)
    return out


def _triton_gelu_and_mul_sparse_fake(x: Tensor, std_multiplier: float) -> Tensor:
    return torch.empty((*x.shape[:-1], x.shape[-1] // 2), device=x.device, dtype=x.dtype)


direct_register_custom_op(
    "rms_norm", _triton_rms_norm, fake_impl=_triton_rms_norm_fake, target_lib=minivllm_triton_lib
)
direct_register_custom_op(
    "fused_add_rms_norm",
    _triton_fused_add_rms_norm,
    mutates_args=["x", "x_residual"],
    fake_impl=_returns_nothing,
    target_lib=minivllm_triton_lib,
)
direct_register_custom_op(
    "gelu_and_mul_sparse",
    _triton_gelu_and_mul_sparse,
    fake_impl=_triton_gelu_and_mul_sparse_fake,
    target_lib=minivllm_triton_lib,
)


def _launchable(x: Tensor) -> bool:
    return x.is_cuda or (x.device.type == "cpu" and triton_interpret_enabled())


def _ones_if_none(weight: Tensor | None, x: Tensor) -> Tensor:
    return torch.ones(x.shape[-1], device=x.device, dtype=x.dtype) if weight is None else weight


def _rms_args(x, weight, epsilon, variance_size=None) -> bool:
    # no variance_size in the kernel; one dtype; rows with a contiguous last dimension
    return (
        variance_size is None
        and (weight is None or weight.dtype == x.dtype)
        and x.dim() > 0
        and x.stride(-1) == 1
        and _launchable(x)
    )


def _add_rms_args(x, x_residual, weight, epsilon, variance_size=None) -> bool:
    # the kernel writes both tensors as [rows, hidden]: each must be viewable so
    return (
        variance_size is None
        and (weight is None or weight.dtype == x.dtype)
        and x.is_contiguous()
        and x_residual.is_contiguous()
        and _launchable(x)
    )


@ops.rms_norm.register_impl("triton", supported=TRITON_RUNS, supports_args=_rms_args)
def rms_norm(
    x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> Tensor:
    return torch.ops.minivllm_triton.rms_norm(x, _ones_if_none(weight, x), epsilon)


@ops.fused_add_rms_norm.register_impl(
    "triton", supported=TRITON_RUNS, supports_args=_add_rms_args, inplace=True
)
def fused_add_rms_norm(
    x: Tensor,
    x_residual: Tensor,
    weight: Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    torch.ops.minivllm_triton.fused_add_rms_norm(x, x_residual, _ones_if_none(weight, x), epsilon)
    return x, x_residual


_GELU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _supports_gelu_and_mul_sparse(x, std_multiplier, approximate="none") -> bool:
    # vLLM's checks: the tanh approximation only (the kernel's), a contiguous x of a float dtype,
    # an even last dimension whose half fits one program's block
    if (
        not _launchable(x)
        or x.dtype not in _GELU_DTYPES
        or not x.is_contiguous()
        or x.ndim == 0
        or approximate != "tanh"
    ):
        return False
    d2 = x.shape[-1]
    return d2 > 0 and d2 % 2 == 0 and d2 // 2 <= activation.GELU_AND_MUL_SPARSE_MAX_D


@ops.gelu_and_mul_sparse.register_impl(
    "triton", supported=TRITON_RUNS, supports_args=_supports_gelu_and_mul_sparse
)
def gelu_and_mul_sparse(x: Tensor, std_multiplier: float, approximate: str = "none") -> Tensor:
    assert approximate == "tanh", approximate  # supports_args sends the rest elsewhere
    return torch.ops.minivllm_triton.gelu_and_mul_sparse(x, std_multiplier)
