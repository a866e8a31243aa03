"""Paged KV cache and causal attention over it, in plain torch.

There is no Triton kernel here on purpose: attention is the splitting op, so it stays outside every
compiled graph and runs eagerly through the dispatcher (seed §9). torch's
scaled_dot_product_attention is the kernel on every device.

Cache layout (as vLLM's FlashAttention backend): kv_cache [2, num_blocks, block_size, num_kv_heads,
head_size], kv_cache[0] the keys and kv_cache[1] the values. A token's slot is
block_number * block_size + offset; a sequence's blocks are listed in its row of block_table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reshape_and_cache_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each new token's key and value ([num_tokens, num_kv_heads,
    head_size]) into its slot."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0  # negative slots are padding tokens (vLLM's PAD_SLOT_ID)
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = key[keep].to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = value[keep].to(kv_cache.dtype)


def paged_attention_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over all its cached tokens.

    query: [num_tokens, num_heads, head_size], packed sequence after sequence. Returns the same
    shape. A sequence with context c (tokens cached before this step) and q new tokens: new token j
    sits at position c + j and sees cached positions 0..c + j. Prefill is c = 0, decode is q = 1.
    GQA: num_heads is a multiple of num_kv_heads, each KV head serving a group of query heads.
    """
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q0, q1 = starts[i], starts[i + 1]
        if q1 == q0:
            continue
        n_blocks = (seq_len + block_size - 1) // block_size
        blocks = block_table[i, :n_blocks].long()
        # [2, n_blocks, block_size, kv_heads, head] -> [2, kv_heads, seq_len, head]
        kv = kv_cache[:, blocks].flatten(1, 2)[:, :seq_len].transpose(1, 2).to(query.dtype)
        q = query[q0:q1].transpose(0, 1)  # [heads, q_len, head]
        q_len, context = q1 - q0, seq_len - (q1 - q0)
        rows = torch.arange(q_len, device=query.device).unsqueeze(1) + context
        mask = torch.arange(seq_len, device=query.device).unsqueeze(0) <= rows
        o = F.scaled_dot_product_attention(
            q.unsqueeze(0), kv[0].unsqueeze(0), kv[1].unsqueeze(0),
            attn_mask=mask, scale=scale, enable_gqa=q.shape[0] != num_kv_heads,
        )
        out[q0:q1] = o[0].transpose(0, 1)
    return out
