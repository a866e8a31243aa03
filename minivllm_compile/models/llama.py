"""A Llama decoder on the minivllm custom ops (vLLM's
model_executor/models/llama.py, made small)."""

from __future__ import annotations

import torch
from torch import nn

from minivllm_compile.compilation.decorators import support_torch_compile
from minivllm_compile.compilation.nvtx import add_layerwise_hooks
from minivllm_compile.config import (
    CompilationConfig,
    CompilationMode,
    set_current_compilation_config,
)
from minivllm_compile.distributed import (
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from minivllm_compile.models.config import ModelConfig
from minivllm_compile.models.inputs import check_ids
from minivllm_compile.models.layers import Attention, LlamaMLP, RMSNorm, RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, static_forward_context: dict):
        super().__init__()
        # q, k and v stacked into one matmul on load; under TP each rank holds its heads' rows
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=False,
                                          prefix=f"{prefix}.qkv_proj", return_bias=False)
        # this rank's heads
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = (self.num_heads * self.head_dim,
                                     self.num_kv_heads * self.head_dim)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        bias=False, prefix=f"{prefix}.o_proj", return_bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, cfg.max_position_embeddings,
                                          cfg.rope_theta)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, f"{prefix}.attn",
                              static_forward_context)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, static_forward_context: dict):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, f"{prefix}.self_attn", static_forward_context)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        # vLLM's residual stream: the first layer starts it, later ones fuse the add into the norm
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


@support_torch_compile
class LlamaModel(nn.Module):
    """The decoder: token ids and positions in, final hidden states out ([num_tokens, hidden]).
    Compiled as vLLM compiles its decoders: dim 0 (num_tokens) of both inputs is dynamic."""

    def __init__(self, *, cfg: ModelConfig, compilation_config=None, prefix: str = "model"):
        super().__init__()
        self.cfg, self.compilation_config = cfg, compilation_config
        self.static_forward_context: dict = {}  # layer_name -> module, for the opaque ops
        with set_current_compilation_config(compilation_config
                                            or CompilationConfig(mode=CompilationMode.NONE)):
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size,
                                                       prefix=f"{prefix}.embed_tokens")
            self.layers = nn.ModuleList(
                self.make_layer(cfg, f"{prefix}.layers.{i}", i)
                for i in range(cfg.num_hidden_layers))
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        cc = compilation_config
        if cc is not None and cc.enable_layerwise_nvtx_tracing and cc.mode == CompilationMode.NONE:
            add_layerwise_hooks(self.layers, f"{prefix}.layers")  # compiled modes: see nvtx.py

    def make_layer(self, cfg: ModelConfig, prefix: str, index: int) -> nn.Module:
        return LlamaDecoderLayer(cfg, prefix, self.static_forward_context)

    def check_input_values(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """Called by the decorator before compiled code runs: compiled, an id past the vocabulary
        or a position past the rotary cache aborts the process instead of raising."""
        if input_ids.numel():  # an empty step reads nothing (and aminmax refuses it)
            check_ids("input_ids", input_ids, self.cfg.vocab_size, "vocab_size")
            check_ids("positions", positions, self.cfg.max_position_embeddings,
                      "max_position_embeddings")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states
