"""The rotary ops refuse the same bad calls on both paths, and still take good ones alike.

The checks live in ops._check_rope, run before the path is chosen; each test forces a path by
patching ops._use_triton. The Triton path runs through the interpreter on the CPU (conftest.py sets
TRITON_INTERPRET=1), or compiled where conftest.kernel_device is a GPU.
"""

from __future__ import annotations

import re

import pytest
import torch

import minivllm_compile.ops as ops_module
from minivllm_compile.kernels._compat import HAS_TRITON
from minivllm_compile.kernels.qk_norm_rope import fused_qk_norm_rope_ref
from minivllm_compile.kernels.rotary_embedding import compute_cos_sin_cache, rotary_embedding_ref

ops = torch.ops.minivllm

PATHS = [
    "ref",
    pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")),
]
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


@pytest.fixture(autouse=True)
def _on_kernel_device(kernel_device):
    torch.manual_seed(0)
    with torch.device(kernel_device):
        yield


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    monkeypatch.setattr(ops_module, "_use_triton", lambda t: request.param == "triton")
    return request.param


def test_key_with_other_token_count_is_refused(path):
    # 1 query token, 5 key tokens: the reference used to rotate all 5 keys by the one position
    q, k = torch.randn(1, 2 * 64), torch.randn(5, 64)
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(ValueError, match=r"minivllm::rotary_embedding: `key` has 5 tokens but "
                                         r"`query` has 1"):
        ops.rotary_embedding(torch.tensor([7]), q, k, 64, compute_cos_sin_cache(64, 64), True)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # refused before anything was written


@pytest.mark.parametrize("positions,span", [([3, 1000], "[3, 1000]"), ([-1, 5], "[-1, 5]"),
                                            ([0, 64], "[0, 64]")])  # 64: one past the last row
def test_out_of_range_positions_are_refused(path, positions, span):
    # the Triton kernel used to read past the cache and return finite garbage
    q, k = torch.randn(2, 2 * 64), torch.randn(2, 64)
    q0 = q.clone()
    msg = (r"minivllm::rotary_embedding: `positions` span " + re.escape(span)
           + r" but `cos_sin_cache` has 64 rows .*max_position_embeddings")
    with pytest.raises(ValueError, match=msg):
        ops.rotary_embedding(torch.tensor(positions), q, k, 64, compute_cos_sin_cache(64, 64), True)
    assert torch.equal(q, q0)


def test_fused_qk_norm_rope_refuses_out_of_range_positions(path):
    # it shares _check_rope, so its kernel is guarded the same way
    qkv, w = torch.randn(2, 4 * 64), torch.ones(64)
    with pytest.raises(ValueError, match=r"minivllm::fused_qk_norm_rope: `positions` span "
                                         r"\[0, 64\] but `cos_sin_cache` has 64 rows"):
        ops.fused_qk_norm_rope(qkv, 2, 1, 1, 64, 1e-6, w, w, compute_cos_sin_cache(64, 64), True,
                               torch.tensor([0, 64]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("key_layout", ["flat", "3d", None])
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
def test_valid_calls_are_taken_alike_on_both_paths(path, key_layout, dtype, pos_dtype):
    # the first and last rows of the cache are in range: no off-by-one refusal
    positions = torch.tensor([63, 0, 17, 5], dtype=pos_dtype)
    cache = compute_cos_sin_cache(32, 64, dtype=dtype)
    q = torch.randn(4, 3 * 64, dtype=dtype)
    k = {"flat": torch.randn(4, 64, dtype=dtype), "3d": torch.randn(4, 1, 64, dtype=dtype),
         None: None}[key_layout]
    q_ref, k_ref = q.clone(), None if k is None else k.clone()
    rotary_embedding_ref(positions, q_ref, k_ref, 64, cache, False)
    ops.rotary_embedding(positions, q, k, 64, cache, False)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    if k is not None:
        torch.testing.assert_close(k, k_ref, **TOL[dtype])


def test_no_tokens_is_still_taken(path):
    q, k = torch.empty(0, 64), torch.empty(0, 64)
    ops.rotary_embedding(torch.empty(0, dtype=torch.int64), q, k, 64, compute_cos_sin_cache(64, 8),
                         True)


def test_valid_fused_qk_norm_rope_is_taken(path):
    qkv, qw, kw = torch.randn(3, 4 * 64), torch.randn(64), torch.randn(64)
    cache, positions = compute_cos_sin_cache(64, 64), torch.tensor([63, 0, 9])
    expected = qkv.clone()
    fused_qk_norm_rope_ref(expected, 2, 1, 1, 64, 1e-6, qw, kw, cache, True, positions)
    ops.fused_qk_norm_rope(qkv, 2, 1, 1, 64, 1e-6, qw, kw, cache, True, positions)
    torch.testing.assert_close(qkv, expected, **TOL[torch.float32])


def test_checks_do_not_break_torch_compile():
    # the value check runs in the real op only; tracing runs the fake, which reads no values
    cache = compute_cos_sin_cache(64, 64)

    def f(positions, q, k):
        ops.rotary_embedding(positions, q, k, 64, cache, True)
        return q * 2, k

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True, dynamic=True)
    q, k = torch.randn(3, 2 * 64), torch.randn(3, 64)
    expected = f(torch.tensor([1, 2, 63]), q.clone(), k.clone())
    torch.testing.assert_close(compiled(torch.tensor([1, 2, 63]), q.clone(), k.clone()), expected)
    with pytest.raises(ValueError, match=r"`positions` span \[1, 64\]"):
        compiled(torch.tensor([1, 2, 64]), q.clone(), k.clone())


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("positions", [[0, 64], [-1, 3], [5, 1000]])
def test_the_bare_triton_function_refuses_positions_past_the_cache(positions):
    # notebooks call it directly, without the op's checks: it used to read past the cache
    from minivllm_compile.kernels.rotary_embedding import rotary_embedding_triton

    q, k = torch.randn(2, 2 * 64), torch.randn(2, 64)
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(ValueError, match=r"rotary_embedding_triton: positions span \[.*\] but "
                                         r"cos_sin_cache has 64 rows \(positions 0..63\)"):
        rotary_embedding_triton(torch.tensor(positions), q, k, 64, compute_cos_sin_cache(64, 64),
                                True)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # refused before anything was written


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("positions", [[0, 64], [-1, 3], [5, 1000]])
def test_the_bare_fused_qk_norm_rope_triton_refuses_positions_past_the_cache(positions):
    # the fused kernel reads row `pos` of the cache unchecked too: called directly, without
    # ops.fused_qk_norm_rope's checks, it used to read past the cache
    from minivllm_compile.kernels.qk_norm_rope import fused_qk_norm_rope_triton

    qkv = torch.randn(2, 3 * 64)  # one q, one k and one v head of 64
    qkv0 = qkv.clone()
    with pytest.raises(ValueError, match=r"fused_qk_norm_rope_triton: positions span \[.*\] but "
                                         r"cos_sin_cache has 64 rows \(positions 0..63\)"):
        fused_qk_norm_rope_triton(qkv, 1, 1, 1, 64, 1e-6, torch.ones(64), torch.ones(64),
                                  compute_cos_sin_cache(64, 64), True, torch.tensor(positions))
    assert torch.equal(qkv, qkv0)  # refused before anything was written
