"""The compile cache's keys: the factors that tell one compiled model from another (notebook 09).

A key must cover everything that changes the compiled code, or the cache serves kernels built for
something else. Its factors, and what each covers:

    config          the CompilationConfig's fields (mode, sizes, ranges, splitting ops, passes, ...)
    envs            the switches that change what is compiled (VLLM_USE_AOT_COMPILE, ...)
    torch           the torch release that compiled it
    inductor_config Inductor's own settings in this process
    compiler        the source of this package's compiler (cache_files.compiler_files: every module
                    under cache_files.COMPILER_FOLDERS and the root modules they import): vLLM
                    puts its release (vllm.__version__) in the key for the same reason
    passes          the post-grad passes' uuids, a user's pass included (PostGradPassManager.uuid;
                    vLLM leaves it out of its folder hash: there it keys Inductor's own cache)
    model           the compiled module's class, forward's text where it can be read (a file, a
                    notebook cell), and every parameter's and buffer's name, shape, dtype and
                    device (weights are graph inputs: their values are not baked in)
    constants       every plain value the module and its submodules hold (an eps, a head count,
                    a layer name, a bool that picks a branch): Dynamo bakes such values into the
                    graph as constants, and with the guards dropped nothing would notice a change
                    (vLLM hashes the model's configuration for this)
    inputs          the first call's arguments: each tensor's dtype, device, static sizes and
                    contiguity; each plain argument's value
    tag             which compiled part of the model it is (vLLM's model tag, "backbone" by default)
    parallel        (from TP=2 on) the tensor-parallel size; never the rank, which names the folder
                    below the hash instead (rank_{rank}_{dp_rank}), so that all ranks share a hash
    device          (backend key) where the traced graph's inputs live
    traced_files    (backend key) every file Dynamo traced, with its content.

The AOT key is known before Dynamo runs: what only the trace finds out, the functions it read (a
notebook cell's too) and every value it baked in and guarded on (a private or class attribute, a
module global, a nested object's field), is recorded with the artifact and checked when it is
loaded instead (traced_state.py).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
from typing import Any

import torch

from minivllm_compile import envs
from minivllm_compile.compilation.cache_files import compiler_source_hash, file_hash, sha
from minivllm_compile.config import CompilationConfig

DEFAULT_MODEL_TAG = "backbone"


def model_signature(module: torch.nn.Module) -> str:
    """The model's class, forward's text, and every parameter's name, shape, dtype and device type:
    weights are graph inputs, so a compiled artifact fits exactly the models with this signature
    (C++ kernels built for CPU tensors are no use to a model on the GPU)."""
    cls = type(module)
    forward = cls.forward
    try:  # forward's text where it can be read (a file, a notebook cell): an edit is a new key
        written = sha(inspect.getsource(forward), 16)
    except (OSError, TypeError):  # python -c, exec: the AOT save refuses such code (aot.py)
        written = str(forward.__code__.co_firstlineno)
    rows = [f"{cls.__module__}.{cls.__qualname__}:{written}"]
    rows += [f"{n}:{tuple(p.shape)}:{p.dtype}:{p.device.type}"
             for n, p in module.named_parameters()]
    rows += [f"{n}:{tuple(b.shape)}:{b.dtype}:{b.device.type}" for n, b in module.named_buffers()]
    return sha("\n".join(rows), 16)


_SKIP = object()

# set by the decorator and the wrapper on the compiled module itself: how it is compiled (the
# config has its own factor), not what it computes
_COMPILE_STATE = frozenset({"compilation_config", "do_not_compile", "compiled", "first_compile",
                           "aot_compiled_fn", "aot_path", "guard_table", "guard_values",
                           "traced_code", "input_spec", "model_factors"})


def _constant(value: Any, _seen: frozenset = frozenset(), _in_object: bool = False) -> Any:
    """`value` as JSON if a trace could bake it into the graph as a constant, else _SKIP. Tensors,
    modules and functions are not constants (they are inputs, walked on their own, or traced
    source, which traced_files covers). A top-level None is skipped, so that a cache slot filled
    after construction does not change the key; inside a container it is a value like any other.
    Containers, dataclasses and plain objects are walked: a dict of options or a SimpleNamespace
    that forward reads is baked in as surely as a float attribute. An object held by another plain
    object is only named (a logger's manager would otherwise bring every logger of the process)."""
    if value is None:
        return _SKIP
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)  # nan and inf too, and no rounding
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (torch.Tensor, torch.nn.Module,
                          type)) or callable(value) or id(value) in _seen:
        return _SKIP
    seen = _seen | {id(value)}  # the path down to here: a value that refers back to itself is cut
    if isinstance(value, (tuple, list)):
        items = [None if v is None else _constant(v, seen, _in_object) for v in value]
        return _SKIP if any(i is _SKIP for i in items) else items
    if isinstance(value, dict):
        items = {str(k): None if v is None else _constant(v, seen, _in_object)
                 for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not _SKIP}
    if dataclasses.is_dataclass(value):
        fields = {f.name: _constant(getattr(value, f.name), seen, _in_object)
                  for f in dataclasses.fields(value)}
        return {k: v for k, v in fields.items() if v is not _SKIP}
    if hasattr(value, "__dict__"):  # a plain object: its type and its public attributes
        if _in_object:
            return f"<{type(value).__qualname__}>"
        fields = {k: _constant(v, seen, True) for k, v in vars(value).items()
                  if not k.startswith("_")}
        return {"__type__": type(value).__qualname__,
                **{k: v for k, v in fields.items() if v is not _SKIP}}
    return _SKIP


def constant_value(value: Any) -> Any:
    """`value` as JSON if a trace could bake it in as a constant, else None."""
    value = _constant(value)
    return None if value is _SKIP else value


def model_constants(module: torch.nn.Module) -> dict[str, Any]:
    """Every plain value the module and its submodules hold, by dotted name: what Dynamo would bake
    into the graph if forward read it (an RMSNorm's eps, an attention layer's scale and name).
    Not the values a parallel layer holds per rank (its `_rank_dependent_attrs`: its rank, its
    slice of the vocabulary): every rank of a TP run must get the same key, as vLLM's hash leaves
    the rank out; each rank's compiled code is kept apart by its folder, rank_{rank}_{dp_rank}."""
    found = {}
    for prefix, m in module.named_modules():
        per_rank = getattr(m, "_rank_dependent_attrs", ())
        for name, value in vars(m).items():
            if name.startswith("_") or (m is module and name in _COMPILE_STATE) or name in per_rank:
                continue
            value = _constant(value)
            if value is not _SKIP:
                found[f"{prefix}.{name}" if prefix else name] = value
    return found


def passes_uuid(cc: CompilationConfig) -> str | None:
    """The post-grad passes this config runs, by their uuids (each one's source and settings)."""
    if cc.backend != "inductor":
        return None
    from minivllm_compile.compilation.passes import make_pass_manager

    return make_pass_manager(cc).uuid()[:16]


def inductor_config_hash() -> str:
    import torch._inductor.config as inductor_config

    return sha(str(inductor_config.save_config_portable())
               if hasattr(inductor_config, "save_config_portable")
               else repr(sorted(inductor_config.get_config_copy().items(), key=str)), 16)


def model_factors(module: torch.nn.Module, inputs: dict | None = None) -> dict[str, Any]:
    """The factors that tell one compiled module from another: what it is, what it holds, what it
    was first called with, and its tag."""
    return {"model": model_signature(module),
            "constants": sha(json.dumps(model_constants(module), sort_keys=True), 16),
            "inputs": inputs,
            "tag": getattr(getattr(module, "backend", None), "prefix", DEFAULT_MODEL_TAG)}


def parallel_factor() -> dict[str, int] | None:
    """The TP size (vLLM hashes its ParallelConfig: the sizes, never the rank), None in one
    process: a TP=2 rank's graph holds all-reduces and half-size weights, and must not load what a
    TP=1 start compiled. Left out of the key at TP=1, so that a single process keeps its key."""
    from minivllm_compile.distributed.parallel_state import get_tensor_model_parallel_world_size

    tp = get_tensor_model_parallel_world_size()
    return {"tensor_parallel_size": tp} if tp > 1 else None


def compile_factors(cc: CompilationConfig) -> dict[str, Any]:
    """The factors that do not depend on the model: how it is compiled, and by what, and on how
    many ranks ("parallel", from TP=2 on)."""
    factors = {"config": cc.compute_hash(), "envs": envs.compile_factors(),
               "torch": torch.__version__,
               "inductor_config": inductor_config_hash(), "compiler": compiler_source_hash(),
               "passes": passes_uuid(cc)}
    parallel = parallel_factor()
    if parallel is not None:
        factors["parallel"] = parallel
    return factors


def aot_cache_key(module: torch.nn.Module, cc: CompilationConfig,
                  factors_of_model: dict | None = None) -> tuple[str, dict]:
    """Known before Dynamo runs: everything but the traced files, which the load checks itself."""
    factors = {**compile_factors(cc), **(factors_of_model or model_factors(module))}
    return sha(json.dumps(factors, sort_keys=True)), factors


def backend_cache_key(cc: CompilationConfig, device: str,
                      factors_of_model: dict | None = None) -> tuple[str, dict]:
    """After tracing: the AOT key's factors, the device type the graph runs on (vLLM hashes its
    DeviceConfig), and every traced file."""
    factors = {**compile_factors(cc), **(factors_of_model or {}), "device": device,
               "traced_files": {p: file_hash(p) for p in sorted(cc.traced_files)}}
    return sha(json.dumps(factors, sort_keys=True)), factors
