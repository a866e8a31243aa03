"""The model's config.json, read into a dataclass (the Hugging Face Llama keys we use)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

MODEL_TYPES = ("llama", "minivllm_hybrid")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 1024
    tie_word_embeddings: bool = False
    bos_token_id: int = 256
    eos_token_id: int = 257
    layer_types: tuple[str, ...] | None = None  # hybrid: "conv" or "full_attention" per layer
    conv_L_cache: int = 3  # hybrid: the short conv's width

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; expected one of {MODEL_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if self.model_type == "minivllm_hybrid":
            types = tuple(self.layer_types or ())
            if len(types) != self.num_hidden_layers or not set(types) <= {"conv", "full_attention"}:
                raise ValueError(f"layer_types must list 'conv' or 'full_attention' for each of the "
                                 f"{self.num_hidden_layers} layers, got {self.layer_types}")
            self.layer_types = types

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        # newer transformers writes rope_theta inside rope_parameters
        if "rope_theta" not in d and isinstance(d.get("rope_parameters"), dict):
            d["rope_theta"] = d["rope_parameters"].get("rope_theta", 10000.0)
        d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
        d.setdefault("num_key_value_heads", d["num_attention_heads"])
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        return cls.from_dict(json.loads(Path(path).read_text()))

    @property
    def is_hybrid(self) -> bool:
        return self.model_type == "minivllm_hybrid"
