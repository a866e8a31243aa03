"""Custom ops in namespace `minivllm`, with the in-place signatures of vLLM's `_C` ops.

Each op is registered as vLLM registers its own (`direct_register_custom_op`, below): a schema that
declares what it mutates, a kernel for the CPU and CUDA keys, and a fake (meta) implementation, so
Dynamo can trace it without running it and functionalization wraps it in `auto_functionalized(...)`
exactly as it wraps vLLM's ops (seed §1). On CPU an op runs the plain torch reference from
`minivllm_compile.kernels`; on CUDA it runs the Triton kernel beside it.

The two mixer ops (attention, short conv) are opaque: they take a `layer_name` and read the layer's
cache and the step's metadata from the forward context. They are the default splitting ops.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.library import Library, infer_schema

from minivllm_compile.forward_context import get_forward_context
from minivllm_compile.kernels import (
    activation,
    causal_conv1d,
    layernorm,
    paged_attention,
    qk_norm_rope,
    quant_fp8,
)
from minivllm_compile.kernels import rotary_embedding as rope
from minivllm_compile.kernels._compat import HAS_TRITON

# --- registration ---------------------------------------------------------------------------

# the library holding the ops (vLLM: `vllm_lib = Library("vllm", "FRAGMENT")`); an op is
# registered for as long as this object lives
minivllm_lib = Library("minivllm", "FRAGMENT")


def direct_register_custom_op(
    op_name: str,
    op_func: Callable,
    mutates_args: list[str] | None = None,
    fake_impl: Callable | None = None,
    target_lib: Library | None = None,
    dispatch_key: str | None = None,
    tags: tuple[torch.Tag, ...] = (),
) -> None:
    """vLLM's helper of the same name (vllm/utils/torch_utils.py): define `op_name` with the schema
    inferred from `op_func`'s signature, register `op_func` as the backend kernel and `fake_impl`
    for tracing. Nothing is registered at the Autograd or ADInplaceOrView keys, unlike
    `torch.library.custom_op`, whose autograd wrapper (an autograd.Function) and version-counter
    kernel run on every call; vLLM's docstring: custom_op "can have significant overhead because
    it needs to consider complicated dispatching logic". The dispatcher's autograd fallback runs
    at Autograd instead, and ADInplaceOrView falls through, as for vLLM's `_C` ops.

    Two differences from vLLM's helper: vLLM registers for its platform's key, and tensors here may
    be on the CPU or a GPU, so with no `dispatch_key` the kernel goes to both CPU and CUDA; and the
    body runs below autograd (`_below_autograd`), because the bodies here are Python standing in for
    vLLM's `_C` kernels (vLLM's own helper leaves a Python body under autograd, and its models run
    under inference_mode)."""
    schema_str = infer_schema(op_func, mutates_args=mutates_args or [])
    lib = target_lib or minivllm_lib
    lib.define(op_name + schema_str, tags=tags)
    kernel = _below_autograd(op_func)
    for key in (dispatch_key,) if dispatch_key else ("CPU", "CUDA"):
        lib.impl(op_name, kernel, dispatch_key=key)
    if fake_impl is not None:
        lib._register_fake(op_name, fake_impl)


def _below_autograd(op_func: Callable) -> Callable:
    # The body runs below autograd, where a C++ kernel runs. vLLM's `_C` kernels write through data
    # pointers that autograd never sees; these bodies call torch ops on the arguments (the CPU
    # references write with copy_, add_ and slice assignment), and each would enter the dispatcher
    # again at its Autograd key. With grad on, RoPE's write into `q`, a view split from `qkv`, then
    # breaks autograd's rule for such views ("... is a view and is being modified inplace. This view
    # is the output of a function that returns multiple views"). Below autograd, the writes record
    # nothing and bump no version counter, as a C++ kernel's.
    @functools.wraps(op_func)
    def kernel(*args, **kwargs):
        with torch._C._AutoDispatchBelowADInplaceOrView():
            return op_func(*args, **kwargs)

    return kernel


def _returns_nothing(*args, **kwargs) -> None:
    # The fake of every op here: each returns nothing (its results are the arguments it writes,
    # whose metadata the caller already has). No checks: fake tensors have no values, and the real
    # op raises the same errors at run time.
    return None


def _register(*, mutates_args: list[str]):
    """`@_register(mutates_args=[...])` above `def rms_norm(...)`: register the function as
    `minivllm::rms_norm` and bind the module's `rms_norm` to `torch.ops.minivllm.rms_norm`, so a
    call through either goes through the dispatcher (and never straight into the Python body)."""

    def register(op_func: Callable) -> torch._ops.OpOverloadPacket:
        direct_register_custom_op(op_func.__name__, op_func, mutates_args,
                                  fake_impl=_returns_nothing)
        return getattr(torch.ops.minivllm, op_func.__name__)

    return register


# --- argument checks ------------------------------------------------------------------------

def _use_triton(t: Tensor) -> bool:
    return t.is_cuda and HAS_TRITON


def _check(op: str, cond: bool, msg: str | Callable[[], str]) -> None:
    # these run on every call of every op, every step: a message is formatted only when raised
    if not cond:
        raise ValueError(f"minivllm::{op}: {msg() if callable(msg) else msg}")


def _check_like(op: str, tensors: dict[str, Tensor | None]) -> None:
    """Every named tensor on one device with one dtype; the error names the odd one out."""
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        _check(op, t.device == first.device,
               lambda: f"`{name}` is on {t.device} but `{first_name}` is on "
                       f"{first.device}; move them to one device")
        _check(op, t.dtype == first.dtype,
               lambda: f"`{name}` is {t.dtype} but `{first_name}` is "
                       f"{first.dtype}; cast them to one dtype")


def _check_norm(op: str, x: Tensor, weight: Tensor) -> None:
    _check(op, weight.dim() == 1 and weight.shape[0] == x.shape[-1],
           lambda: f"`weight` has shape {tuple(weight.shape)} but the hidden size "
                   f"of `input` is {x.shape[-1]}")


# --- normalisation --------------------------------------------------------------------------

@_register(mutates_args=["out"])
def rms_norm(out: Tensor, input: Tensor, weight: Tensor, eps: float) -> None:
    _check_like("rms_norm", {"input": input, "out": out, "weight": weight})
    _check("rms_norm", out.shape == input.shape,
           lambda: f"`out` has shape {tuple(out.shape)} but `input` has {tuple(input.shape)}; "
                   "pass torch.empty_like(input)")
    _check_norm("rms_norm", input, weight)
    (layernorm.rms_norm_triton if _use_triton(input)
     else layernorm.rms_norm_ref)(out, input, weight, eps)


@_register(mutates_args=["input", "residual"])
def fused_add_rms_norm(input: Tensor, residual: Tensor, weight: Tensor, eps: float) -> None:
    _check_like("fused_add_rms_norm", {"input": input, "residual": residual, "weight": weight})
    _check("fused_add_rms_norm", residual.shape == input.shape,
           lambda: f"`residual` has shape {tuple(residual.shape)} but "
                   f"`input` has {tuple(input.shape)}")
    _check_norm("fused_add_rms_norm", input, weight)
    fn = layernorm.fused_add_rms_norm_triton if _use_triton(
        input) else layernorm.fused_add_rms_norm_ref
    fn(input, residual, weight, eps)


# --- rotary embedding -----------------------------------------------------------------------

def _check_rope(
    op: str, positions: Tensor, query: Tensor, head_size: int, cos_sin_cache: Tensor,
    key: Tensor | None = None,
) -> None:
    """Run before the path is chosen, so the reference and the Triton kernel refuse alike."""
    _check(op, positions.dtype in (torch.int32, torch.int64),
           lambda: f"`positions` must be an integer tensor, got {positions.dtype}")
    _check(op, positions.device == query.device,
           lambda: f"`positions` is on {positions.device} but `query` is on {query.device}")
    _check(op, positions.numel() == query.shape[0],
           lambda: f"`positions` has {positions.numel()} entries but `query` "
                   f"has {query.shape[0]} tokens")
    # the reference would broadcast one query token's position over every key token
    _check(op, key is None or (key.dim() > 0 and key.shape[0] == query.shape[0]),
           lambda: f"`key` has {key.shape[0] if key.dim() else 0} tokens but `query` has "
           f"{query.shape[0]} (and `positions` as many); key token i is rotated by positions[i], "
           "so pass one key per token")
    _check(op, cos_sin_cache.shape[-1] <= head_size,
           lambda: f"`cos_sin_cache` rotates {cos_sin_cache.shape[-1]} dims, more "
                   f"than head_size={head_size}")
    # A value check, so here and not in the fake (fake tensors have no values). Reading min/max
    # syncs a GPU, a cost this teaching project accepts; not while capturing a CUDA graph (illegal).
    if positions.numel() and not (positions.is_cuda and torch.cuda.is_current_stream_capturing()):
        lo, hi = torch.stack(torch.aminmax(positions)).tolist()  # one sync, not two
        rows = cos_sin_cache.shape[0]
        _check(op, lo >= 0 and hi < rows,
               lambda: f"`positions` span [{lo}, {hi}] but `cos_sin_cache` has {rows} rows "
               f"(positions 0..{rows - 1}); build a larger cache (raise max_position_embeddings) "
               f"or pass positions below {rows}")


@_register(mutates_args=["query", "key"])
def rotary_embedding(
    positions: Tensor, query: Tensor, key: Tensor | None, head_size: int,
    cos_sin_cache: Tensor, is_neox: bool,
) -> None:
    _check_like("rotary_embedding", {"query": query, "key": key})
    _check_rope("rotary_embedding", positions, query, head_size, cos_sin_cache, key)
    if _use_triton(query):  # positions were checked above: no second host sync
        rope.rotary_embedding_triton(positions, query, key, head_size, cos_sin_cache, is_neox,
                                     check_positions_in_range=False)
    else:
        rope.rotary_embedding_ref(positions, query, key, head_size, cos_sin_cache, is_neox)


@_register(mutates_args=["qkv"])
def fused_qk_norm_rope(
    qkv: Tensor, num_heads_q: int, num_heads_k: int, num_heads_v: int, head_dim: int, eps: float,
    q_weight: Tensor, k_weight: Tensor, cos_sin_cache: Tensor, is_neox: bool, position_ids: Tensor,
) -> None:
    op = "fused_qk_norm_rope"
    _check_like(op, {"qkv": qkv, "q_weight": q_weight, "k_weight": k_weight})
    width = (num_heads_q + num_heads_k + num_heads_v) * head_dim
    _check(op, qkv.dim() == 2 and qkv.shape[1] == width,
           lambda: f"`qkv` has shape {tuple(qkv.shape)}, expected [num_tokens, {width}] "
           f"(({num_heads_q}+{num_heads_k}+{num_heads_v}) heads x head_dim {head_dim})")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        _check(op, w.shape == (head_dim,), lambda: f"`{name}` has shape {tuple(w.shape)}, expected "
                                                   f"({head_dim},)")
    _check_rope(op, position_ids, qkv, head_dim, cos_sin_cache)
    args = (qkv, num_heads_q, num_heads_k, num_heads_v, head_dim, eps, q_weight, k_weight,
            cos_sin_cache, is_neox, position_ids)
    if _use_triton(qkv):  # positions were checked above: no second host sync
        qk_norm_rope.fused_qk_norm_rope_triton(*args, check_positions_in_range=False)
    else:
        qk_norm_rope.fused_qk_norm_rope_ref(*args)


# --- activation -----------------------------------------------------------------------------

@_register(mutates_args=["out"])
def silu_and_mul(out: Tensor, input: Tensor) -> None:
    _check_like("silu_and_mul", {"input": input, "out": out})
    d = input.shape[-1] // 2
    _check("silu_and_mul", input.shape[-1] % 2 == 0 and out.shape == (*input.shape[:-1], d),
           lambda: f"`out` has shape {tuple(out.shape)}; for `input` of shape {tuple(input.shape)} "
           f"it must be {(*input.shape[:-1], d)} (input holds gate and up halves side by side)")
    (activation.silu_and_mul_triton if _use_triton(input)
     else activation.silu_and_mul_ref)(out, input)


# --- static per-tensor FP8 quantization, alone and fused (vLLM's _C ops of the same names) ------
#
# `result` is float8_e4m3fn; `scale` one float32 value (per tensor, static: calibrated offline and
# stored in the checkpoint as `input_scale`); result = fp8(clamp(x * (1 / scale), -448, 448)).
# vLLM 0.34's static_scaled_fp8_quant also takes an optional group_shape (per-channel and group
# scales); per tensor is the only scheme here, so the argument is left out.

_QUANT_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _use_triton_fp8(t: Tensor) -> bool:
    # Triton converts to e4m3fn only on GPUs with FP8 hardware (compute capability 8.9+: Ada,
    # Hopper and newer); older GPUs run the reference
    return _use_triton(t) and (not t.is_cuda
                               or torch.cuda.get_device_capability(t.device) >= (8, 9))


def _check_quant(op: str, result: Tensor, input: Tensor, scale: Tensor, shape: tuple) -> None:
    _check(op, result.dtype == quant_fp8.FP8_DTYPE,
           lambda: f"`result` is {result.dtype} but must be {quant_fp8.FP8_DTYPE}; allocate it "
           f"with torch.empty(..., dtype={quant_fp8.FP8_DTYPE})")
    _check(op, input.dtype in _QUANT_INPUT_DTYPES,
           lambda: f"`input` is {input.dtype}; it must be one of {list(_QUANT_INPUT_DTYPES)}")
    _check(op, tuple(result.shape) == tuple(shape),
           lambda: f"`result` has shape {tuple(result.shape)} but must be {tuple(shape)} for "
           f"`input` of shape {tuple(input.shape)}")
    _check(op, scale.numel() == 1,
           lambda: f"`scale` has {scale.numel()} elements (shape {tuple(scale.shape)}); static "
           "per-tensor quantization takes a 1-element float32 tensor")
    _check(op, scale.dtype == torch.float32, lambda: f"`scale` is {scale.dtype}; it must be "
                                                     "torch.float32")
    for name, t in (("result", result), ("scale", scale)):
        _check(op, t.device == input.device,
               lambda: f"`{name}` is on {t.device} but `input` is on "
                       f"{input.device}; move them to one device")


@_register(mutates_args=["result"])
def static_scaled_fp8_quant(result: Tensor, input: Tensor, scale: Tensor) -> None:
    _check_quant("static_scaled_fp8_quant", result, input, scale, input.shape)
    fn = quant_fp8.static_scaled_fp8_quant_triton if _use_triton_fp8(
        input) else quant_fp8.static_scaled_fp8_quant_ref
    fn(result, input, scale)


@_register(mutates_args=["result"])
def rms_norm_static_fp8_quant(
    result: Tensor, input: Tensor, weight: Tensor, scale: Tensor, epsilon: float
) -> None:
    """rms_norm then static_scaled_fp8_quant, in one pass over the row."""
    op = "rms_norm_static_fp8_quant"
    _check_like(op, {"input": input, "weight": weight})
    _check_norm(op, input, weight)
    _check_quant(op, result, input, scale, input.shape)
    fn = (quant_fp8.rms_norm_static_fp8_quant_triton if _use_triton_fp8(input)
          else quant_fp8.rms_norm_static_fp8_quant_ref)
    fn(result, input, weight, scale, epsilon)


@_register(mutates_args=["result", "residual"])
def fused_add_rms_norm_static_fp8_quant(
    result: Tensor, input: Tensor, residual: Tensor, weight: Tensor, scale: Tensor, epsilon: float
) -> None:
    """residual <- input + residual; result <- quant(rms_norm(residual)). `input` is not written
    (fused_add_rms_norm writes the norm there; here the norm goes, quantized, to `result`)."""
    op = "fused_add_rms_norm_static_fp8_quant"
    _check_like(op, {"input": input, "residual": residual, "weight": weight})
    _check(op, residual.shape == input.shape,
           lambda: f"`residual` has shape {tuple(residual.shape)} but "
                   f"`input` has {tuple(input.shape)}")
    _check_norm(op, input, weight)
    _check_quant(op, result, input, scale, input.shape)
    fn = (quant_fp8.fused_add_rms_norm_static_fp8_quant_triton if _use_triton_fp8(input)
          else quant_fp8.fused_add_rms_norm_static_fp8_quant_ref)
    fn(result, input, residual, weight, scale, epsilon)


@_register(mutates_args=["result"])
def silu_and_mul_quant(result: Tensor, input: Tensor, scale: Tensor) -> None:
    """silu_and_mul then static_scaled_fp8_quant: result [..., d] fp8 from input [..., 2d]."""
    op = "silu_and_mul_quant"
    _check(op, input.dim() > 0 and input.shape[-1] % 2 == 0,
           lambda: f"`input` has shape {tuple(input.shape)}; its last dimension must be even (gate "
           "and up halves side by side)")
    _check_quant(op, result, input, scale, (*input.shape[:-1], input.shape[-1] // 2))
    fn = quant_fp8.silu_and_mul_quant_triton if _use_triton_fp8(
        input) else quant_fp8.silu_and_mul_quant_ref
    fn(result, input, scale)


# --- the opaque mixers: the default splitting ops ---------------------------------------------

def _layer(op: str, layer_name: str, ctx):
    layers = ctx.no_compile_layers
    if layer_name not in layers:
        raise KeyError(f"minivllm::{op}: no layer named {layer_name!r} in the forward context "
                       f"(known: {sorted(layers)[:6]}{' ...' if len(layers) > 6 else ''})")
    return layers[layer_name]


@_register(mutates_args=["output"])
def unified_attention_with_output(
    query: Tensor, key: Tensor, value: Tensor, output: Tensor, layer_name: str
) -> None:
    """Write this step's keys/values into the layer's paged cache, then attend (vLLM's op of the
    same name). query/output [num_tokens, num_heads * head_size]; key/value with num_kv_heads."""
    op = "unified_attention_with_output"
    _check_like(op, {"query": query, "key": key, "value": value, "output": output})
    _check(op, output.shape == query.shape,
           lambda: f"`output` has shape {tuple(output.shape)} but `query` has {tuple(query.shape)}")
    _check(op, key.shape == value.shape and key.shape[0] == query.shape[0],
           lambda: f"`key` {tuple(key.shape)} and `value` {tuple(value.shape)} must match each "
           f"other and have {query.shape[0]} tokens like `query`")
    ctx = get_forward_context()
    layer = _layer(op, layer_name, ctx)
    md = ctx.attn_metadata
    if md is None:  # dummy run (vLLM's profile run): no cache, no metadata
        output.zero_()
        return
    _check(op, md.num_tokens == query.shape[0],
           lambda: f"the batch has {query.shape[0]} tokens but the attention metadata "
                   f"describes {md.num_tokens}")
    hd = layer.head_size
    paged_attention.reshape_and_cache_ref(
        key.view(-1, layer.num_kv_heads, hd), value.view(-1, layer.num_kv_heads, hd),
        layer.kv_cache, md.slot_mapping)
    out = paged_attention.paged_attention_ref(
        query.view(-1, layer.num_heads, hd), layer.kv_cache, md.query_start_loc, md.seq_lens,
        md.block_table, layer.scale)
    output.copy_(out.view_as(output))
    # CUDA-graph padding: in no sequence, left undefined by the kernel
    output[md.num_real_tokens:].zero_()


@_register(mutates_args=["output"])
def short_conv(hidden_states: Tensor, output: Tensor, layer_name: str) -> None:
    """LFM2's gated short convolution as one opaque op (vLLM's `short_conv`):
    B, C, x = in_proj(h); y = C * causal_conv1d(B * x); output = out_proj(y).
    The conv state of each sequence lives in the layer's conv_state cache, one line per sequence."""
    op = "short_conv"
    _check_like(op, {"hidden_states": hidden_states, "output": output})
    _check(op, output.shape == hidden_states.shape,
           lambda: f"`output` has shape {tuple(output.shape)} but `hidden_states` has "
                   f"{tuple(hidden_states.shape)}")
    ctx = get_forward_context()
    layer = _layer(op, layer_name, ctx)
    md = ctx.attn_metadata
    if md is None:
        output.zero_()
        return
    b_gate, c_gate, x = F.linear(hidden_states, layer.in_proj.weight).chunk(3, dim=-1)
    bx = b_gate * x
    cuda = _use_triton(hidden_states)
    if md.is_decode_only:  # one new token per sequence: roll each state window by one
        update = (causal_conv1d.causal_conv1d_update if cuda
                  else causal_conv1d.causal_conv1d_update_ref)
        n = md.num_real_tokens  # one token per sequence; CUDA-graph padding after them gets zeros
        y = torch.zeros_like(bx)
        y[:n] = update(bx[:n], layer.conv_state, layer.conv_weight, None, None,
                       conv_state_indices=md.state_indices)
    else:  # prefill (possibly continuing a cached prefix): varlen over packed sequences
        fn = causal_conv1d.causal_conv1d_fn if cuda else causal_conv1d.causal_conv1d_fn_ref
        y = fn(bx.transpose(0, 1).contiguous(), layer.conv_weight, None, layer.conv_state,
               md.query_start_loc, cache_indices=md.state_indices,
               has_initial_state=md.context_lens > 0, activation=None).transpose(0, 1)
    output.copy_(layer.out_proj(c_gate * y))  # a RowParallelLinear: it all-reduces under TP

