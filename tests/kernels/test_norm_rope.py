"""Triton kernels for RMSNorm, RoPE, SiLU-and-mul and fused QK-norm+RoPE against their references.

The Triton kernels run on the CPU through Triton's interpreter (conftest.py sets
TRITON_INTERPRET=1 before anything imports them), or compiled on a GPU where there is one and
TRITON_INTERPRET=0 (scripts/gpu_check.sh): every test makes its tensors on conftest.kernel_device.
The references are themselves checked against formulas written out here, so a wrong reference cannot
make a wrong kernel pass.
"""

from __future__ import annotations

import pytest
import torch

from minivllm_compile.kernels._compat import HAS_TRITON, tl, triton
from minivllm_compile.kernels.activation import silu_and_mul_ref, silu_and_mul_triton
from minivllm_compile.kernels.layernorm import (
    cast_to,
    fused_add_rms_norm_ref,
    fused_add_rms_norm_triton,
    needs_bf16_rtne,
    rms_norm_ref,
    rms_norm_triton,
)
from minivllm_compile.kernels.qk_norm_rope import (
    fused_qk_norm_rope_ref,
    fused_qk_norm_rope_triton,
)
from minivllm_compile.kernels.rotary_embedding import (
    compute_cos_sin_cache,
    rotary_embedding_ref,
    rotary_embedding_triton,
)

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

EPS = 1e-6
# fp32: the kernels and references differ only in fp32 reduction order and rsqrt/exp ulps.
# bf16: one bf16 ulp is 2**-8 relative; 2e-2 leaves room for a few ulps where roundings differ.
TOL = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}
DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(1, 96), (7, 200), (4, 128)]  # (num_tokens, hidden): non powers of two and one power


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _on_kernel_device(kernel_device):
    """Every tensor a test makes is created on the kernel device (conftest.kernel_device)."""
    with torch.device(kernel_device):
        yield


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, **TOL[expected.dtype])


def _angles(positions: torch.Tensor, rotary_dim: int, base: float = 10000.0) -> torch.Tensor:
    """theta[t, i] = pos_t * base**(-2i / rotary_dim), in float64."""
    inv_freq = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    return positions.double()[:, None] * inv_freq[None, :]


# --- the references against independent formulas --------------------------------------------


def test_rms_norm_ref_matches_formula():
    x, w = torch.randn(5, 200), torch.randn(200)
    out = torch.empty_like(x)
    rms_norm_ref(out, x, w, EPS)
    _close(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w)


def test_fused_add_rms_norm_ref_matches_formula():
    x, r, w = torch.randn(5, 96), torch.randn(5, 96), torch.randn(96)
    s = x + r
    expected = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + EPS) * w
    fused_add_rms_norm_ref(x, r, w, EPS)
    _close(r, s)
    _close(x, expected)


def test_silu_and_mul_ref_matches_formula():
    x = torch.randn(3, 2 * 100)
    out = torch.empty(3, 100)
    silu_and_mul_ref(out, x)
    gate, up = x[:, :100], x[:, 100:]
    _close(out, gate / (1 + torch.exp(-gate)) * up)


def test_cos_sin_cache_matches_formula():
    cache = compute_cos_sin_cache(rotary_dim=32, max_position=50, base=500.0)
    theta = _angles(torch.arange(50), 32, base=500.0)
    assert cache.shape == (50, 32) and cache.dtype == torch.float32
    torch.testing.assert_close(
        cache.double(), torch.cat((theta.cos(), theta.sin()), -1), atol=1e-5, rtol=0
    )


def _rope_formula(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, is_neox: bool):
    """x: [T, H, D] fp32. NeoX as Hugging Face writes it (rotate_half);
    GPT-J as complex products."""
    theta = _angles(positions, rotary_dim)[:, None, :]  # [T, 1, R]
    rot, rest = x[..., :rotary_dim].double(), x[..., rotary_dim:]
    if is_neox:
        cos, sin = torch.cat((theta.cos(),) * 2, -1), torch.cat((theta.sin(),) * 2, -1)
        x1, x2 = rot.chunk(2, -1)
        out = rot * cos + torch.cat((-x2, x1), -1) * sin
    else:
        pairs = torch.view_as_complex(rot.reshape(*rot.shape[:-1], -1, 2).contiguous())
        out = torch.view_as_real(pairs * torch.polar(torch.ones_like(theta), theta)).flatten(-2)
    return torch.cat((out.float(), rest), -1)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_embedding_ref_matches_formula(is_neox, rotary_dim):
    positions = torch.tensor([9, 0, 41, 3])
    q, k = torch.randn(4, 3, 64), torch.randn(4, 1, 64)
    expected_q = _rope_formula(q, positions, rotary_dim, is_neox)
    expected_k = _rope_formula(k, positions, rotary_dim, is_neox)
    q_flat = q.reshape(4, 3 * 64).clone()  # the [T, H*D] layout
    rotary_embedding_ref(positions, q_flat, k, 64, compute_cos_sin_cache(rotary_dim, 64), is_neox)
    _close(q_flat.view(4, 3, 64), expected_q)
    _close(k, expected_k)


def test_fused_qk_norm_rope_ref_matches_formula():
    nq, nk, nv, d = 2, 1, 1, 64
    qkv, qw, kw = torch.randn(3, (nq + nk + nv) * d), torch.randn(d), torch.randn(d)
    positions = torch.tensor([7, 2, 30])
    heads = qkv.view(3, -1, d).clone()
    normed = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + EPS)
    q = _rope_formula(normed[:, :nq] * qw, positions, 32, True)
    k = _rope_formula(normed[:, nq : nq + nk] * kw, positions, 32, True)
    expected = torch.cat((q, k, heads[:, nq + nk :]), 1).view(3, -1)
    cache = compute_cos_sin_cache(32, 64)
    fused_qk_norm_rope_ref(qkv, nq, nk, nv, d, EPS, qw, kw, cache, True, positions)
    _close(qkv, expected)


# --- the Triton kernels against the references ----------------------------------------------


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", SHAPES)
def test_rms_norm_triton(num_tokens, hidden, dtype):
    x, w = torch.randn(num_tokens, hidden, dtype=dtype), torch.randn(hidden, dtype=dtype)
    expected, out = torch.empty_like(x), torch.empty_like(x)
    rms_norm_ref(expected, x, w, EPS)
    rms_norm_triton(out, x, w, EPS)
    _close(out, expected)


@needs_triton
def test_rms_norm_triton_leading_dims_and_row_stride():
    x = torch.randn(2, 3, 96)
    w = torch.randn(96)
    expected, out = torch.empty_like(x), torch.empty_like(x)
    rms_norm_ref(expected, x, w, EPS)
    rms_norm_triton(out, x, w, EPS)
    _close(out, expected)
    wide = torch.randn(5, 300)  # rows of a wider buffer: a row stride that is not hidden
    expected, out = torch.empty(5, 96), torch.empty(5, 96)
    rms_norm_ref(expected, wide[:, 100:196], w, EPS)
    rms_norm_triton(out, wide[:, 100:196], w, EPS)
    _close(out, expected)
    # the hybrid's q norm: a per-head view of the q slice of qkv, [tokens, heads, head_dim], whose
    # tokens lie further apart than heads * head_dim (no 2-D view of it exists)
    qkv, wq = torch.randn(5, 4 * 24 + 2 * 2 * 24), torch.randn(24)
    q = qkv[:, : 4 * 24].view(5, 4, 24)
    expected, out = torch.empty_like(q), torch.empty_like(q)
    rms_norm_ref(expected, q, wq, EPS)
    rms_norm_triton(out, q, wq, EPS)
    _close(out, expected)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hidden", SHAPES)
def test_fused_add_rms_norm_triton(num_tokens, hidden, dtype):
    x = torch.randn(num_tokens, hidden, dtype=dtype)
    r, w = torch.randn_like(x), torch.randn(hidden, dtype=dtype)
    x_ref, r_ref = x.clone(), r.clone()
    fused_add_rms_norm_ref(x_ref, r_ref, w, EPS)
    fused_add_rms_norm_triton(x, r, w, EPS)
    _close(r, r_ref)
    _close(x, x_ref)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 96), (5, 2 * 200), (2, 3, 2 * 64), (2, 2 * 1100)])
def test_silu_and_mul_triton(shape, dtype):
    x = torch.randn(shape, dtype=dtype)
    out_shape = (*shape[:-1], shape[-1] // 2)
    expected, out = torch.empty(out_shape, dtype=dtype), torch.empty(out_shape, dtype=dtype)
    silu_and_mul_ref(expected, x)
    silu_and_mul_triton(out, x)
    _close(out, expected)


ROPE_CASES = [
    # is_neox, rotary_dim, head_size, key_layout, num_tokens
    (True, 64, 64, "flat", 5),
    (False, 64, 64, "flat", 5),
    (True, 32, 80, "3d", 1),  # partial rotary, head_size not a power of two
    (False, 48, 80, "3d", 5),
    (True, 64, 64, None, 5),  # key=None
    (False, 32, 64, None, 1),
]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_neox,rotary_dim,head_size,key_layout,num_tokens", ROPE_CASES)
def test_rotary_embedding_triton(is_neox, rotary_dim, head_size, key_layout, num_tokens, dtype):
    cache = compute_cos_sin_cache(rotary_dim, 128, dtype=dtype)
    positions = torch.tensor([100, 3, 57, 0, 12][:num_tokens])  # not sorted
    q = torch.randn(num_tokens, 6 * head_size, dtype=dtype)
    k = {
        "flat": torch.randn(num_tokens, 2 * head_size, dtype=dtype),
        "3d": torch.randn(num_tokens, 2, head_size, dtype=dtype),
        None: None,
    }[key_layout]
    q_ref, k_ref = q.clone(), None if k is None else k.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, head_size, cache, is_neox)
    rotary_embedding_triton(positions, q, k, head_size, cache, is_neox)
    _close(q, q_ref)
    if k is not None:
        _close(k, k_ref)
    tail = q.view(num_tokens, 6, head_size)[..., rotary_dim:]  # partial rotary leaves it alone
    assert torch.equal(tail, q_ref.view(num_tokens, 6, head_size)[..., rotary_dim:])


@needs_triton
def test_rotary_embedding_triton_on_qkv_slices():
    """The model applies RoPE to q and k as column slices of one qkv buffer; v must not move."""
    qkv = torch.randn(3, (4 + 2 + 2) * 64)
    q, k, v = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    v_before, expected = v.clone(), qkv.clone()
    eq, ek, _ = expected.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    cache, positions = compute_cos_sin_cache(64, 16), torch.tensor([4, 15, 1])
    rotary_embedding_ref(positions, eq, ek, 64, cache, True)
    rotary_embedding_triton(positions, q, k, 64, cache, True)
    _close(qkv, expected)
    assert torch.equal(v, v_before)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "is_neox,head_dim,rotary_dim,num_tokens",
    [(True, 64, 64, 4), (False, 64, 64, 1), (True, 96, 48, 4), (False, 128, 64, 3)],
)
def test_fused_qk_norm_rope_triton(is_neox, head_dim, rotary_dim, num_tokens, dtype):
    nq, nk, nv = 4, 2, 2
    qkv = torch.randn(num_tokens, (nq + nk + nv) * head_dim, dtype=dtype)
    qw, kw = torch.randn(head_dim, dtype=dtype), torch.randn(head_dim, dtype=dtype)
    cache = compute_cos_sin_cache(rotary_dim, 64, dtype=dtype)
    positions = torch.tensor([33, 2, 63, 0][:num_tokens])
    expected = qkv.clone()
    fused_qk_norm_rope_ref(expected, nq, nk, nv, head_dim, EPS, qw, kw, cache, is_neox, positions)
    fused_qk_norm_rope_triton(qkv, nq, nk, nv, head_dim, EPS, qw, kw, cache, is_neox, positions)
    _close(qkv, expected)
    v = slice((nq + nk) * head_dim, None)
    assert torch.equal(qkv[:, v], expected[:, v])


# --- the interpreter's bf16 rounding, and bad arguments -------------------------------------


@triton.jit
def _cast_kernel(src_ptr, dst_ptr, BLOCK: tl.constexpr, BF16_RTNE: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(src_ptr + offs)
    tl.store(dst_ptr + offs, cast_to(x, dst_ptr.dtype.element_ty, BF16_RTNE))


@needs_triton
def test_cast_to_bf16_rounds_to_nearest_even_like_torch():
    # Triton 3.7's interpreter truncates fp32 -> bf16; cast_to must round as torch does.
    x = torch.randn(1024) * torch.logspace(-20, 20, 1024)
    out = torch.empty(1024, dtype=torch.bfloat16)
    _cast_kernel[(1,)](x, out, BLOCK=1024, BF16_RTNE=needs_bf16_rtne(out))
    assert torch.equal(out.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


def _bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return (actual.view(torch.int16) == expected.view(torch.int16)).float().mean().item()


@needs_triton
def test_bf16_kernels_round_where_vllm_rounds():
    # A missing or extra rounding to bf16 moves a value by half an ulp, which no tolerance sees;
    # bit-for-bit agreement does. fp32 reduction order may still flip the odd element, hence 99%.
    x, r = torch.randn(2, 8, 200, dtype=torch.bfloat16).unbind()
    w, x_ref, r_ref = torch.randn(200, dtype=torch.bfloat16), x.clone(), r.clone()
    fused_add_rms_norm_ref(x_ref, r_ref, w, EPS)  # rounds the residual sum, then normed*w
    fused_add_rms_norm_triton(x, r, w, EPS)
    assert _bits_equal(r, r_ref) == 1.0
    assert _bits_equal(x, x_ref) > 0.99

    gate_up = torch.randn(8, 2 * 200, dtype=torch.bfloat16)
    out, out_ref = torch.empty(2, 8, 200, dtype=torch.bfloat16).unbind()
    silu_and_mul_ref(out_ref, gate_up)  # rounds silu(gate), then the product
    silu_and_mul_triton(out, gate_up)
    assert _bits_equal(out, out_ref) > 0.99

    qkv, (qw, kw) = torch.randn(8, 4 * 64, dtype=torch.bfloat16), torch.randn(2, 64).bfloat16()
    qkv_ref = qkv.clone()
    cache, positions = compute_cos_sin_cache(64, 16), torch.arange(8) * 2
    fused_qk_norm_rope_ref(qkv_ref, 2, 1, 1, 64, EPS, qw, kw, cache, True, positions)  # rounds once
    fused_qk_norm_rope_triton(qkv, 2, 1, 1, 64, EPS, qw, kw, cache, True, positions)
    assert _bits_equal(qkv, qkv_ref) > 0.99


@needs_triton
def test_triton_wrappers_reject_bad_arguments():
    x, w = torch.randn(3, 96), torch.randn(96)
    with pytest.raises(ValueError, match="out shape"):
        rms_norm_triton(torch.empty(3, 95), x, w, EPS)
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm_triton(torch.empty_like(x), x, torch.randn(95), EPS)
    with pytest.raises(ValueError, match="residual dtype"):
        fused_add_rms_norm_triton(x, torch.randn(3, 96, dtype=torch.bfloat16), w, EPS)
    with pytest.raises(ValueError, match="out shape"):
        silu_and_mul_triton(torch.empty(3, 96), x)
    cache = compute_cos_sin_cache(32, 16)
    with pytest.raises(ValueError, match="key"):
        rotary_embedding_triton(
            torch.arange(3), torch.randn(3, 128), torch.randn(3, 100), 64, cache, True
        )
    with pytest.raises(ValueError, match="k_weight"):
        fused_qk_norm_rope_triton(
            torch.randn(3, 4 * 64),
            2,
            1,
            1,
            64,
            EPS,
            torch.randn(64),
            torch.randn(32),
            cache,
            True,
            torch.arange(3),
        )
