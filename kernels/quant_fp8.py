"""Static per-tensor FP8 (e4m3fn) quantization, alone and fused after RMSNorm or SiLU-and-mul:
plain-torch references and Triton kernels.

The quantization is vLLM's (QuantFP8.forward_native and csrc/quantization/fp8): in fp32,
``q = clamp(x * (1 / scale), -448, 448)`` rounded to nearest-even e4m3fn, where ``scale`` is one
fp32 number and 448 is e4m3fn's largest finite value. vLLM multiplies by the reciprocal rather
than dividing (one division per tensor, not per element); ``x / scale`` can differ from it in the
last fp32 bit, which moves a value sitting on an fp8 rounding tie to the other side, so we
multiply as vLLM does.

The fused ops compute exactly what their unfused sequence computes: the norm (or activation)
output is rounded to the tensor dtype first, as the unfused op stores it, and that rounded value
is quantized. The references *are* the unfused sequences, so they match them bit for bit; the
Triton kernels round at the same places and differ from the references only where the fp32 math
before the quantization does (the order of the RMSNorm reduction, ``exp`` in silu): an fp32 ulp
there moves the fp8 result by one step when the value sits on an fp8 rounding tie (rarely).
"""

from __future__ import annotations

import torch

from minivllm_compile.kernels._compat import require_triton, tl, triton, triton_interpret_enabled
from minivllm_compile.kernels.activation import silu_and_mul_ref
from minivllm_compile.kernels.layernorm import rms_norm_ref
from minivllm_compile.kernels.utils import as_rows, cast_to, check_launchable, needs_bf16_rtne

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448.0


# --- references -----------------------------------------------------------------------------


def static_scaled_fp8_quant_native(input: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Out of place, plain torch: the form a compiled graph holds when the custom op is off
    (vLLM's QuantFP8.forward_native), and what the fusion passes match in that case."""
    x = input.to(torch.float32) * scale.to(torch.float32).reciprocal()
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def static_scaled_fp8_quant_ref(result: torch.Tensor, input: torch.Tensor,
                                scale: torch.Tensor) -> None:
    result.copy_(static_scaled_fp8_quant_native(input, scale))


def rms_norm_static_fp8_quant_ref(
    result: torch.Tensor, input: torch.Tensor, weight: torch.Tensor,
    scale: torch.Tensor, epsilon: float
) -> None:
    normed = torch.empty_like(input)  # rounded to the input dtype, as rms_norm stores it
    rms_norm_ref(normed, input, weight, epsilon)
    static_scaled_fp8_quant_ref(result, normed, scale)


def fused_add_rms_norm_static_fp8_quant_ref(
    result: torch.Tensor, input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
    scale: torch.Tensor, epsilon: float,
) -> None:
    # vLLM's semantics: residual <- input + residual (rounded to the dtype, stored), result <-
    # quant(rms_norm(residual)). Unlike fused_add_rms_norm, `input` is left as it was.
    residual.add_(input)
    rms_norm_static_fp8_quant_ref(result, residual, weight, scale, epsilon)


def silu_and_mul_quant_ref(result: torch.Tensor, input: torch.Tensor, scale: torch.Tensor) -> None:
    act = torch.empty(result.shape, dtype=input.dtype, device=input.device)
    silu_and_mul_ref(act, input)
    static_scaled_fp8_quant_ref(result, act, scale)


# --- Triton ---------------------------------------------------------------------------------


@triton.jit
def quant_to_fp8(x, inv_scale, FP8_BY_HAND: tl.constexpr):
    """fp32 -> e4m3fn code of clamp(x * inv_scale, -448, 448), rounded to nearest even.

    A GPU converts with one instruction (cvt.rn.satfinite). Triton's interpreter (3.7) rounds
    fp32 -> fp8 wrongly (31.48 became 16), so there we build the byte by hand and the caller
    stores it into the fp8 tensor viewed as uint8."""
    y = tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0)
    if FP8_BY_HAND:
        bits = y.to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        # normal range (|y| >= 2**-6): keep 3 of fp32's 23 mantissa bits, round half to even,
        # and rebias the exponent from 127 to 7 (a carry out of the mantissa bumps the exponent)
        normal = ((mag + 0x7FFFF + ((mag >> 20) & 1)) >> 20) - (120 << 3)
        # subnormal range: |y| / 2**-9 rounded to an integer 0..8, half to even (adding and
        # subtracting 2**23 rounds an fp32 below 2**23 to an integer in the current mode, RNE)
        a = tl.abs(y) * 512.0
        sub = ((a + 8388608.0) - 8388608.0).to(tl.uint32)
        code = tl.where(mag < 0x3C800000, sub, normal)  # 0x3C800000 is 2**-6
        code = tl.where(mag > 0x7F800000, 0x7F, code | sign)  # NaN stays NaN (0x7F)
        out = code.to(tl.uint8)
    else:
        out = y.to(tl.float8e4nv)
    return out


def _fp8_by_hand() -> bool:
    return triton_interpret_enabled()


def _fp8_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    rows = as_rows(name, t)
    return rows.view(torch.uint8) if _fp8_by_hand() else rows  # see quant_to_fp8


@triton.jit
def _inv_scale(scale_ptr):
    # correctly rounded 1/scale, as torch's reciprocal (a plain `/` is approximate on a GPU)
    return tl.math.div_rn(1.0, tl.load(scale_ptr).to(tl.float32))


@triton.jit
def _static_quant_kernel(
    out_ptr, in_ptr, scale_ptr, out_stride, in_stride, n, BLOCK: tl.constexpr,
    FP8_BY_HAND: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(in_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    q = quant_to_fp8(x, _inv_scale(scale_ptr), FP8_BY_HAND)
    tl.store(out_ptr + row * out_stride + cols, q, mask=mask)


@triton.jit
def _rms_norm_quant_kernel(
    out_ptr, in_ptr, res_ptr, w_ptr, scale_ptr, out_stride, in_stride, res_stride, hidden, eps,
    ADD_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, BF16_RTNE: tl.constexpr,
    FP8_BY_HAND: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = in_ptr.dtype.element_ty
    x = tl.load(in_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD_RESIDUAL:  # residual <- input + residual, rounded and stored; that sum is normalised
        r = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
        z = cast_to(x + r, dtype, BF16_RTNE)
        tl.store(res_ptr + row * res_stride + cols, z, mask=mask)
        x = z.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    normed = cast_to(x * inv_rms, dtype, BF16_RTNE).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = cast_to(normed * w, dtype, BF16_RTNE).to(tl.float32)  # what rms_norm would have stored
    tl.store(out_ptr + row * out_stride + cols, quant_to_fp8(y, _inv_scale(scale_ptr), FP8_BY_HAND),
             mask=mask)


@triton.jit
def _silu_and_mul_quant_kernel(
    out_ptr, in_ptr, scale_ptr, out_stride, in_stride, d,
    BLOCK: tl.constexpr, BF16_RTNE: tl.constexpr, FP8_BY_HAND: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    x = tl.load(in_ptr + row * in_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(in_ptr + row * in_stride + d + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = in_ptr.dtype.element_ty
    act = cast_to(x / (1.0 + tl.exp(-x)), dtype, BF16_RTNE).to(tl.float32)
    prod = cast_to(act * y, dtype, BF16_RTNE).to(tl.float32)  # what silu_and_mul would have stored
    tl.store(out_ptr + row * out_stride + cols, quant_to_fp8(prod, _inv_scale(scale_ptr),
                                                             FP8_BY_HAND), mask=mask)


def _check_quant_args(result: torch.Tensor, input: torch.Tensor, scale: torch.Tensor,
                      shape: tuple) -> None:
    """The launches' own checks (the custom ops check the same, with friendlier messages, first)."""
    if result.dtype != FP8_DTYPE:
        raise ValueError(f"result dtype {result.dtype} != {FP8_DTYPE}")
    if tuple(result.shape) != tuple(shape):
        raise ValueError(f"result shape {tuple(result.shape)} != {tuple(shape)}")
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"scale must be one float32 value, got {scale.numel()} of {scale.dtype}")
    for name, t in (("result", result), ("scale", scale)):
        if t.device != input.device:
            raise ValueError(f"{name} is on {t.device}, input on {input.device}")
    check_launchable("input", input)


def static_scaled_fp8_quant_triton(result: torch.Tensor, input: torch.Tensor,
                                   scale: torch.Tensor) -> None:
    require_triton("static_scaled_fp8_quant_triton")
    _check_quant_args(result, input, scale, input.shape)
    out2, in2 = _fp8_rows("result", result), as_rows("input", input)
    if in2.numel() == 0:
        return
    n = in2.shape[1]
    block = min(triton.next_power_of_2(n), 1024)
    _static_quant_kernel[(in2.shape[0], triton.cdiv(n, block))](
        out2, in2, scale, out2.stride(0), in2.stride(0), n, BLOCK=block,
        FP8_BY_HAND=_fp8_by_hand(), num_warps=4,
    )  # fmt: skip


def _rms_norm_quant_launch(result, input, residual, weight, scale, epsilon) -> None:
    hidden = input.shape[-1] if input.dim() else 0
    if weight.shape != (hidden,) or weight.dtype != input.dtype or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous ({hidden},) {input.dtype}, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if residual is not None and (residual.shape != input.shape or residual.dtype != input.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match input "
                         f"{tuple(input.shape)} {input.dtype}")
    _check_quant_args(result, input, scale, input.shape)
    out2, in2 = _fp8_rows("result", result), as_rows("input", input)
    res2 = as_rows("residual", residual) if residual is not None else in2
    if in2.numel() == 0:
        return
    block = triton.next_power_of_2(in2.shape[1])
    _rms_norm_quant_kernel[(in2.shape[0],)](
        out2, in2, res2, weight, scale, out2.stride(0), in2.stride(0), res2.stride(0),
        in2.shape[1], epsilon,
        ADD_RESIDUAL=residual is not None, BLOCK=block, BF16_RTNE=needs_bf16_rtne(input),
        FP8_BY_HAND=_fp8_by_hand(), num_warps=min(max(block // 512, 1), 16),
    )  # fmt: skip


def rms_norm_static_fp8_quant_triton(result, input, weight, scale, epsilon) -> None:
    require_triton("rms_norm_static_fp8_quant_triton")
    _rms_norm_quant_launch(result, input, None, weight, scale, epsilon)


def fused_add_rms_norm_static_fp8_quant_triton(result, input, residual, weight, scale,
                                               epsilon) -> None:
    require_triton("fused_add_rms_norm_static_fp8_quant_triton")
    _rms_norm_quant_launch(result, input, residual, weight, scale, epsilon)


def silu_and_mul_quant_triton(result: torch.Tensor, input: torch.Tensor,
                              scale: torch.Tensor) -> None:
    require_triton("silu_and_mul_quant_triton")
    if input.dim() == 0 or input.shape[-1] % 2:
        raise ValueError(f"input last dimension must be even (2*d), got shape {tuple(input.shape)}")
    _check_quant_args(result, input, scale, (*input.shape[:-1], input.shape[-1] // 2))
    out2, in2 = _fp8_rows("result", result), as_rows("input", input)
    if out2.numel() == 0:
        return
    d = out2.shape[1]
    block = min(triton.next_power_of_2(d), 1024)
    _silu_and_mul_quant_kernel[(out2.shape[0], triton.cdiv(d, block))](
        out2, in2, scale, out2.stride(0), in2.stride(0), d,
        BLOCK=block, BF16_RTNE=needs_bf16_rtne(input), FP8_BY_HAND=_fp8_by_hand(), num_warps=4,
    )  # fmt: skip

