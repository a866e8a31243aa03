"""An LFM2-like hybrid: most layers mix tokens with a gated short convolution, a few with attention
(whose q and k get a per-head RMSNorm before RoPE, as in vLLM's Qwen3/LFM2). The model is written
unfused, as vLLM writes it; `QKNormRoPEFusionPass`
(compilation/passes/fusion/qk_norm_rope_fusion.py) turns the norms and the rotation into one
`fused_qk_norm_rope` call when the pass config enables it."""

from __future__ import annotations

import torch
from torch import nn

from minivllm_compile.distributed import QKVParallelLinear, RowParallelLinear
from minivllm_compile.models.config import ModelConfig
from minivllm_compile.models.layers import Attention, LlamaMLP, RMSNorm, RotaryEmbedding, ShortConv
from minivllm_compile.models.llama import LlamaModel


class HybridAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, static_forward_context: dict):
        super().__init__()
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=False,
                                          prefix=f"{prefix}.qkv_proj", return_bias=False)
        # this rank's heads (all of them at TP=1)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = (self.num_heads * self.head_dim,
                                     self.num_kv_heads * self.head_dim)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size,
                                        bias=False, prefix=f"{prefix}.o_proj", return_bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(self.head_dim, cfg.max_position_embeddings,
                                          cfg.rope_theta)
        self.attn = Attention(self.num_heads, self.head_dim, self.num_kv_heads, f"{prefix}.attn",
                              static_forward_context)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        # the norms see one head per row: views of the split, [num_tokens, heads, head_dim]
        q = self.q_norm(q.view(*q.shape[:-1], q.shape[-1] // self.head_dim,
                               self.head_dim)).view(q.shape)
        k = self.k_norm(k.view(*k.shape[:-1], k.shape[-1] // self.head_dim,
                               self.head_dim)).view(k.shape)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, prefix: str, kind: str, static_forward_context: dict):
        super().__init__()
        self.kind = kind
        if kind == "conv":
            self.conv = ShortConv(cfg.hidden_size, cfg.conv_L_cache, f"{prefix}.conv",
                                  static_forward_context)
        else:
            self.self_attn = HybridAttention(cfg, f"{prefix}.self_attn", static_forward_context)
        self.mlp = LlamaMLP(cfg.hidden_size, cfg.intermediate_size, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        if self.kind == "conv":
            hidden_states = self.conv(hidden_states)
        else:
            hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class HybridModel(LlamaModel):
    """Same embedding, residual stream and final norm as LlamaModel; only the layers differ."""

    def make_layer(self, cfg: ModelConfig, prefix: str, index: int) -> nn.Module:
        return HybridDecoderLayer(cfg, prefix, cfg.layer_types[index], self.static_forward_context)
