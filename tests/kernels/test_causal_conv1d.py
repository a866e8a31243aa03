"""causal_conv1d (seed §16): Triton kernels (TRITON_INTERPRET=1 on CPU, compiled on a GPU: see
conftest.kernel_device) against the torch references, and the references against formulas that
share no code with them."""

import pytest
import torch
import torch.nn.functional as F

from minivllm_compile.kernels._compat import HAS_TRITON
from minivllm_compile.kernels.causal_conv1d import (
    PAD_SLOT_ID,
    causal_conv1d_fn,
    causal_conv1d_fn_ref,
    causal_conv1d_update,
    causal_conv1d_update_ref,
)

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
# fp32: same fp32 math, different summation order. bf16: inputs/outputs rounded to bf16 (8 bits of
# mantissa), both sides accumulate in fp32, so they differ by at most an ulp or two of the output.
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}


@pytest.fixture(autouse=True)
def _on_kernel_device(kernel_device):
    """Every tensor a test makes is created on the kernel device (conftest.kernel_device)."""
    with torch.device(kernel_device):
        yield


def _qsl(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _params(dim, width, dtype=torch.float32, seed=0, bias=True):
    g = torch.Generator(device=torch.get_default_device()).manual_seed(seed)
    w = (torch.randn(dim, width, generator=g) / width).to(dtype)
    b = torch.randn(dim, generator=g).to(dtype) if bias else None
    return w, b, g


def _conv1d_formula(stream, w, b, silu):
    """Independent of the references: torch's own depthwise conv1d over [history | tokens]."""
    y = F.conv1d(stream.float()[None], w.float()[:, None, :], None if b is None else b.float(),
                 groups=w.shape[0])[0]
    return F.silu(y) if silu else y


# --------------------------------------------------------------------------- references vs formula


@pytest.mark.parametrize("width", [3, 4])
def test_fn_ref_matches_torch_conv1d(width):
    dim, lens = 48, [1, 7, 3]
    w, b, g = _params(dim, width)
    x = torch.randn(dim, sum(lens), generator=g)
    states = torch.randn(4, dim, width - 1, generator=g)
    cache_indices = torch.tensor([2, 0, 3], dtype=torch.int32)
    has_init = torch.tensor([True, False, True])
    new_states = states.clone()
    out = causal_conv1d_fn_ref(x, w, b, new_states, _qsl(lens), cache_indices, has_init)
    start = 0
    for i, n in enumerate(lens):
        line = int(cache_indices[i])
        history = states[line] if has_init[i] else torch.zeros(dim, width - 1)
        if not has_init[i]:  # zero history is exactly conv1d's left zero padding
            y = _conv1d_formula(F.pad(x[:, start:start + n], (width - 1, 0)), w, b, True)
        else:
            y = _conv1d_formula(torch.cat([history, x[:, start:start + n]], 1), w, b, True)
        torch.testing.assert_close(out[:, start:start + n], y)
        full = torch.cat([history, x[:, start:start + n]], 1)
        torch.testing.assert_close(new_states[line], full[:, -(width - 1):])
        start += n
    torch.testing.assert_close(new_states[1], states[1])  # a line no sequence uses is untouched


@pytest.mark.parametrize("width", [3, 4])
def test_update_ref_prefix_then_decode_equals_whole_prefill(width):
    dim, total, prefix = 100, 9, 4
    w, b, g = _params(dim, width)
    x = torch.randn(dim, total, generator=g)
    whole = torch.zeros(2, dim, width - 1)
    out_whole = causal_conv1d_fn_ref(x, w, b, whole, _qsl([total]), activation=None)
    torch.testing.assert_close(out_whole, _conv1d_formula(F.pad(x, (width - 1, 0)), w, b, False))

    step = torch.zeros(2, dim, width - 1)
    outs = [causal_conv1d_fn_ref(x[:, :prefix], w, b, step, _qsl([prefix]), activation=None)]
    for t in range(prefix, total):
        outs.append(causal_conv1d_update_ref(x[None, :, t], step, w, b).T)
    torch.testing.assert_close(torch.cat(outs, 1), out_whole)
    torch.testing.assert_close(step, whole)
    torch.testing.assert_close(whole[0], x[:, -(width - 1):])


def test_spec_decode_ref_against_stream():
    """Drafts d1..d3 scored at once; after accepting k of them the next step sees history that
    ends at d_k, exactly as if only the accepted tokens had ever been fed."""
    dim, width, n = 48, 4, 3
    w, b, g = _params(dim, width)
    prompt = torch.randn(dim, 5, generator=g)
    drafts = torch.randn(1, dim, n, generator=g)
    nxt = torch.randn(1, dim, n, generator=g)
    state = torch.zeros(1, dim, width - 1 + n - 1)
    causal_conv1d_fn_ref(prompt, w, b, state, _qsl([5]), activation=None)
    one = torch.ones(1, dtype=torch.int32)
    out = causal_conv1d_update_ref(drafts, state, w, b, num_accepted_tokens=one)
    stream = torch.cat([prompt, drafts[0]], 1)
    torch.testing.assert_close(out[0], _conv1d_formula(stream, w, b, False)[:, -n:])
    for k in (1, 2, 3):
        s = state.clone()
        acc = torch.tensor([k], dtype=torch.int32)
        out2 = causal_conv1d_update_ref(nxt, s, w, b, num_accepted_tokens=acc)
        stream_k = torch.cat([prompt, drafts[0, :, :k], nxt[0]], 1)
        torch.testing.assert_close(out2[0], _conv1d_formula(stream_k, w, b, False)[:, -n:])


# --------------------------------------------------------------------------- Triton vs reference


def _both(pair, state, call):
    """Run call(fn, state_copy) for the Triton launch and the reference of pair."""
    s_tri, s_ref = state.clone(), state.clone()
    return call(pair[0], s_tri), call(pair[1], s_ref), s_tri, s_ref


FN = (causal_conv1d_fn, causal_conv1d_fn_ref)
UPDATE = (causal_conv1d_update, causal_conv1d_update_ref)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [3, 4])
@pytest.mark.parametrize("dim", [48, 100])
@pytest.mark.parametrize("lens", [[1], [1, 7, 3], [20, 2]])
def test_fn_triton_matches_ref(lens, dim, width, dtype):
    w, b, g = _params(dim, width, dtype, bias=dim == 48)
    x = torch.randn(dim, sum(lens), generator=g).to(dtype)
    states = torch.randn(len(lens) + 2, dim, width - 1, generator=g).to(dtype)
    cache_indices = torch.randperm(len(lens) + 2, generator=g)[: len(lens)].to(torch.int32)
    has_init = torch.arange(len(lens)) % 2 == 0
    activation = "silu" if width == 4 else None
    o_t, o_r, s_t, s_r = _both(FN, states, lambda fn, s: fn(
        x, w, b, s, _qsl(lens), cache_indices, has_init, activation))
    assert o_t.dtype == dtype and o_t.shape == x.shape
    torch.testing.assert_close(o_t, o_r, **TOL[dtype])
    torch.testing.assert_close(s_t, s_r, atol=0, rtol=0)  # states are copies, never rounded


@needs_triton
def test_fn_triton_pad_slot_and_vllm_layouts():
    dim, width, lens = 48, 4, [2, 5, 1]
    w, b, g = _params(dim, width)
    x = torch.randn(sum(lens), dim, generator=g).T  # vLLM's channel-last x: stride(0) == 1
    # vLLM keeps conv states dim-contiguous (stride(-2) == 1) and may give more than width-1 slots
    states = torch.randn(4, width + 1, dim, generator=g).transpose(1, 2)
    cache_indices = torch.tensor([3, PAD_SLOT_ID, 1], dtype=torch.int32)
    has_init = torch.tensor([True, True, False])
    o_t, o_r, s_t, s_r = _both(FN, states, lambda fn, s: fn(
        x, w, b, s, _qsl(lens), cache_indices, has_init))
    torch.testing.assert_close(o_t, o_r, **TOL[torch.float32])
    torch.testing.assert_close(s_t, s_r, atol=0, rtol=0)
    assert torch.equal(o_t[:, 2:7], torch.zeros(dim, 5))  # padded sequence: not computed
    assert torch.equal(s_t[:, :, width - 1:], states[:, :, width - 1:])  # extra slots untouched
    assert torch.equal(s_t[[0, 2]], states[[0, 2]])


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [3, 4])
@pytest.mark.parametrize("seqlen", [1, 3, 5])
def test_update_triton_matches_ref(seqlen, width, dtype):
    dim, batch = 100, 4
    w, b, g = _params(dim, width, dtype)
    shape = (batch, dim) if seqlen == 1 else (batch, dim, seqlen)
    x = torch.randn(shape, generator=g).to(dtype)
    state = torch.randn(6, dim, width - 1, generator=g).to(dtype)
    idx = torch.tensor([4, 0, PAD_SLOT_ID, 2], dtype=torch.int32)
    o_t, o_r, s_t, s_r = _both(UPDATE, state, lambda fn, s: fn(x, s, w, b, "silu", idx))
    assert o_t.shape == x.shape and o_t.dtype == dtype
    torch.testing.assert_close(o_t, o_r, **TOL[dtype])
    torch.testing.assert_close(s_t, s_r, atol=0, rtol=0)
    assert torch.equal(s_t[[1, 3, 5]], state[[1, 3, 5]])  # pad entry skipped, other lines kept


@needs_triton
def test_bf16_outputs_round_like_the_references():
    # Both sides accumulate in fp32 and round once to bf16; a truncating store (Triton's
    # interpreter without cast_to) moves half the values by an ulp, which TOL cannot see.
    dim, width, lens = 100, 4, [1, 7, 3]
    w, b, g = _params(dim, width, torch.bfloat16)
    x = torch.randn(dim, sum(lens), generator=g).bfloat16()
    states = torch.randn(len(lens), dim, width - 1, generator=g).bfloat16()
    o_t, o_r, _, _ = _both(FN, states, lambda fn, s: fn(x, w, b, s, _qsl(lens)))
    xu = torch.randn(4, dim, generator=g).bfloat16()
    u_t, u_r, _, _ = _both(UPDATE, states[:1].expand(4, -1, -1).contiguous(),
                           lambda fn, s: fn(xu, s, w, b, "silu"))
    for actual, expected in ((o_t, o_r), (u_t, u_r)):
        same = (actual.view(torch.int16) == expected.view(torch.int16)).float().mean().item()
        assert same > 0.99, same


@needs_triton
@pytest.mark.parametrize("width", [3, 4])
def test_update_spec_decode_triton_matches_ref(width):
    dim, batch, seqlen = 48, 3, 3
    w, b, g = _params(dim, width)
    x = torch.randn(batch, dim, seqlen, generator=g)
    state = torch.randn(batch, dim, width - 1 + seqlen - 1, generator=g)
    accepted = torch.tensor([1, 3, 2], dtype=torch.int32)
    idx = torch.tensor([2, 0, 1], dtype=torch.int32)
    o_t, o_r, s_t, s_r = _both(UPDATE, state, lambda fn, s: fn(
        x, s, w, b, conv_state_indices=idx, num_accepted_tokens=accepted))
    torch.testing.assert_close(o_t, o_r, **TOL[torch.float32])
    torch.testing.assert_close(s_t, s_r, atol=0, rtol=0)


@needs_triton
@pytest.mark.parametrize("width", [3, 4])
def test_update_varlen_state_len_correction(width):
    """Uneven query lengths in one varlen batch give what each sequence gives alone: the
    correction state_len -= max_query_len - n makes every sequence see its own spec state_len."""
    dim, lens = 100, [1, 3, 2, 2]
    max_query_len = max(lens)
    w, b, g = _params(dim, width)
    x = torch.randn(sum(lens), dim, generator=g)
    state = torch.randn(5, dim, width - 1 + max_query_len - 1, generator=g)
    idx = torch.tensor([3, 1, PAD_SLOT_ID, 0], dtype=torch.int32)
    accepted = torch.tensor([1, 2, 1, 2], dtype=torch.int32)
    qsl = _qsl(lens)
    o_t, o_r, s_t, s_r = _both(UPDATE, state, lambda fn, s: fn(
        x, s, w, b, "silu", idx, accepted, qsl, max_query_len))
    torch.testing.assert_close(o_t, o_r, **TOL[torch.float32])
    torch.testing.assert_close(s_t, s_r, atol=0, rtol=0)
    alone = state.clone()
    for i, n in enumerate(lens):
        if idx[i] == PAD_SLOT_ID:
            assert torch.equal(o_t[qsl[i]:qsl[i + 1]], torch.zeros(n, dim))
            continue
        xi = x[qsl[i]:qsl[i + 1]].T[None]
        oi = causal_conv1d_update(xi, alone, w, b, "silu", idx[i:i + 1], accepted[i:i + 1])
        torch.testing.assert_close(o_t[qsl[i]:qsl[i + 1]], oi[0].T, **TOL[torch.float32])
    torch.testing.assert_close(s_t, alone, atol=0, rtol=0)
    assert torch.equal(s_t[2], state[2])


# --------------------------------------------------------------------------- argument checks


@pytest.mark.parametrize("fn", [causal_conv1d_fn_ref] + ([causal_conv1d_fn] if HAS_TRITON else []))
def test_fn_rejects_bad_arguments(fn):
    dim, width = 48, 4
    w, b, _ = _params(dim, width)
    x, states, qsl = torch.randn(dim, 5), torch.zeros(2, dim, 3), _qsl([2, 3])
    with pytest.raises(ValueError, match="x must be"):
        fn(x[None], w, b, states, qsl)
    with pytest.raises(ValueError, match="weight"):
        fn(x, w[:40], b, states, qsl)
    with pytest.raises(ValueError, match="conv_states"):
        fn(x, w, b, states[:, :, :2], qsl)
    with pytest.raises(ValueError, match=r"conv_states is torch\.bfloat16"):
        fn(x, w, b, states.bfloat16(), qsl)
    with pytest.raises(ValueError, match="query_start_loc"):
        fn(x, w, b, states, qsl.float())
    with pytest.raises(ValueError, match="cache_indices"):
        fn(x, w, b, states, qsl, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="activation"):
        fn(x, w, b, states, qsl, activation="relu")


@pytest.mark.parametrize("fn", [causal_conv1d_update_ref]
                         + ([causal_conv1d_update] if HAS_TRITON else []))
def test_update_rejects_bad_arguments(fn):
    dim, width = 48, 4
    w, b, _ = _params(dim, width)
    state = torch.zeros(3, dim, width - 1)
    with pytest.raises(ValueError, match="x must be"):
        fn(torch.randn(2, dim, 1, 1), state, w, b)
    with pytest.raises(ValueError, match="bias"):
        fn(torch.randn(2, dim), state, w, b[:3])
    with pytest.raises(ValueError, match="conv_state must be"):  # spec needs width-1+seqlen-1
        accepted = torch.ones(2, dtype=torch.int32)
        fn(torch.randn(2, dim, 3), state, w, b, num_accepted_tokens=accepted)
    with pytest.raises(ValueError, match="conv_state_indices"):
        fn(torch.randn(2, dim), state, w, b, conv_state_indices=torch.zeros(3, dtype=torch.int32))
    qsl = _qsl([1, 2])
    with pytest.raises(ValueError, match="max_query_len"):
        fn(torch.randn(3, dim), state, w, b, query_start_loc=qsl)
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        fn(torch.randn(3, dim), state, w, b, query_start_loc=qsl, max_query_len=2)
