"""The `vllm_c` provider: the project's in-place custom ops, `torch.ops.minivllm.*`, standing in
for vLLM's C++ kernels (vLLM 0.33's vllm/kernels/vllm_c.py calls `torch.ops._C.*`).

vLLM registers these with supported=<a GPU platform>; the custom ops here run on the CPU too (their
plain-torch references) and on CUDA (their Triton kernels), so the provider is supported
everywhere. `fused_add_rms_norm` writes its outputs into its inputs: it is registered inplace=True,
so the functional op gives it copies (IrOpImpl.func_impl_fn) and only `maybe_inplace`, whose
caller donates the activations, lets it write into them.
"""

from __future__ import annotations

import torch
from torch import Tensor

import minivllm_compile.ops  # noqa: F401  (registers torch.ops.minivllm.*)
from minivllm_compile.ir import ops


def _no_var_size(x, weight, epsilon, variance_size=None) -> bool:
    # the kernel has no variance_size and takes a weight of the activation's dtype
    return variance_size is None and weight is not None and weight.dtype == x.dtype


def _add_no_var_size(x, x_residual, weight, epsilon, variance_size=None) -> bool:
    return variance_size is None and weight is not None and weight.dtype == x.dtype


@ops.rms_norm.register_impl("vllm_c", supports_args=_no_var_size)
def rms_norm(
    x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> Tensor:
    out = torch.empty(x.shape, device=x.device, dtype=x.dtype)  # contiguous, whatever x's strides
    torch.ops.minivllm.rms_norm(out, x, weight, epsilon)
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
    torch.ops.minivllm.fused_add_rms_norm(x, x_residual, weight, epsilon)
    return x, x_residual
