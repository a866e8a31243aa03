"""Rotary position embedding (RoPE), in place on query and key: a reference and a Triton kernel.

``cos_sin_cache[pos]`` is ``[cos(pos * f_0..f_{R-1}), sin(pos * f_0..f_{R-1})]`` with
``R = rotary_dim // 2``. Only the first ``rotary_dim`` features of each head rotate (partial
rotary); the rest pass through. Pair ``i`` is ``(i, i + R)`` in NeoX style (rotate halves) and
``(2i, 2i + 1)`` in GPT-J style (rotate interleaved pairs), rotated by the angle of frequency
``f_i``. As in vLLM's CUDA kernel (csrc/pos_encoding_kernels.cu) the rotation is computed in fp32
and rounded once; vLLM's ``forward_native`` instead rounds after each op in the query dtype, so
in bf16 the two differ by about an ulp.
"""

from __future__ import annotations

import math

import torch

from minivllm_compile.kernels._compat import require_triton, tl, triton
from minivllm_compile.kernels.utils import cast_to, check_launchable, needs_bf16_rtne


def compute_cos_sin_cache(
    rotary_dim: int, max_position: int, base: float = 10000.0, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    # Built in fp32 and cast at the end, as vLLM's RotaryEmbedding does.
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
    freqs = torch.outer(torch.arange(max_position, dtype=torch.float), inv_freq)
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _rotate_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_size: int, is_neox: bool
) -> None:
    # a view, so the write below lands in x; heads counted from the shape, as -1 fails on 0 tokens
    heads = x.view(x.shape[0], math.prod(x.shape[1:]) // head_size, head_size)
    rot = heads[..., : 2 * cos.shape[-1]].float()
    if is_neox:
        x1, x2 = rot.chunk(2, dim=-1)
    else:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    out = torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
    heads[..., : 2 * cos.shape[-1]] = out.to(x.dtype)


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> None:
    cos, sin = cos_sin_cache.index_select(0, positions.flatten()).float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    _rotate_ref(query, cos, sin, head_size, is_neox)
    if key is not None:
        _rotate_ref(key, cos, sin, head_size, is_neox)


# --- Triton ---------------------------------------------------------------------------------


@triton.jit
def rope_pair(r, R, IS_NEOX: tl.constexpr):
    """Offsets, within a head, of the two features rotated by frequency ``r``."""
    if IS_NEOX:
        first, second = r, r + R
    else:
        first, second = 2 * r, 2 * r + 1
    return first, second


@triton.jit
def _rotate_heads(
    ptr, head_stride, num_heads, cos, sin, r, R,
    IS_NEOX: tl.constexpr, BLOCK_H: tl.constexpr, BF16_RTNE: tl.constexpr,
):  # fmt: skip
    h = tl.arange(0, BLOCK_H)[:, None]
    first, second = rope_pair(r, R, IS_NEOX)
    first, second = h * head_stride + first[None, :], h * head_stride + second[None, :]
    mask = (h < num_heads) & (r < R)[None, :]
    x = tl.load(ptr + first, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(ptr + second, mask=mask, other=0.0).to(tl.float32)
    dtype = ptr.dtype.element_ty
    tl.store(ptr + first, cast_to(x * cos - y * sin, dtype, BF16_RTNE), mask=mask)
    tl.store(ptr + second, cast_to(y * cos + x * sin, dtype, BF16_RTNE), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr,
    q_token_stride, q_head_stride, k_token_stride, k_head_stride, cache_stride,
    num_heads, num_kv_heads, R,
    IS_NEOX: tl.constexpr, HAS_KEY: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_R: tl.constexpr, BF16_RTNE: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    r = tl.arange(0, BLOCK_R)
    cos = tl.load(cache_ptr + pos * cache_stride + r, mask=r < R, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * cache_stride + R + r, mask=r < R, other=0.0).to(tl.float32)
    cos, sin = cos[None, :], sin[None, :]
    q_ptr += token * q_token_stride
    _rotate_heads(q_ptr, q_head_stride, num_heads, cos, sin, r, R, IS_NEOX, BLOCK_H, BF16_RTNE)
    if HAS_KEY:
        k_ptr += token * k_token_stride
        _rotate_heads(k_ptr, k_head_stride, num_kv_heads, cos, sin, r, R, IS_NEOX, BLOCK_KH,
                      BF16_RTNE)  # fmt: skip


def _head_layout(name: str, t: torch.Tensor, num_tokens: int, head_size: int) -> tuple[int, int]:
    """(num_heads, head_stride) of ``[T, H*D]`` or ``[T, H, D]``, rejecting anything else."""
    if t.dim() not in (2, 3) or t.shape[0] != num_tokens or t.stride(-1) != 1:
        raise ValueError(
            f"{name} must be [num_tokens={num_tokens}, heads*head_size] or [num_tokens, heads, "
            f"head_size] with a contiguous last dim, got shape {tuple(t.shape)} "
            f"strides {t.stride()}"
        )
    if (t.dim() == 3 and t.shape[2] != head_size) or t.shape[-1] % head_size:
        raise ValueError(f"{name} shape {tuple(t.shape)} does not split into heads of {head_size}")
    return (t.shape[1], t.stride(1)) if t.dim() == 3 else (t.shape[1] // head_size, head_size)


def check_positions(positions: torch.Tensor, cos_sin_cache: torch.Tensor, who: str) -> None:
    """Every position a row of ``cos_sin_cache``: the kernel reads row ``pos`` unchecked, so a
    position past the end reads other memory (finite garbage, or a fault on a GPU). One aminmax,
    a host sync on a GPU; skipped while a CUDA graph is captured, where a sync is illegal."""
    if positions.numel() == 0 or (positions.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    lo, hi = torch.stack(torch.aminmax(positions)).tolist()  # one sync, not two
    rows = cos_sin_cache.shape[0]
    if lo < 0 or hi >= rows:
        raise ValueError(
            f"{who}: positions span [{lo}, {hi}] but cos_sin_cache has {rows} rows (positions "
            f"0..{rows - 1}); build a larger cache (compute_cos_sin_cache(rotary_dim, "
            f"max_position)) or pass positions below {rows}"
        )


def rotary_embedding_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor | None,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    *,
    check_positions_in_range: bool = True,
) -> None:
    """In place on ``query`` and ``key``. ``check_positions_in_range=False`` skips the one check
    that reads values (a host sync on a GPU): for the custom op, which has made it already."""
    require_triton("rotary_embedding_triton")
    if positions.dim() != 1 or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"positions must be 1-D int32/int64, got {positions.dtype} {tuple(positions.shape)}"
        )
    num_tokens = positions.shape[0]
    num_heads, q_head_stride = _head_layout("query", query, num_tokens, head_size)
    num_kv_heads, k_head_stride = num_heads, q_head_stride
    if key is not None:
        num_kv_heads, k_head_stride = _head_layout("key", key, num_tokens, head_size)
        if key.dtype != query.dtype:
            raise ValueError(f"key dtype {key.dtype} != query dtype {query.dtype}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] % 2 or cos_sin_cache.shape[1] > head_size:
        raise ValueError(
            f"cos_sin_cache must be [max_position, rotary_dim] with an even "
            f"rotary_dim <= head_size={head_size}, got {tuple(cos_sin_cache.shape)}"
        )
    if cos_sin_cache.stride(1) != 1:
        raise ValueError("cos_sin_cache must have a contiguous last dimension")
    for name, t in (("positions", positions), ("key", key), ("cos_sin_cache", cos_sin_cache)):
        if t is not None and t.device != query.device:
            raise ValueError(f"{name} is on {t.device}, query on {query.device}")
    check_launchable("query", query)
    if num_tokens == 0:
        return
    if check_positions_in_range:
        check_positions(positions, cos_sin_cache, "rotary_embedding_triton")
    R = cos_sin_cache.shape[1] // 2
    _rotary_embedding_kernel[(num_tokens,)](
        positions, query, query if key is None else key, cos_sin_cache,
        query.stride(0), q_head_stride,
        0 if key is None else key.stride(0), k_head_stride, cos_sin_cache.stride(0),
        num_heads, num_kv_heads, R,
        IS_NEOX=bool(is_neox), HAS_KEY=key is not None,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_KH=triton.next_power_of_2(num_kv_heads),
        BLOCK_R=triton.next_power_of_2(max(R, 1)), BF16_RTNE=needs_bf16_rtne(query), num_warps=4,
    )  # fmt: skip
