"""What vLLM keeps in vllm/config/utils.py that this project needs: `Range`, the inclusive range of
token counts a compiled entry serves (vLLM's compile ranges and compile sizes are both Ranges), and
the compile factors, vLLM 0.34's names and behaviour:

    CompileFactors          a config's factors: a dict of its fields that change the compiled code
    SupportsCompileFactors  anything with a compile_factors() method (a nested config)
    normalize_value(x)      a value as stable JSON: a nested config by its compile_factors(), an
                            object with uuid() by its uuid, an enum with its class's name, bytes as
                            hex; a function or anything else unknown is a TypeError
    get_compile_factors(config, ignored_factors)
                            every dataclass field of `config` but the ignored ones, normalized; an
                            ignored name that is no field is a ValueError, a value normalize_value
                            refuses a TypeError naming the field
    hash_factors(items)     the SHA-256 of the factors' sorted JSON
    hash_config(config)     hash_factors(config.compile_factors())

Every config here defines compile_factors() on get_compile_factors, each with the fields it leaves
out and why; compilation/cache_keys.py puts them together into the compile cache's key.

One difference from vLLM's normalize_value, on purpose: a mapping stays a dict (its keys as str),
where vLLM makes it a sorted tuple of (key, value) pairs. Under json.dumps(sort_keys=True) both are
canonical; a dict keeps cache_key_factors.json diffable key by key (viz.debugging.changed_factors
names `config.compilation.inductor_compile_config.max_autotune`, not a list's index).
"""

from __future__ import annotations

import enum
import hashlib
import json
import pathlib
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, Protocol, runtime_checkable

CompileFactors = dict[str, object]


@runtime_checkable
class SupportsCompileFactors(Protocol):
    def compile_factors(self) -> CompileFactors: ...


def hash_factors(items: dict[str, object]) -> str:
    """The SHA-256 hex digest of the factors' canonical (sorted) JSON (vLLM's)."""
    return hashlib.sha256(json.dumps(items, sort_keys=True).encode()).hexdigest()


def hash_config(config: SupportsCompileFactors) -> str:
    """The hash of a config's compile factors (vLLM's)."""
    return hash_factors(config.compile_factors())


def normalize_value(x: Any) -> Any:
    """A stable, JSON-serializable form of `x` for hashing (vLLM's order: primitives, special
    types, nested configs, objects with a uuid(), then containers, recursively). Anything without a
    stable form (a function, a module, an open file) is a TypeError rather than a key that hashes
    an address and never matches again."""
    if x is None or isinstance(x, (bool, int, float, str)):  # an IntEnum or str enum is one too
        return x
    if isinstance(x, enum.Enum):  # tagged with its class: Enum(1) is not the int 1
        return (f"{type(x).__module__}.{type(x).__qualname__}", normalize_value(x.value))
    if isinstance(x, type):  # a class, by its qualified name
        return ".".join(p for p in (x.__module__, x.__qualname__) if p) or repr(x)
    if isinstance(x, SupportsCompileFactors):  # a nested config says which of its fields count
        return x.compile_factors()
    if callable(getattr(x, "uuid", None)):  # an InductorPass (callable or not): its uuid
        return x.uuid()
    if callable(x):
        raise TypeError("normalize_value: function or callable instance unsupported")
    import torch  # here, not at the top: the config modules import torch only where they use it

    if isinstance(x, (torch.dtype, torch.device)):  # vLLM: torch.dtype only
        return str(x)
    if isinstance(x, (bytes, bytearray)):
        return x.hex()
    if isinstance(x, pathlib.Path):
        try:
            return str(x.expanduser().resolve())
        except OSError:
            return str(x)
    if is_dataclass(x):  # a dataclass that is no config: its type and every field, by name
        return (f"{type(x).__module__}.{type(x).__qualname__}",
                tuple((f.name, normalize_value(getattr(x, f.name)))
                      for f in sorted(fields(x), key=lambda f: f.name)))
    if isinstance(x, Mapping):  # vLLM: a sorted tuple of pairs (the module docstring says why)
        return {str(k): normalize_value(v) for k, v in sorted(x.items(), key=lambda kv: str(kv[0]))}
    if isinstance(x, Set):
        return tuple(sorted(repr(normalize_value(v)) for v in x))
    if isinstance(x, Sequence):
        return tuple(normalize_value(v) for v in x)
    raise TypeError(f"normalize_value: unsupported type '{type(x).__name__}'. Ensure config "
                    "values use supported primitives/containers or add a stable representation "
                    "for this type.")


def get_compile_factors(config: Any, ignored_factors: set[str]) -> CompileFactors:
    """The factors of a config (vLLM's): every dataclass field not in `ignored_factors`, each
    normalized, a nested config by its own compile_factors(). An ignored name that is no field of
    the config is refused (a renamed field would otherwise slip into the key unnoticed, or a typo
    leave one in), and so is a value normalize_value cannot hash, naming the field."""
    names = {f.name for f in fields(config)}
    unknown = set(ignored_factors) - names
    if unknown:
        raise ValueError(f"get_compile_factors: ignored_factors contain unknown fields "
                         f"{sorted(unknown)} for {type(config).__name__}")
    factors: CompileFactors = {}
    for f in fields(config):
        if f.name in ignored_factors:
            continue
        value = getattr(config, f.name, None)
        try:
            factors[f.name] = normalize_value(value)
        except TypeError as e:
            raise TypeError(f"get_compile_factors: unsupported type for key '{f.name}' "
                            f"({type(value).__name__}) of {type(config).__name__}: {e}") from e
    return factors


@dataclass(frozen=True)
class Range:
    """An inclusive range of num_tokens, [start, end]."""

    start: int
    end: int

    def __post_init__(self):
        if not 1 <= self.start <= self.end:
            raise ValueError(f"Range needs 1 <= start <= end, got Range({self.start}, {self.end})")

    def is_single_size(self) -> bool:
        return self.start == self.end

    def __contains__(self, size: int) -> bool:
        return self.start <= size <= self.end

    def __repr__(self) -> str:
        return f"Range({self.start}, {self.end})"
