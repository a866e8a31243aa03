"""The model's config.json, read into a dataclass (the Hugging Face Llama keys we use)."""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields
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
    # FP8 checkpoints: {"quant_method": "fp8", "activation_scheme": "static", ...}, checked by
    # models/quant.Fp8Config when the model is built; None for an unquantized checkpoint
    quantization_config: dict | None = None

    def __post_init__(self):
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type {self.model_type!r} is not supported; "
                             f"expected one of {MODEL_TYPES}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type == "int" and (not isinstance(value, int)
                                    or isinstance(value, bool) or value < 0
                                    or (value == 0
                                        and f.name not in ("bos_token_id", "eos_token_id"))):
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")
            if f.type == "float":
                # 0 or less gives NaN: eps divides by the norm of a zero row, theta ** x is 0 or inf
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                    raise ValueError(f"{f.name} must be a positive number, got {value!r}")
                setattr(self, f.name, float(value))
            if f.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"{f.name} must be true or false, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple "
                             f"of num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE "
                             "rotates pairs of features)")
        if self.model_type == "minivllm_hybrid":
            types = tuple(self.layer_types or ())
            if len(types) != self.num_hidden_layers or not set(types) <= {"conv", "full_attention"}:
                raise ValueError("layer_types must list 'conv' or 'full_attention' for each of the "
                                 f"{self.num_hidden_layers} layers, got {self.layer_types}")
            self.layer_types = types

    @classmethod
    def from_dict(cls, d: dict, source: str = "the model config") -> "ModelConfig":
        """`source` names where `d` came from, for the errors (a config.json's path)."""
        try:
            if not isinstance(d, dict):
                raise ValueError(f"expected a JSON object of settings, got {type(d).__name__}")
            d = dict(d)
            # newer transformers writes rope_theta inside rope_parameters
            if "rope_theta" not in d and isinstance(d.get("rope_parameters"), dict):
                d["rope_theta"] = d["rope_parameters"].get("rope_theta", 10000.0)
            names = {f.name for f in fields(cls)}
            required = [f.name for f in fields(cls) if f.default is MISSING and f.name != "head_dim"
                        and f.name != "num_key_value_heads"]
            missing = [n for n in required if n not in d]
            if missing:
                raise ValueError(f"missing {missing}")
            for name in ("hidden_size", "num_attention_heads"):  # head_dim's default divides them
                if not isinstance(d[name], int) or isinstance(d[name], bool) or d[name] <= 0:
                    raise ValueError(f"{name} must be a positive integer, got {d[name]!r}")
            d.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
            d.setdefault("num_key_value_heads", d["num_attention_heads"])
            return cls(**{k: v for k, v in d.items() if k in names})
        except ValueError as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e}); it should be "
                             "a Hugging Face config.json") from None
        return cls.from_dict(d, source=str(path))

    @property
    def is_hybrid(self) -> bool:
        return self.model_type == "minivllm_hybrid"
