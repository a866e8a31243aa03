"""`rms_norm` and `fused_add_rms_norm` as IR ops (vLLM 0.34's vllm/ir/ops/layernorm.py).

The bodies are the `native` providers: plain torch, computed in float32 and cast back once, as
vLLM 0.34 writes them. Two details follow vLLM's native, not its CUDA kernel (nor this project's
custom ops, which copy the kernel): the normalised value is cast to the weight's dtype before the
multiply, and `fused_add_rms_norm` normalises the float32 sum, where the kernel normalises the sum
rounded to the activation dtype. In float32 the two agree; in bfloat16 they differ by rounding,
within the op's tolerance (tests/ir/test_ir_ops.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from minivllm_compile.ir.op import register_op


@register_op
def rms_norm(
    x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
) -> Tensor:
    """Weighted root-mean-square layer normalization."""
    orig_dtype = x.dtype
    x = x.to(torch.float32)
    # variance_size: the statistic over the first columns only (a model whose norm spans fewer
    # channels than the tensor holds); the kernels here lack it, and say so in supports_args
    x_var = x if variance_size is None else x[..., :variance_size]
    x = x * torch.rsqrt(x_var.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    if weight is not None:
        x = x.to(weight.dtype) * weight
    return x.to(orig_dtype)


@rms_norm.register_input_generator
def _rms_norm_inputs(
    num_tokens: int,
    hidden_size: int,
    dtype: torch.dtype,
    epsilon: float = 1e-5,
    device: torch.device | str | None = None,
) -> tuple:
    x = torch.randn(num_tokens, hidden_size, dtype=dtype, device=device)
    weight = torch.randn(hidden_size, dtype=dtype, device=device)
    return x, weight, epsilon


# a long float16 reduction rounds more than the default bound allows (vLLM widens it the same)
rms_norm.override_tolerance(torch.float16, atol=1e-2, rtol=2e-3)


@register_op(allow_inplace=True)
def fused_add_rms_norm(
    x: Tensor,
    x_residual: Tensor,
    weight: Tensor | None,
    epsilon: float,
    variance_size: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Residual add, then weighted RMS normalization: returns (normed, x + x_residual)."""
    orig_dtype = x.dtype
    x = x.to(torch.float32) + x_residual.to(torch.float32)
    x_residual = x.to(orig_dtype)
    x_var = x if variance_size is None else x[..., :variance_size]
    x = x * torch.rsqrt(x_var.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    if weight is not None:
        x = x.to(weight.dtype) * weight
    return x.to(orig_dtype), x_residual


@fused_add_rms_norm.register_input_generator
def _fused_add_rms_norm_inputs(
    num_tokens: int,
    hidden_size: int,
    dtype: torch.dtype,
    epsilon: float = 1e-5,
    device: torch.device | str | None = None,
) -> tuple:
    x = torch.randn(num_tokens, hidden_size, dtype=dtype, device=device)
    x_residual = torch.randn(num_tokens, hidden_size, dtype=dtype, device=device)
    weight = torch.randn(hidden_size, dtype=dtype, device=device)
    return x, x_residual, weight, epsilon


fused_add_rms_norm.override_tolerance(torch.float16, atol=1e-2, rtol=2e-3)
