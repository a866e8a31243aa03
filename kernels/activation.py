"""The gated MLP activations: plain-torch references and Triton kernels.

``silu_and_mul``: ``out = silu(x[..., :d]) * x[..., d:]``. As in vLLM's CUDA kernel
(csrc/activation_kernels.cu), silu is computed in fp32 and rounded to the tensor dtype, and the
product with the gate's other half is rounded again; ``F.silu(a) * b`` in the tensor dtype rounds at
the same two places.

``gelu_and_mul_sparse`` (Gemma 3n's): each row's gate minus (its mean + ``std_multiplier`` times
its standard deviation), clipped at zero, through GELU's tanh approximation, times the up half. The
kernel is vLLM 0.34's (vllm/kernels/triton/activation.py, behind the IR op's ``triton`` provider),
with the row strides and the bf16 rounding of this package's kernels: it works in fp32 and rounds
to the tensor dtype wherever the reference (the IR op's native body) rounds, after each torch op.
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


# --- gelu_and_mul_sparse ------------------------------------------------------------------------

GELU_AND_MUL_SPARSE_MAX_D = 32768  # one program holds a whole row (vLLM's _MAX_INTERMEDIATE_SIZE)


def gelu_and_mul_sparse_ref(out: torch.Tensor, input: torch.Tensor, std_multiplier: float) -> None:
    d = input.shape[-1] // 2
    gate = input[..., :d]
    mean = gate.mean(dim=-1, keepdim=True)
    std = gate.std(dim=-1, keepdim=True, unbiased=False)
    sparse_gate = F.relu(gate - (mean + std * std_multiplier))
    out.copy_(F.gelu(sparse_gate, approximate="tanh") * input[..., d:])


@triton.jit
def _gelu_and_mul_sparse_kernel(
    out_ptr, in_ptr, out_stride, in_stride, d, std_multiplier,
    BLOCK: tl.constexpr, BF16_RTNE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(in_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + row * in_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    mean = tl.sum(gate, axis=0) / d
    centered = tl.where(mask, gate - mean, 0.0)
    variance = tl.sum(centered * centered, axis=0) / d
    # rounded to the dtype where each torch op of the reference rounds its result
    mean = cast_to(mean, dtype, BF16_RTNE).to(tl.float32)
    std = cast_to(tl.sqrt(variance), dtype, BF16_RTNE).to(tl.float32)
    scaled_std = cast_to(std * std_multiplier, dtype, BF16_RTNE).to(tl.float32)
    cutoff = cast_to(mean + scaled_std, dtype, BF16_RTNE).to(tl.float32)
    sparse_gate = cast_to(gate - cutoff, dtype, BF16_RTNE).to(tl.float32)
    sparse_gate = tl.where(sparse_gate < 0.0, 0.0, sparse_gate)  # relu (a NaN stays NaN)
    # GELU, tanh approximation: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))
    inner = 0.7978845608028654 * (sparse_gate + 0.044715 * sparse_gate * sparse_gate * sparse_gate)
    tanh = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
    activated = cast_to(0.5 * sparse_gate * (1.0 + tanh), dtype, BF16_RTNE).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, cast_to(activated * up, dtype, BF16_RTNE),
             mask=mask)


def gelu_and_mul_sparse_triton(out: torch.Tensor, input: torch.Tensor,
                               std_multiplier: float) -> None:
    require_triton("gelu_and_mul_sparse_triton")
    if input.dim() == 0 or input.shape[-1] % 2:
        raise ValueError(f"input last dimension must be even (2*d), got shape {tuple(input.shape)}")
    expected = (*input.shape[:-1], input.shape[-1] // 2)
    if out.shape != expected:
        raise ValueError(f"out shape {tuple(out.shape)} != {expected} (input {tuple(input.shape)})")
    if out.dtype != input.dtype:
        raise ValueError(f"out dtype {out.dtype} != input dtype {input.dtype}")
    if out.device != input.device:
        raise ValueError(f"out is on {out.device}, input on {input.device}")
    d = expected[-1]
    if d > GELU_AND_MUL_SPARSE_MAX_D:
        raise ValueError(f"d = {d} > {GELU_AND_MUL_SPARSE_MAX_D}: one program holds a row, "
                         "and a row this wide does not fit; call gelu_and_mul_sparse_ref")
    check_launchable("input", input)
    out2, in2 = as_rows("out", out), as_rows("input", input)
    if out2.numel() == 0:
        return
    block = triton.next_power_of_2(d)
    _gelu_and_mul_sparse_kernel[(out2.shape[0],)](
        out2, in2, out2.stride(0), in2.stride(0), d, float(std_multiplier),
        BLOCK=block, BF16_RTNE=needs_bf16_rtne(out), num_warps=min(max(block // 256, 1), 8),
    )  # fmt: skip
