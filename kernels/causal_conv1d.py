"""Mamba-style causal depthwise conv1d with a per-sequence conv state (seed §16).

Follows vLLM's ``vllm/model_executor/layers/mamba/ops/causal_conv1d.py`` (same names, signatures
and state semantics) without what serves only scale: prefix-caching block states, EAGLE trees,
precomputed launch metadata, one sequence chunked over many programs. ``causal_conv1d_fn`` is the
varlen prefill, ``causal_conv1d_update`` the (spec) decode step; each has a plain-torch ``*_ref``
twin with the same signature that mutates the states the same way (the CPU path and the ground
truth in tests). Notebook 11 draws the state layout.
"""

from __future__ import annotations

import torch

from minivllm_compile.kernels._compat import require_triton, tl, triton
from minivllm_compile.kernels.utils import cast_to, check_launchable, needs_bf16_rtne

# A cache index equal to this marks a padded batch entry: nothing is read, computed or written.
PAD_SLOT_ID = -1


# --------------------------------------------------------------------------- Triton kernels


@triton.jit
def _load_stream(x_base, stride_x_token, s_base, stride_s_tok, pos, seqlen, hist_end,
                 use_history, mask_f):
    # The conv sees one stream per sequence: the history held in conv_state, then the new tokens.
    # pos >= 0 is x[pos]; pos < 0 is state slot hist_end + pos (zero when there is no history).
    mask_x = ((pos >= 0) & (pos < seqlen))[:, None] & mask_f[None, :]
    mask_s = ((pos < 0) & use_history)[:, None] & mask_f[None, :]
    from_x = tl.load(x_base[None, :] + (pos * stride_x_token)[:, None], mask_x, other=0.0)
    from_s = tl.load(s_base[None, :] + ((hist_end + pos) * stride_s_tok)[:, None], mask_s,
                     other=0.0)
    return tl.where(mask_x, from_x, from_s).to(tl.float32)


@triton.jit
def _conv_tile(acc, x_base, stride_x_token, s_base, stride_s_tok, w_base, stride_w_width,
               idx_tokens, seqlen, hist_end, use_history, mask_f, KERNEL_WIDTH: tl.constexpr):
    for j in tl.static_range(KERNEL_WIDTH):
        # tap j looks KERNEL_WIDTH-1-j tokens back, so the first tokens reach into the history
        w = tl.load(w_base + j * stride_w_width, mask_f, other=0.0).to(tl.float32)
        pos = idx_tokens - (KERNEL_WIDTH - 1 - j)
        xin = _load_stream(x_base, stride_x_token, s_base, stride_s_tok, pos, seqlen, hist_end,
                           use_history, mask_f)
        acc += xin * w[None, :]
    return acc


@triton.jit
def _roll_conv_state(x_base, stride_x_token, s_base, stride_s_tok, seqlen, state_len,
                     src_shift, use_history, mask_f, NP2_STATELEN: tl.constexpr):
    # seed §16: the new state is [VAL slots of old history | the newest tokens of x].
    idx_tokens = tl.arange(0, NP2_STATELEN)
    VAL = state_len - seqlen  # old slots kept; <= 0 when x alone fills the state
    # mask (idx_tokens + seqlen < state_len, i.e. idx_tokens < VAL): keep old history, read
    # from slot idx_tokens + src_shift (seqlen for a plain shift, num_accepted for spec decode)
    mask = ((idx_tokens + seqlen) < state_len)[:, None] & mask_f[None, :]
    conv_state = tl.load(s_base[None, :] + ((idx_tokens + src_shift) * stride_s_tok)[:, None],
                         mask & use_history, other=0.0)
    # idx_tokens - VAL maps a state slot to a token of x: negative = old history, not read from x
    mask_x = ((idx_tokens - VAL >= 0) & (idx_tokens - VAL < seqlen))[:, None] & mask_f[None, :]
    loaded_x = tl.load(x_base[None, :] + ((idx_tokens - VAL) * stride_x_token)[:, None], mask_x,
                       other=0.0)
    new_conv_state = tl.where(mask, conv_state, loaded_x)
    # every thread must be done reading this line (here and in the conv) before any overwrites it
    tl.debug_barrier()
    tl.store(s_base[None, :] + (idx_tokens * stride_s_tok)[:, None], new_conv_state,
             (idx_tokens < state_len)[:, None] & mask_f[None, :])


@triton.jit
def _causal_conv1d_fwd_kernel(
    x_ptr, w_ptr, bias_ptr, conv_states_ptr, cache_indices_ptr, has_initial_state_ptr,
    query_start_loc_ptr, o_ptr, dim,
    stride_x_dim, stride_x_token, stride_w_dim, stride_w_width,
    stride_istate_seq, stride_istate_dim, stride_istate_token, stride_o_dim, stride_o_token,
    pad_slot_id,
    HAS_BIAS: tl.constexpr, KERNEL_WIDTH: tl.constexpr, SILU_ACTIVATION: tl.constexpr,
    NP2_STATELEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BF16_RTNE: tl.constexpr,
):
    # one program = one sequence x BLOCK_N channels, walking the sequence BLOCK_M tokens at a time
    idx_seq = tl.program_id(0)
    idx_feats = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_f = idx_feats < dim
    cache_line = tl.load(cache_indices_ptr + idx_seq).to(tl.int64)
    if cache_line == pad_slot_id:
        return
    start = tl.load(query_start_loc_ptr + idx_seq).to(tl.int64)
    seqlen = tl.load(query_start_loc_ptr + idx_seq + 1).to(tl.int64) - start
    use_history = tl.load(has_initial_state_ptr + idx_seq) != 0
    state_len = KERNEL_WIDTH - 1  # prefill keeps only what the next step's conv needs
    x_base = x_ptr + start * stride_x_token + idx_feats * stride_x_dim
    s_base = conv_states_ptr + cache_line * stride_istate_seq + idx_feats * stride_istate_dim
    w_base = w_ptr + idx_feats * stride_w_dim
    o_base = o_ptr + start * stride_o_token + idx_feats * stride_o_dim
    if HAS_BIAS:
        bias = tl.load(bias_ptr + idx_feats, mask_f, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # a while loop, not `for m0 in range(0, seqlen, BLOCK_M)`: triton 3.6's interpreter (torch
    # 2.11's pin) cannot take a loaded value as a range bound; compiled, both are the same loop
    m0 = 0
    while m0 < seqlen:
        idx_tokens = m0 + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32) + bias[None, :]
        acc = _conv_tile(acc, x_base, stride_x_token, s_base, stride_istate_token, w_base,
                         stride_w_width, idx_tokens, seqlen, state_len, use_history, mask_f,
                         KERNEL_WIDTH)
        if SILU_ACTIVATION:
            acc = acc / (1.0 + tl.exp(-acc))
        tl.store(o_base[None, :] + (idx_tokens * stride_o_token)[:, None],
                 cast_to(acc, o_ptr.dtype.element_ty, BF16_RTNE), (idx_tokens < seqlen)[:, None]
                 & mask_f[None, :])
        m0 += BLOCK_M
    # a sequence shorter than state_len keeps the tail of its old state (or zeros): VAL > 0
    _roll_conv_state(x_base, stride_x_token, s_base, stride_istate_token, seqlen, state_len,
                     seqlen, use_history, mask_f, NP2_STATELEN)


@triton.jit
def _causal_conv1d_update_kernel(
    x_ptr, w_ptr, bias_ptr, conv_state_ptr, conv_state_indices_ptr, num_accepted_tokens_ptr,
    query_start_loc_ptr, o_ptr, dim, seqlen, state_len,
    stride_x_seq, stride_x_dim, stride_x_token, stride_w_dim, stride_w_width,
    stride_conv_state_seq, stride_conv_state_dim, stride_conv_state_tok,
    stride_o_seq, stride_o_dim, stride_o_token,
    pad_slot_id,
    HAS_BIAS: tl.constexpr, KERNEL_WIDTH: tl.constexpr, SILU_ACTIVATION: tl.constexpr,
    IS_VARLEN: tl.constexpr, IS_SPEC_DECODING: tl.constexpr, NP2_STATELEN: tl.constexpr,
    NP2_SEQLEN: tl.constexpr, BLOCK_N: tl.constexpr, BF16_RTNE: tl.constexpr,
):
    idx_seq = tl.program_id(0)
    idx_feats = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_f = idx_feats < dim
    cache_line = tl.load(conv_state_indices_ptr + idx_seq).to(tl.int64)
    if cache_line == pad_slot_id:
        return
    if IS_VARLEN:
        query_start_index = tl.load(query_start_loc_ptr + idx_seq).to(tl.int64)
        query_end_index = tl.load(query_start_loc_ptr + idx_seq + 1).to(tl.int64)
        # seed §16: seqlen and state_len arrive sized for max_query_len; shrink both by the
        # tokens this sequence lacks so VAL = state_len - seqlen stays the same for every sequence
        state_len = state_len - (seqlen - (query_end_index - query_start_index))
        seqlen = query_end_index - query_start_index
        x_offset = query_start_index * stride_x_token
        o_offset = query_start_index * stride_o_token
    else:
        x_offset = idx_seq * stride_x_seq
        o_offset = idx_seq * stride_o_seq
    if seqlen == 0:
        return
    if IS_SPEC_DECODING:
        # after the last step the state was [h2..hM, d1..dN]; accepting k drafts makes the true
        # history the width-1 slots starting at k - 1
        conv_state_token_offset = tl.load(num_accepted_tokens_ptr + idx_seq).to(tl.int64) - 1
        src_shift = conv_state_token_offset + 1  # slide the window by one step, not by seqlen
    else:
        conv_state_token_offset = 0
        src_shift = seqlen
    x_base = x_ptr + x_offset + idx_feats * stride_x_dim
    s_base = conv_state_ptr + cache_line * stride_conv_state_seq + idx_feats * stride_conv_state_dim
    if HAS_BIAS:
        bias = tl.load(bias_ptr + idx_feats, mask_f, other=0.0).to(tl.float32)
    else:
        bias = tl.zeros((BLOCK_N,), dtype=tl.float32)
    idx_tokens = tl.arange(0, NP2_SEQLEN)
    acc = tl.zeros((NP2_SEQLEN, BLOCK_N), dtype=tl.float32) + bias[None, :]
    acc = _conv_tile(acc, x_base, stride_x_token, s_base, stride_conv_state_tok,
                     w_ptr + idx_feats * stride_w_dim, stride_w_width, idx_tokens, seqlen,
                     conv_state_token_offset + KERNEL_WIDTH - 1, True, mask_f, KERNEL_WIDTH)
    if SILU_ACTIVATION:
        acc = acc / (1.0 + tl.exp(-acc))
    tl.store(o_ptr + o_offset + (idx_feats * stride_o_dim)[None, :]
             + (idx_tokens * stride_o_token)[:, None],
             cast_to(acc, o_ptr.dtype.element_ty, BF16_RTNE), (idx_tokens < seqlen)[:, None]
             & mask_f[None, :])
    _roll_conv_state(x_base, stride_x_token, s_base, stride_conv_state_tok, seqlen, state_len,
                     src_shift, True, mask_f, NP2_STATELEN)


# --------------------------------------------------------------------------- argument checks


def _silu(activation: bool | str | None) -> bool:
    if activation is None or activation is False:
        return False
    if activation is True or activation in ("silu", "swish"):
        return True
    raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")


def _check_same(ref: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and (t.dtype != ref.dtype or t.device != ref.device):
            raise ValueError(f"{name} is {t.dtype} on {t.device}, expected x's {ref.dtype} on "
                             f"{ref.device}")


def _check_index(name: str, t: torch.Tensor | None, length: int, device: torch.device) -> None:
    if t is None:
        return
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dim() != 1 or t.numel() != length:
        raise ValueError(f"{name} must be a 1-D integer tensor of length {length}, "
                         f"got {t.dtype} of shape {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _check_query_start_loc(query_start_loc: torch.Tensor, device: torch.device) -> int:
    batch = max(query_start_loc.numel() - 1, 1)  # a bad shape fails the check below
    _check_index("query_start_loc [batch + 1]", query_start_loc, batch + 1, device)
    return batch


def _check_weight(weight: torch.Tensor, bias: torch.Tensor | None, dim: int) -> int:
    if weight.dim() != 2 or weight.shape[0] != dim or weight.shape[1] < 2:
        raise ValueError(f"weight must be (dim={dim}, width>=2), got {tuple(weight.shape)}")
    if bias is not None and tuple(bias.shape) != (dim,):
        raise ValueError(f"bias must be (dim={dim},), got {tuple(bias.shape)}")
    return weight.shape[1]


def _check_state(name: str, state: torch.Tensor, dim: int, state_len: int) -> None:
    if state.dim() != 3 or state.shape[1] != dim or state.shape[2] < state_len:
        raise ValueError(f"{name} must be (num_cache_lines, dim={dim}, >={state_len}), "
                         f"got {tuple(state.shape)}")


def _check_fn_args(x, weight, bias, conv_states, query_start_loc, cache_indices,
                   has_initial_state) -> tuple[int, int]:
    if x.dim() != 2:
        raise ValueError(f"x must be (dim, total_tokens), got {tuple(x.shape)}")
    batch = _check_query_start_loc(query_start_loc, x.device)
    _check_index("cache_indices", cache_indices, batch, x.device)
    _check_index("has_initial_state", has_initial_state, batch, x.device)
    width = _check_weight(weight, bias, x.shape[0])
    _check_state("conv_states", conv_states, x.shape[0], width - 1)
    _check_same(x, weight=weight, bias=bias, conv_states=conv_states)
    return batch, width


def _check_update_args(x, conv_state, weight, bias, conv_state_indices, num_accepted_tokens,
                       query_start_loc, max_query_len) -> tuple[int, int, int, int]:
    """Returns (batch, seqlen, width, state_len) with vLLM's effective state_len."""
    if query_start_loc is None:
        if x.dim() not in (2, 3):
            raise ValueError(f"x must be (batch, dim) or (batch, dim, seqlen), got {x.shape}")
        batch, seqlen = x.shape[0], (x.shape[2] if x.dim() == 3 else 1)
    else:
        if x.dim() != 2:
            raise ValueError(f"with query_start_loc, x must be (num_tokens, dim), got {x.shape}")
        batch, seqlen = _check_query_start_loc(query_start_loc, x.device), max_query_len
        if max_query_len < 1:
            raise ValueError(f"with query_start_loc, max_query_len must be >= 1, not {seqlen}")
        if num_accepted_tokens is None and max_query_len > 1:
            # the state_len correction assumes the spec-decode state_len (seed §16); without it
            # a shorter sequence would write a scrambled state, so refuse (vLLM never calls this)
            raise ValueError("varlen causal_conv1d_update with max_query_len > 1 needs "
                             "num_accepted_tokens (spec decoding); prefill is causal_conv1d_fn")
    dim = x.shape[1]
    width = _check_weight(weight, bias, dim)
    # spec decode keeps the width-1 history plus seqlen-1 drafts so a later step can back off
    state_len = width - 1 + (seqlen - 1 if num_accepted_tokens is not None else 0)
    _check_state("conv_state", conv_state, dim, state_len)
    _check_index("conv_state_indices", conv_state_indices, batch, x.device)
    _check_index("num_accepted_tokens", num_accepted_tokens, batch, x.device)
    _check_same(x, weight=weight, bias=bias, conv_state=conv_state)
    return batch, seqlen, width, state_len


def _block_n(dim: int) -> int:
    return min(256, triton.next_power_of_2(dim))


# --------------------------------------------------------------------------- Triton launches


def causal_conv1d_fn(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: bool | str | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    """Varlen prefill: x (dim, total_tokens) -> out (dim, total_tokens); updates conv_states."""
    require_triton("causal_conv1d_fn")
    check_launchable("x", x)
    batch, width = _check_fn_args(x, weight, bias, conv_states, query_start_loc, cache_indices,
                                  has_initial_state)
    silu = _silu(activation)
    if cache_indices is None:
        cache_indices = torch.arange(batch, dtype=torch.int32, device=x.device)
    if has_initial_state is None:
        has_initial_state = torch.zeros(batch, dtype=torch.bool, device=x.device)
    out = torch.zeros_like(x)  # padded sequences are skipped; zeros rather than garbage
    dim = x.shape[0]
    block_n = _block_n(dim)
    _causal_conv1d_fwd_kernel[(batch, triton.cdiv(dim, block_n))](
        x, weight, bias, conv_states, cache_indices, has_initial_state, query_start_loc, out, dim,
        *x.stride(), *weight.stride(), *conv_states.stride(), *out.stride(), pad_slot_id,
        HAS_BIAS=bias is not None, KERNEL_WIDTH=width, SILU_ACTIVATION=silu,
        NP2_STATELEN=triton.next_power_of_2(width - 1), BLOCK_M=16, BLOCK_N=block_n,
        BF16_RTNE=needs_bf16_rtne(out),
    )
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: bool | str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    """Decode: x (batch, dim), (batch, dim, seqlen) or varlen (num_tokens, dim); out like x."""
    require_triton("causal_conv1d_update")
    check_launchable("x", x)
    batch, seqlen, width, state_len = _check_update_args(
        x, conv_state, weight, bias, conv_state_indices, num_accepted_tokens, query_start_loc,
        max_query_len)
    silu = _silu(activation)
    if conv_state_indices is None:
        conv_state_indices = torch.arange(batch, dtype=torch.int32, device=x.device)
    unsqueeze = query_start_loc is None and x.dim() == 2
    xk = x.unsqueeze(-1) if unsqueeze else x
    out = torch.zeros_like(xk)
    if query_start_loc is None:
        x_strides, o_strides = xk.stride(), out.stride()
    else:  # (num_tokens, dim): no sequence stride, tokens are addressed through query_start_loc
        x_strides = (0, xk.stride(1), xk.stride(0))
        o_strides = (0, out.stride(1), out.stride(0))
    dim = x.shape[1]
    block_n = _block_n(dim)
    _causal_conv1d_update_kernel[(batch, triton.cdiv(dim, block_n))](
        xk, weight, bias, conv_state, conv_state_indices, num_accepted_tokens, query_start_loc,
        out, dim, seqlen, state_len, *x_strides, *weight.stride(), *conv_state.stride(),
        *o_strides, pad_slot_id,
        HAS_BIAS=bias is not None, KERNEL_WIDTH=width, SILU_ACTIVATION=silu,
        IS_VARLEN=query_start_loc is not None, IS_SPEC_DECODING=num_accepted_tokens is not None,
        NP2_STATELEN=triton.next_power_of_2(state_len), NP2_SEQLEN=triton.next_power_of_2(seqlen),
        BLOCK_N=block_n, BF16_RTNE=needs_bf16_rtne(out),
    )
    return out.squeeze(-1) if unsqueeze else out


# --------------------------------------------------------------------------- torch references


def _conv_stream(stream: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 silu: bool) -> torch.Tensor:
    """stream (dim, width-1 + n) = [history | tokens] -> (dim, n), in fp32."""
    width, n = weight.shape[1], stream.shape[1] - weight.shape[1] + 1
    out = sum(weight[:, j : j + 1].float() * stream[:, j : j + n].float() for j in range(width))
    if bias is not None:
        out = out + bias.float()[:, None]
    return torch.nn.functional.silu(out) if silu else out


def _rolled_state(old: torch.Tensor, x_seq: torch.Tensor, state_len: int,
                  src_shift: int) -> torch.Tensor:
    """The new conv_state slots [0, state_len): slot s holds old[s + src_shift] when s < VAL,
    else x_seq[s - VAL], VAL = state_len - seqlen (seed §16). old/x_seq are (dim, ...)."""
    VAL = state_len - x_seq.shape[1]
    new = torch.zeros_like(old[:, :state_len])
    for slot in range(state_len):
        if slot < VAL:
            new[:, slot] = old[:, slot + src_shift]
        else:
            new[:, slot] = x_seq[:, slot - VAL]  # 0 <= slot - VAL < seqlen
    return new


def causal_conv1d_fn_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_states: torch.Tensor,
    query_start_loc: torch.Tensor,
    cache_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    activation: bool | str | None = "silu",
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    """Plain-torch causal_conv1d_fn, one sequence at a time."""
    batch, width = _check_fn_args(x, weight, bias, conv_states, query_start_loc, cache_indices,
                                  has_initial_state)
    silu, state_len = _silu(activation), width - 1
    out = torch.zeros_like(x)
    # host lists, read once (on a GPU each element read would be a device sync)
    qsl = query_start_loc.tolist()
    lines = list(range(batch)) if cache_indices is None else cache_indices.tolist()
    initial = [False] * batch if has_initial_state is None else has_initial_state.tolist()
    for i in range(batch):
        line = lines[i]
        if line == pad_slot_id:
            continue
        start, end = qsl[i], qsl[i + 1]
        x_seq = x[:, start:end]
        use_history = bool(initial[i])
        old = conv_states[line, :, :state_len]
        history = old if use_history else torch.zeros_like(old)
        stream = torch.cat([history, x_seq], dim=1)
        out[:, start:end] = _conv_stream(stream, weight, bias, silu).to(x.dtype)
        # the last state_len inputs of [history | x_seq]: same as the kernel's VAL roll
        conv_states[line, :, :state_len] = stream[:, stream.shape[1] - state_len :]
    return out


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: bool | str | None = None,
    conv_state_indices: torch.Tensor | None = None,
    num_accepted_tokens: torch.Tensor | None = None,
    query_start_loc: torch.Tensor | None = None,
    max_query_len: int = -1,
    pad_slot_id: int = PAD_SLOT_ID,
) -> torch.Tensor:
    """Plain-torch causal_conv1d_update, one sequence at a time, state rolled slot by slot."""
    batch, seqlen, width, state_len = _check_update_args(
        x, conv_state, weight, bias, conv_state_indices, num_accepted_tokens, query_start_loc,
        max_query_len)
    silu = _silu(activation)
    out = torch.zeros_like(x)
    # host lists, read once (on a GPU each element read would be a device sync)
    lines = list(range(batch)) if conv_state_indices is None else conv_state_indices.tolist()
    qsl = None if query_start_loc is None else query_start_loc.tolist()
    accepted = None if num_accepted_tokens is None else num_accepted_tokens.tolist()
    for i in range(batch):
        line = lines[i]
        if line == pad_slot_id:
            continue
        if qsl is not None:  # x (num_tokens, dim)
            start, end = qsl[i], qsl[i + 1]
            x_seq, out_seq = x[start:end].T, out[start:end].T
            sl = state_len - (seqlen - x_seq.shape[1])  # seed §16 state_len correction
        else:  # views (dim, seqlen) into x and out
            x_seq, out_seq = (x[i], out[i]) if x.dim() == 3 else (x[i][:, None], out[i][:, None])
            sl = state_len
        if x_seq.shape[1] == 0:
            continue
        offset = 0 if accepted is None else accepted[i] - 1
        old = conv_state[line]
        stream = torch.cat([old[:, offset : offset + width - 1], x_seq], dim=1)
        out_seq.copy_(_conv_stream(stream, weight, bias, silu))
        src_shift = x_seq.shape[1] if num_accepted_tokens is None else offset + 1
        conv_state[line, :, :sl] = _rolled_state(old, x_seq, sl, src_shift)
    return out
