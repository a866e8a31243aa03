"""Per-head RMSNorm of q and k followed by RoPE, in place on the packed qkv (Qwen3-style QK norm).

Schema, as vLLM's ``_C.fused_qk_norm_rope`` (csrc/torch_bindings.cpp)::

    fused_qk_norm_rope(Tensor! qkv, int num_heads_q, int num_heads_k, int num_heads_v,
                       int head_dim, float eps, Tensor q_weight, Tensor k_weight,
                       Tensor cos_sin_cache, bool is_neox, Tensor position_ids,
                       int forced_token_heads_per_warp=-1) -> ()

``qkv`` is ``[num_tokens, (nq + nk + nv) * head_dim]``: every q head is normalised with
``q_weight``, every k head with ``k_weight``, both are then rotated at ``position_ids``, and v is
not touched. Like vLLM's kernel (csrc/fused_qknorm_rope_kernel.cu), the normalised head stays in
fp32 through the rotation and is rounded to the qkv dtype once, at the end; so this is *not*
bit-identical to calling ``rms_norm`` then ``rotary_embedding`` in bf16, which rounds in between.
"""

from __future__ import annotations

import torch

from minivllm_compile.kernels._compat import require_triton, tl, triton
from minivllm_compile.kernels.layernorm import rms_norm_ref
from minivllm_compile.kernels.rotary_embedding import (
    check_positions,
    rope_pair,
    rotary_embedding_ref,
)
from minivllm_compile.kernels.utils import cast_to, check_launchable, needs_bf16_rtne


def fused_qk_norm_rope_ref(
    qkv: torch.Tensor,
    num_heads_q: int,
    num_heads_k: int,
    num_heads_v: int,
    head_dim: int,
    eps: float,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    position_ids: torch.Tensor,
    forced_token_heads_per_warp: int = -1,
) -> None:
    # forced_token_heads_per_warp only picks how vLLM's CUDA kernel packs heads into warps.
    num_tokens, qk_size = qkv.shape[0], (num_heads_q + num_heads_k) * head_dim
    # vLLM's kernel keeps the normalised head in fp32 through the rotation, so work on an fp32
    # copy (a copy even for fp32 qkv, so the write-back below never overlaps its source).
    qk = qkv[:, :qk_size].to(torch.float32, copy=True)
    qk = qk.view(num_tokens, num_heads_q + num_heads_k, head_dim)
    q, k = qk[:, :num_heads_q], qk[:, num_heads_q:]
    rms_norm_ref(q, q, q_weight.float(), eps)
    rms_norm_ref(k, k, k_weight.float(), eps)
    rotary_embedding_ref(position_ids, q, k, head_dim, cos_sin_cache, is_neox)
    qkv[:, :qk_size] = qk.view(num_tokens, qk_size)


@triton.jit
def _fused_qk_norm_rope_kernel(
    qkv_ptr, q_w_ptr, k_w_ptr, cache_ptr, pos_ptr,
    token_stride, cache_stride, num_heads_q, head_dim, R, eps,
    IS_NEOX: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_TAIL: tl.constexpr,
    BF16_RTNE: tl.constexpr,
):  # fmt: skip
    # One program per (token, q-or-k head), as vLLM gives each one a warp. k heads follow the q
    # heads in a row, so head * head_dim addresses either.
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    head_ptr = qkv_ptr + token * token_stride + head * head_dim
    if head < num_heads_q:
        w_ptr = q_w_ptr
    else:
        w_ptr = k_w_ptr
    # The head is read as the two rotated halves plus the unrotated tail (partial rotary): each
    # feature is loaded once and the norm's sum of squares covers the whole head.
    r = tl.arange(0, BLOCK_R)
    rmask = r < R
    first, second = rope_pair(r, R, IS_NEOX)
    tail = 2 * R + tl.arange(0, BLOCK_TAIL)
    tmask = tail < head_dim
    x = tl.load(head_ptr + first, mask=rmask, other=0.0).to(tl.float32)
    y = tl.load(head_ptr + second, mask=rmask, other=0.0).to(tl.float32)
    t = tl.load(head_ptr + tail, mask=tmask, other=0.0).to(tl.float32)
    sum_sq = tl.sum(x * x, axis=0) + tl.sum(y * y, axis=0) + tl.sum(t * t, axis=0)
    inv_rms = tl.rsqrt(sum_sq / head_dim + eps)
    x = x * (inv_rms * tl.load(w_ptr + first, mask=rmask, other=0.0).to(tl.float32))
    y = y * (inv_rms * tl.load(w_ptr + second, mask=rmask, other=0.0).to(tl.float32))
    t = t * (inv_rms * tl.load(w_ptr + tail, mask=tmask, other=0.0).to(tl.float32))

    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos = tl.load(cache_ptr + pos * cache_stride + r, mask=rmask, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * cache_stride + R + r, mask=rmask, other=0.0).to(tl.float32)
    dtype = qkv_ptr.dtype.element_ty
    tl.store(head_ptr + first, cast_to(x * cos - y * sin, dtype, BF16_RTNE), mask=rmask)
    tl.store(head_ptr + second, cast_to(y * cos + x * sin, dtype, BF16_RTNE), mask=rmask)
    tl.store(head_ptr + tail, cast_to(t, dtype, BF16_RTNE), mask=tmask)


def _check_args(qkv, num_heads, head_dim, q_weight, k_weight, cos_sin_cache, position_ids):
    if qkv.dim() != 2 or qkv.shape[1] != num_heads * head_dim or qkv.stride(1) != 1:
        raise ValueError(
            f"qkv must be [num_tokens, {num_heads}*{head_dim}] with a contiguous "
            f"last dim, got shape {tuple(qkv.shape)} strides {qkv.stride()}"
        )
    if position_ids.shape != qkv.shape[:1] or position_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"position_ids must be int [num_tokens={qkv.shape[0]}], got "
            f"{position_ids.dtype} {tuple(position_ids.shape)}"
        )
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w.shape != (head_dim,) or w.dtype != qkv.dtype or not w.is_contiguous():
            raise ValueError(
                f"{name} must be a contiguous [{head_dim}] {qkv.dtype} tensor, "
                f"got {w.dtype} {tuple(w.shape)}"
            )
    rot = cos_sin_cache.shape[1] if cos_sin_cache.dim() == 2 else -1
    if rot < 0 or rot % 2 or rot > head_dim or cos_sin_cache.stride(1) != 1:
        raise ValueError(
            f"cos_sin_cache must be [max_position, rotary_dim], rotary_dim even and "
            f"<= head_dim={head_dim}, got {tuple(cos_sin_cache.shape)}"
        )
    for name, t in (
        ("q_weight", q_weight),
        ("k_weight", k_weight),
        ("cos_sin_cache", cos_sin_cache),
        ("position_ids", position_ids),
    ):
        if t.device != qkv.device:
            raise ValueError(f"{name} is on {t.device}, qkv on {qkv.device}")
    check_launchable("qkv", qkv)


def fused_qk_norm_rope_triton(
    qkv: torch.Tensor,
    num_heads_q: int,
    num_heads_k: int,
    num_heads_v: int,
    head_dim: int,
    eps: float,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    position_ids: torch.Tensor,
    forced_token_heads_per_warp: int = -1,
    *,
    check_positions_in_range: bool = True,
) -> None:
    """In place on ``qkv``. ``check_positions_in_range=False`` skips the one check that costs a
    host sync (every position a row of ``cos_sin_cache``: the kernel reads row ``pos``
    unchecked); only ops.fused_qk_norm_rope, which has checked them already, passes it."""
    require_triton("fused_qk_norm_rope_triton")
    num_heads = num_heads_q + num_heads_k + num_heads_v
    _check_args(qkv, num_heads, head_dim, q_weight, k_weight, cos_sin_cache, position_ids)
    if check_positions_in_range:
        check_positions(position_ids, cos_sin_cache, "fused_qk_norm_rope_triton")
    if qkv.shape[0] == 0 or num_heads_q + num_heads_k == 0:
        return
    R = cos_sin_cache.shape[1] // 2
    _fused_qk_norm_rope_kernel[(qkv.shape[0], num_heads_q + num_heads_k)](
        qkv, q_weight, k_weight, cos_sin_cache, position_ids,
        qkv.stride(0), cos_sin_cache.stride(0), num_heads_q, head_dim, R, eps,
        IS_NEOX=bool(is_neox), BLOCK_R=triton.next_power_of_2(max(R, 1)),
        BLOCK_TAIL=triton.next_power_of_2(max(head_dim - 2 * R, 1)),
        BF16_RTNE=needs_bf16_rtne(qkv), num_warps=1 if head_dim <= 128 else 2,
    )  # fmt: skip
