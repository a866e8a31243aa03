"""What every Triton kernel here uses: writing bf16 with round-to-nearest-even (``cast_to``, which
Triton's interpreter needs by hand), refusing a CPU tensor outside the interpreter, and viewing a
``[..., hidden]`` tensor as rows."""

from __future__ import annotations

import torch

from minivllm_compile.kernels._compat import tl, triton, triton_interpret_enabled


@triton.jit
def cast_to(x, dtype: tl.constexpr, BF16_RTNE: tl.constexpr):
    # Triton's interpreter (3.7) turns fp32 -> bf16 into a truncation (round toward zero), not the
    # round-to-nearest-even every GPU and torch use; under the interpreter we round by hand.
    if BF16_RTNE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        y = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        y = x.to(dtype)
    return y


def needs_bf16_rtne(t: torch.Tensor) -> bool:
    """Whether kernels writing ``t`` must round to bf16 by hand (see ``cast_to``)."""
    return t.dtype == torch.bfloat16 and triton_interpret_enabled()


def check_launchable(name: str, t: torch.Tensor) -> None:
    """A Triton kernel runs on a GPU, or on the CPU only through the interpreter."""
    if t.device.type == "cpu" and not triton_interpret_enabled():
        raise ValueError(
            f"{name} is on the CPU; Triton kernels need a GPU tensor or TRITON_INTERPRET=1 set "
            "before minivllm_compile.kernels is imported"
        )


def as_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """``[..., hidden]`` as a 2-D ``[rows, hidden]`` view (a view, so in-place writes land)."""
    if t.dim() == 0 or t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError as e:
        raise ValueError(f"{name} with shape {tuple(t.shape)} cannot be flattened to rows") from e
