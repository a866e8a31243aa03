"""The building blocks of both models, each a thin module over one op (vLLM's layers/).

Most blocks allocate their output and call an in-place custom op, exactly as vLLM's CUDA paths do,
so the graph Dynamo captures holds the same `auto_functionalized` nodes vLLM's does. RMSNorm calls
vLLM IR ops instead, as vLLM 0.34's does (minivllm_compile/ir/).
"""

from __future__ import annotations

import torch
from torch import nn

import minivllm_compile.ir.kernels  # noqa: F401  (registers the IR ops' providers)
import minivllm_compile.ops  # noqa: F401  (registers torch.ops.minivllm.*)
from minivllm_compile import ir
from minivllm_compile.config import get_current_compilation_config
from minivllm_compile.config.compilation import AttentionCGSupport
from minivllm_compile.distributed import (
    MergedColumnParallelLinear,
    RowParallelLinear,
    divide,
    get_tensor_model_parallel_world_size,
    set_weight_attrs,
    sharded_weight_loader,
)
from minivllm_compile.kernels.rotary_embedding import compute_cos_sin_cache, rotary_embedding_ref


def use_custom_op(name: str) -> bool:
    """Decided once, when the layer is built, from the config the model is built with."""
    return get_current_compilation_config().custom_op_enabled(name)


class RMSNorm(nn.Module):
    """vLLM 0.34's RMSNorm (model_executor/layers/layernorm.py): both forms call the vLLM IR ops,
    and the IR op priority (CompilationConfig.kernel_config.ir_op_priority) picks the kernel: in
    eager mode when called, in a compiled graph when VllmIRLoweringPass lowers the op's node.
    `custom_ops` no longer chooses it: vLLM's forward_cuda calls forward_native too, except for
    its batch-invariant mode, which this project does not have."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        # vLLM's CustomOp.enabled(), kept for what it still records: both branches are the same
        self.use_custom_op = use_custom_op("rms_norm")

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return ir.ops.rms_norm(x, self.weight, self.eps, None)
        # the residual stream donates x and residual: an in-place provider may write into them
        return ir.ops.fused_add_rms_norm.maybe_inplace(x, residual, self.weight, self.eps, None)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        # vLLM's CustomOp.forward picks forward_cuda or forward_native; for RMSNorm both are this
        return self.forward_native(x, residual)


class SiluAndMul(nn.Module):
    def __init__(self):
        super().__init__()
        self.use_custom_op = use_custom_op("silu_and_mul")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.use_custom_op:
            d = x.shape[-1] // 2
            return torch.nn.functional.silu(x[..., :d]) * x[..., d:]
        out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
        torch.ops.minivllm.silu_and_mul(out, x)
        return out


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, max_position: int, base: float, is_neox_style: bool = True):
        super().__init__()
        self.head_size, self.is_neox_style = head_size, is_neox_style
        # not saved with the weights: it is a function of the config (as in vLLM)
        self.register_buffer(
            "cos_sin_cache", compute_cos_sin_cache(head_size, max_position, base), persistent=False)
        self.use_custom_op = use_custom_op("rotary_embedding")

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        if not self.use_custom_op:  # the reference, on copies: plain torch ops Inductor can fuse
            query, key = query.clone(), key.clone()
            rotary_embedding_ref(positions, query, key, self.head_size, self.cos_sin_cache,
                                 self.is_neox_style)
            return query, key
        torch.ops.minivllm.rotary_embedding(
            positions, query, key, self.head_size, self.cos_sin_cache, self.is_neox_style)
        return query, key


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, prefix: str = "mlp"):
        super().__init__()
        # gate and up stacked into one matmul on load; under TP each rank holds a slice of both
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=False, prefix=f"{prefix}.gate_up_proj",
            return_bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False,
                                           prefix=f"{prefix}.down_proj", return_bias=False)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class Attention(nn.Module):
    """The attention splitting op's module: owns the layer's paged KV cache. The cache is a plain
    attribute, not a buffer: the compiled graph must never see it (it is
    read through layer_name)."""

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, layer_name: str,
                 static_forward_context: dict):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={num_kv_heads}")
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.scale = head_size**-0.5
        self.layer_name = layer_name
        self.kv_cache = torch.empty(0)
        if layer_name in static_forward_context:
            raise ValueError(f"duplicate layer name {layer_name!r}")
        static_forward_context[layer_name] = self

    @staticmethod
    def cudagraph_support(device: torch.device) -> AttentionCGSupport:
        """What a FULL graph can hold of this op (vLLM's AttentionCGSupport). On CUDA: NEVER, since
        its reference kernels read the metadata on the host (.tolist()), which capture forbids; on a
        CPU the stand-in re-runs the Python each replay, so any batch is seen."""
        return AttentionCGSupport.NEVER if torch.device(
            device).type == "cuda" else AttentionCGSupport.ALWAYS

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        output = torch.empty_like(q)
        torch.ops.minivllm.unified_attention_with_output(q, k, v, output, self.layer_name)
        return output


class ShortConv(nn.Module):
    """LFM2's gated short convolution; the whole mixer runs inside the opaque `short_conv` op."""

    def __init__(self, hidden_size: int, l_cache: int, layer_name: str,
                 static_forward_context: dict):
        super().__init__()
        # under TP each rank mixes a slice of the channels: its part of B, C and x, of the depthwise
        # kernel and of the state; out_proj all-reduces (inside the opaque op, as in vLLM)
        self.in_proj = MergedColumnParallelLinear(hidden_size, [hidden_size] * 3, bias=False,
                                                  return_bias=False)
        dim = divide(hidden_size, get_tensor_model_parallel_world_size(),
                     "hidden_size (the short conv's channels)")
        self.conv_weight = nn.Parameter(torch.empty(dim, l_cache))  # depthwise [dim, width]
        set_weight_attrs(self.conv_weight, {"weight_loader": sharded_weight_loader(0)})
        self.out_proj = RowParallelLinear(hidden_size, hidden_size, bias=False, return_bias=False)
        self.layer_name = layer_name
        self.conv_state = torch.empty(0)  # [num_seqs, dim, width - 1], allocated per batch
        if layer_name in static_forward_context:
            raise ValueError(f"duplicate layer name {layer_name!r}")
        static_forward_context[layer_name] = self

    @staticmethod
    def cudagraph_support(device: torch.device) -> AttentionCGSupport:
        """What a FULL graph can hold of this op (vLLM's AttentionCGSupport). On CUDA: NEVER, since
        its reference kernels read the metadata on the host (.tolist()), which capture forbids; on a
        CPU the stand-in re-runs the Python each replay, so any batch is seen."""
        return AttentionCGSupport.NEVER if torch.device(
            device).type == "cuda" else AttentionCGSupport.ALWAYS

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output = torch.empty_like(hidden_states)
        torch.ops.minivllm.short_conv(hidden_states, output, self.layer_name)
        return output
