"""SiLU-and-multiply (the gated MLP activation): a plain-torch reference and a Triton kernel.

``out = silu(x[..., :d]) * x[..., d:]``. As in vLLM's CUDA kernel (csrc/activation_kernels.cu),
silu is computed in fp32 and rounded to the tensor dtype, and the product with the gate's other
half is rounded again; ``F.silu(a) * b`` in the tensor dtype rounds at the same two places.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from minivllm_compile.kernels._compat import require_triton, tl, triton
from minivllm_compile.kernels.utils import as_rows, cast_to, check_launchable, needs_bf16_rtne


def silu_and_mul_ref(out: torch.Tensor, input: torch.Tensor) -> None:
    d = input.shape[-1] // 2
    out.copy_(F.silu(input[..., :d]) * input[..., d:])


@triton.jit
def _silu_and_mul_kernel(
    out_ptr, in_ptr, out_stride, in_stride, d, BLOCK: tl.constexpr, BF16_RTNE: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x = tl.load(in_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(in_ptr + row * in_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = cast_to(x / (1.0 + tl.exp(-x)), dtype, BF16_RTNE).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, cast_to(act * y, dtype, BF16_RTNE), mask=mask)


def silu_and_mul_triton(out: torch.Tensor, input: torch.Tensor) -> None:
    require_triton("silu_and_mul_triton")
    if input.dim() == 0 or input.shape[-1] % 2:
        raise ValueError(f"input last dimension must be even (2*d), got shape {tuple(input.shape)}")
    expected = (*input.shape[:-1], input.shape[-1] // 2)
    if out.shape != expected:
        raise ValueError(f"out shape {tuple(out.shape)} != {expected} (input {tuple(input.shape)})")
    if out.dtype != input.dtype:
        raise ValueError(f"out dtype {out.dtype} != input dtype {input.dtype}")
    if out.device != input.device:
        raise ValueError(f"out is on {out.device}, input on {input.device}")
    check_launchable("input", input)
    out2, in2 = as_rows("out", out), as_rows("input", input)
    if out2.numel() == 0:
        return
    d = out2.shape[1]
    block = min(triton.next_power_of_2(d), 1024)  # a 2-D grid covers wider rows
    grid = (out2.shape[0], triton.cdiv(d, block))
    _silu_and_mul_kernel[grid](
        out2, in2, out2.stride(0), in2.stride(0), d,
        BLOCK=block, BF16_RTNE=needs_bf16_rtne(out), num_warps=4,
    )  # fmt: skip
