"""RMSNorm and fused residual-add + RMSNorm: plain-torch references and Triton kernels.

Semantics follow vLLM's CUDA kernels (csrc/layernorm_kernels.cu), not its ``forward_native``:
the sum of squares and ``x * rsqrt(var + eps)`` are fp32, the normalised value is rounded to the
tensor dtype *before* it is multiplied by the weight, and that product is rounded again. For
``fused_add_rms_norm`` the residual sum is rounded to the tensor dtype, stored, and that rounded
sum is what gets normalised. The references and the kernels round at the same places, so they
agree to the last bit up to the order of the fp32 reduction.
"""

from __future__ import annotations

import torch

from minivllm_compile.kernels._compat import require_triton, tl, triton
from minivllm_compile.kernels.utils import as_rows, cast_to, check_launchable, needs_bf16_rtne


def rms_norm_ref(out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    x = input.float()
    normed = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(input.dtype)
    out.copy_(normed * weight)  # the multiply happens in the input dtype, as in vLLM's kernel


def fused_add_rms_norm_ref(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    residual.add_(input)  # rounded to the dtype here: the stored residual is what gets normalised
    rms_norm_ref(input, residual, weight, eps)


# --- kernels --------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    out_ptr, in_ptr, w_ptr, out_stride, in_stride, hidden, eps,
    BLOCK: tl.constexpr, BF16_RTNE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # int64: rows * stride can pass 2**31
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(in_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    dtype = out_ptr.dtype.element_ty
    normed = cast_to(x * inv_rms, dtype, BF16_RTNE).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, cast_to(normed * w, dtype, BF16_RTNE), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    in_ptr, res_ptr, w_ptr, in_stride, res_stride, hidden, eps,
    BLOCK: tl.constexpr, BF16_RTNE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = in_ptr.dtype.element_ty
    x = tl.load(in_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
    z = cast_to(x + r, dtype, BF16_RTNE)
    tl.store(res_ptr + row * res_stride + cols, z, mask=mask)
    z = z.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(z * z, axis=0) / hidden + eps)
    normed = cast_to(z * inv_rms, dtype, BF16_RTNE).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(in_ptr + row * in_stride + cols, cast_to(normed * w, dtype, BF16_RTNE), mask=mask)


def _check_norm_args(
    input: torch.Tensor, weight: torch.Tensor, other_name: str, other: torch.Tensor
) -> None:
    hidden = input.shape[-1] if input.dim() else 0
    if other.shape != input.shape:
        raise ValueError(f"{other_name} shape {tuple(other.shape)} != input {tuple(input.shape)}")
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != (hidden={hidden},)")
    for name, t in ((other_name, other), ("weight", weight)):
        if t.dtype != input.dtype:
            raise ValueError(f"{name} dtype {t.dtype} != input dtype {input.dtype}")
        if t.device != input.device:
            raise ValueError(f"{name} is on {t.device}, input on {input.device}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    check_launchable("input", input)


def _num_warps(block: int) -> int:
    return min(max(block // 512, 1), 16)  # ~16 fp32 values per thread keeps registers in check


def rms_norm_triton(
    out: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    require_triton("rms_norm_triton")
    _check_norm_args(input, weight, "out", out)
    out2 = as_rows("out", out)
    try:
        in2 = as_rows("input", input)
    except ValueError:
        # `input` is only read, so packed rows of a copy serve as well: a per-head view
        # [tokens, heads, head_dim] of the q (or k) slice of qkv has tokens further apart than
        # heads * head_dim, so it has no 2-D view (vLLM's kernel walks the strides instead)
        in2 = input.reshape(-1, input.shape[-1])
    if in2.numel() == 0:
        return
    block = triton.next_power_of_2(in2.shape[1])
    _rms_norm_kernel[(in2.shape[0],)](
        out2, in2, weight, out2.stride(0), in2.stride(0), in2.shape[1], eps,
        BLOCK=block, BF16_RTNE=needs_bf16_rtne(out), num_warps=_num_warps(block),
    )  # fmt: skip


def fused_add_rms_norm_triton(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> None:
    require_triton("fused_add_rms_norm_triton")
    _check_norm_args(input, weight, "residual", residual)
    in2, res2 = as_rows("input", input), as_rows("residual", residual)
    if in2.numel() == 0:
        return
    block = triton.next_power_of_2(in2.shape[1])
    _fused_add_rms_norm_kernel[(in2.shape[0],)](
        in2, res2, weight, in2.stride(0), res2.stride(0), in2.shape[1], eps,
        BLOCK=block, BF16_RTNE=needs_bf16_rtne(input), num_warps=_num_warps(block),
    )  # fmt: skip
