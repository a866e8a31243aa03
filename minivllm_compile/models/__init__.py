"""The models a notebook compiles: `load_model` for the trained checkpoints shipped here,
`build_model` for the same architectures with seeded random weights (tests)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from minivllm_compile.distributed import (
    ParallelLMHead,
    get_tensor_model_parallel_world_size,
    pad_vocab_size,
    tensor_parallel_disabled,
)
from minivllm_compile.models.config import ModelConfig
from minivllm_compile.models.hybrid import HybridModel
from minivllm_compile.models.llama import LlamaModel
from minivllm_compile.models.lm import LM
from minivllm_compile.models.loader import (
    checkpoint_tensors,
    load_checkpoint_shards,
    load_checkpoint_weights,
)
from minivllm_compile.models.quant import quantize_linears
from minivllm_compile.models.tokenizer import VOCAB_SIZE, ByteTokenizer

CHECKPOINTS = Path(__file__).parent / "checkpoints"
SHIPPED = ("tiny-llama", "tiny-hybrid", "tiny-llama-fp8")

__all__ = [
    "CHECKPOINTS",
    "LM",
    "ByteTokenizer",
    "ModelConfig",
    "build_model",
    "check_tensor_parallel_size",
    "load_model",
]


def check_tensor_parallel_size(cfg: ModelConfig, tp: int) -> None:
    """Refuse a TP size the model cannot be split by, naming the config.json field (vLLM checks
    the heads in ModelConfig.verify_with_parallel_config; its layers assert the rest as they are
    built)."""
    problem = _tp_problem(cfg, tp)
    if problem:
        fits = [d for d in range(1, cfg.num_attention_heads + 1) if _tp_problem(cfg, d) is None]
        raise ValueError(f"{problem} (tensor-parallel sizes this model can take: {fits})")


def _tp_problem(cfg: ModelConfig, tp: int) -> str | None:
    if not isinstance(tp, int) or tp < 1:
        return f"the tensor-parallel size must be a positive integer, got {tp!r}"
    if tp == 1:
        return None
    if cfg.quantization_config is not None:
        return "FP8 checkpoints run on one rank only here: their per-tensor scales are not sharded"
    dims = {"num_attention_heads": cfg.num_attention_heads,
            "intermediate_size": cfg.intermediate_size}
    if cfg.is_hybrid:
        dims["hidden_size (the short conv's channels)"] = cfg.hidden_size
    for name, n in dims.items():
        if n % tp:
            return (f"{name}={n} is not divisible by the tensor-parallel size {tp}: every rank "
                    "must hold an equal share")
    kv = cfg.num_key_value_heads
    if (kv % tp) if tp < kv else (tp % kv):
        return (f"num_key_value_heads={kv} and the tensor-parallel size {tp}: one must divide the "
                "other (more ranks than KV heads replicate each KV head on tp / kv ranks)")
    padded = pad_vocab_size(cfg.vocab_size)
    if padded % tp:
        return (f"vocab_size={cfg.vocab_size}, padded to {padded} (a multiple of 64, as vLLM pads "
                f"it), is not divisible by the tensor-parallel size {tp}")
    return None


def _make(cfg: ModelConfig, compilation_config, device, dtype) -> tuple[nn.Module, nn.Module]:
    check_tensor_parallel_size(cfg, get_tensor_model_parallel_world_size())
    cls = HybridModel if cfg.is_hybrid else LlamaModel
    model = cls(cfg=cfg, compilation_config=compilation_config)
    if cfg.quantization_config is not None:  # an FP8 checkpoint: its linears become Fp8Linear
        quantize_linears(model, cfg, compilation_config)
    lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, prefix="lm_head")
    return model, lm_head


def _finish(model, lm_head, cfg, device, dtype, checkpoint_dir=None) -> LM:
    model.to(device=device, dtype=dtype).eval()
    lm_head.to(device=device, dtype=dtype)
    return LM(model, lm_head, cfg, checkpoint_dir)


def load_model(name_or_path: str | Path, *, compilation_config=None, device=None, dtype=None) -> LM:
    """Load "tiny-llama", "tiny-hybrid", "tiny-llama-fp8" (tiny-llama with FP8 weights and static
    activation scales, made by scripts/quantize_fp8.py), or a folder holding config.json and
    model.safetensors."""
    path = CHECKPOINTS / str(name_or_path) if str(name_or_path) in SHIPPED else Path(name_or_path)
    if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"{name_or_path!r} is neither a shipped model {SHIPPED} nor a "
                                f"folder with config.json and model.safetensors (looked in {path})")
    cfg = ModelConfig.from_file(path / "config.json")
    model, lm_head = _make(cfg, compilation_config, device, dtype)
    if get_tensor_model_parallel_world_size() == 1:
        load_checkpoint_weights(model, lm_head, cfg, path / "model.safetensors")
    else:  # every rank reads the same file and keeps its shard
        load_checkpoint_shards(model, lm_head, cfg, load_file(str(path / "model.safetensors")),
                               str(path / "model.safetensors"))
    return _finish(model, lm_head, cfg, device, dtype, path)


def build_model(arch: str, *, num_layers: int = 2, compilation_config=None, seed: int = 0,
                device=None, dtype=None, **sizes) -> LM:
    """The "llama" or "hybrid" architecture with seeded random weights; `sizes` override the
    small defaults (hidden_size, intermediate_size, num_attention_heads, ...)."""
    if arch not in ("llama", "hybrid"):
        raise ValueError(f"arch must be 'llama' or 'hybrid', got {arch!r}")
    d = dict(model_type="llama" if arch == "llama" else "minivllm_hybrid", vocab_size=VOCAB_SIZE,
             hidden_size=96, intermediate_size=160, num_hidden_layers=num_layers,
             num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=512)
    if arch == "hybrid":
        d["layer_types"] = ["conv" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    d.update(sizes)
    cfg = ModelConfig.from_dict(d)
    if get_tensor_model_parallel_world_size() > 1:
        # the shards of the very weights one process would draw: drawn whole, then split
        check_tensor_parallel_size(cfg, get_tensor_model_parallel_world_size())
        with tensor_parallel_disabled():
            whole = build_model(arch, num_layers=num_layers, seed=seed, **sizes)
        model, lm_head = _make(cfg, compilation_config, device, dtype)
        tensors = checkpoint_tensors(whole.model, whole.lm_head, cfg)
        load_checkpoint_shards(model, lm_head, cfg, tensors, f"build_model({arch!r}, seed={seed})")
        return _finish(model, lm_head, cfg, device, dtype)
    torch.manual_seed(seed)
    model, lm_head = _make(cfg, compilation_config, device, dtype)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), ("lm_head", lm_head.weight)]:
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)  # near one, as trained norms are, but not exactly
            else:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5)
    return _finish(model, lm_head, cfg, device, dtype)
