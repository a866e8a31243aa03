"""Load Hugging Face Llama-layout weights, stacking q/k/v and gate/up as vLLM's load_weights does."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

# checkpoint name piece -> (our name piece, which shard of the stacked tensor)
STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def _shard_rows(module_params: dict[str, torch.Tensor], name: str, cfg) -> list[int]:
    """Row counts of the shards stacked into one of our tensors."""
    if ".qkv_proj." in name:
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        return [q, kv, kv]
    half = module_params[name].shape[0] // 2
    return [half, half]


def expected_checkpoint(params: dict[str, torch.Tensor], cfg) -> dict[str, tuple[str, slice | None, tuple]]:
    """Every tensor a checkpoint must hold: its name -> (our parameter, row slice, shape)."""
    spec: dict[str, tuple[str, slice | None, tuple]] = {}
    for name, p in params.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stacked = [(ck, ours, i) for ck, (ours, i) in STACKED.items() if ours in name]
        if stacked:
            rows = _shard_rows(params, name, cfg)
            for ck, ours, i in stacked:
                start = sum(rows[:i])
                spec[name.replace(ours, ck)] = (name, slice(start, start + rows[i]), (rows[i], p.shape[1]))
        elif name.endswith(".conv.conv_weight"):  # nn.Conv1d stores the depthwise kernel [dim, 1, width]
            spec[name.replace(".conv.conv_weight", ".conv.conv.weight")] = (name, None, (p.shape[0], 1, p.shape[1]))
        else:
            spec[name] = (name, None, tuple(p.shape))
    return spec


def load_checkpoint_weights(model: nn.Module, lm_head: nn.Linear, cfg, path: str | Path) -> None:
    """Fill `model` (prefix "model.") and `lm_head` from model.safetensors; refuse a checkpoint
    with a missing, unexpected or mis-shaped tensor, naming it."""
    path = Path(path)
    tensors = load_file(str(path))
    params = {f"model.{n}": p for n, p in model.named_parameters()}
    params["lm_head.weight"] = lm_head.weight
    spec = expected_checkpoint(params, cfg)
    missing = sorted(set(spec) - set(tensors))
    extra = sorted(set(tensors) - set(spec))
    if missing or extra:
        raise ValueError(f"{path}: checkpoint does not fit a {cfg.model_type} model with "
                         f"{cfg.num_hidden_layers} layers: missing {missing[:5]}, unexpected {extra[:5]}")
    for ck_name, (ours, rows, shape) in spec.items():
        t = tensors[ck_name]
        if tuple(t.shape) != shape:
            raise ValueError(f"{path}: tensor {ck_name!r} has shape {tuple(t.shape)}, expected {shape} "
                             f"(from config.json)")
        with torch.no_grad():
            dst = params[ours] if rows is None else params[ours][rows]
            dst.copy_(t.reshape(dst.shape))
    if cfg.tie_word_embeddings:
        lm_head.weight = model.embed_tokens.weight
