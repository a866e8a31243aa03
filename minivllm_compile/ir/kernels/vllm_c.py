"""The `vllm_c` provider: the project's in-place custom ops, `torch.ops.minivllm.*`, standing in
for vLLM's C++ kernels (vLLM 0.34's vllm/kernels/vllm_c.py calls `torch.ops._C.*`).

vLLM registers these with supported=<a GPU platform>; the custom ops here run on the CPU too (their
plain-torch references) and on CUDA (their Triton kernels), so the provider is supported
everywhere. `fused_add_rms_norm` writes its outputs into its inputs: it is registered inplace=True,
so the functional op gives it copies (IrOpImpl.func_impl_fn) and only `maybe_inplace`, whose
caller donates the activations, lets it write into them.

A `weight` of None is accepted, as vLLM's vllm_c accepts it (its `_C` kernels take `Tensor?
weight`); the custom ops here take a tensor, so the provider passes a weight of ones (what vLLM's
vllm_c did before its kernels took None). No provider for `gelu_and_mul_sparse`: vLLM has none.
"""

from __future__ import annotations

import torch
from torch import Tensor

import minivllm_compile.ops  # noqa: F401  (registers torch.ops.minivllm.*)
from minivllm_compile.ir import ops


def _no_var_size(x, weight, epsilon, variance_size=None) -> bool:
    # the kernel has no variance_size and takes a weight of the activation's dtype (vLLM's check)
    return variance_size is None and (weight is None or weight.dtype == x.dtype)


def _add_no_var_size(x, x_residual, weight, epsilon, variance_size=None) -> bool:
    return variance_size is None and (weight is None or weight.dtype == x.dtype)


def _ones_if_none(weight: Tensor | None, x: Tensor) -> Tensor:
    return torch.ones(x.shape[-1], device=x.device, dtype=x.dtype) if weight is None else weight


@ops.rms_norm.register_impl("vllm_c", supports_args=_no_var_size)
def rms_norm(
    x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> Tensor:
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)  # contiguous, whatever x's strides
    torch.ops.minivllm.rms_norm(out, x, _ones_if_none(weight, x), epsilon)
    return out


@ops.fused_add_rms_norm.register_impl("vllm_c", supports_args=_add_no_var_size, inplace=True)
def fused_add_rms_norm(
    x: Tensor,
    x_residual: Tensor,
    weight: Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    # x_residual <- x + x_residual; x <- norm(x_residual) * weight
    torch.ops.minivllm.fused_add_rms_norm(x, x_residual, _ones_if_none(weight, x), epsilon)
    return x, x_residual
