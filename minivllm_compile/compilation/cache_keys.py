"""The compile cache's keys: the factors that tell one compiled model from another (notebook 09).

A key must cover everything that changes the compiled code, or the cache serves kernels built for
something else. The factors are vLLM 0.34's, under its top-level names (VllmBackend.__call__:
`compute_env_and_config_hashes`, `compiler_manager.compile_factors`, `get_code_factors`), and
`cache_key_factors.json` holds them themselves, not hashes of them, so two cache folders diff field
by field (viz.debugging.changed_factors names the field: `config.compilation.compile_sizes`):

    env        envs.compile_factors(): every switch but envs.IGNORED_FACTORS, by its value
    config     vLLM's VllmConfig.compile_factors(), made of this project's configs:
      .model        the compiled module (model_factors, below): vLLM's ModelConfig factors
      .compilation  CompilationConfig.compile_factors(): its fields but paths, traced files and
                    enforce_eager, the CUDA-graph fields among them; dynamic_shapes_config,
                    pass_config and kernel_config (the IR priority and each provider's uuid) by
                    their own factors; a user's post_grad_custom_post_pass by its uuid
      .parallel     ParallelConfig.current().compile_factors(): the TP size, never the rank, which
                    names the folder below the hash instead (rank_{rank}_{dp_rank}), so that all
                    ranks share a hash
      .device       (backend key) where the traced graph's inputs live: {"device_type": "cpu"}
      .version      the source of this package's compiler (cache_files.compiler_source_hash: every
                    module under cache_files.COMPILER_FOLDERS and the root modules they import),
                    where vLLM puts its release (vllm.__version__), for the same reason
    code       (backend key) {"files": [{"path", "hash"}]}: every file Dynamo traced, with the hash
               of its content (vLLM's read_code_files / get_code_factors); code in no readable file
               ("<string>", a notebook cell) is listed by its path alone
    compiler   the adaptor's compile_factors(config) (compiler_interface.py): for Inductor
               {"inductor": {"torch_version", "torch_key", "inductor_config", "functorch_config",
               and "system" where torch sees a GPU}}, for the eager backend nothing
    config_hash, code_hash, compiler_hash
               (cache_key_factors.json only) the hashes of those three, as vLLM writes them

The folder's name is the first 10 hex digits of hash_factors({env, config, code, compiler}), as in
vLLM. What the keys held before 0.34's shape, and where each went (the old name -> the new one):

    config (a hash)        config.compilation (the fields themselves)
    envs                   env (every switch, not four)
    torch, inductor_config compiler.inductor.torch_version, .torch_key, .inductor_config
    compiler (source hash) config.version
    passes (the post-grad  gone, as from vLLM's folder hash: the pass manager's uuid keys Inductor's
      pass manager's uuid) own FX-graph cache (PostGradPassManager.uuid, passes_uuid below); what
                           it hashed is in config: pass_config and kernel_config in
                           config.compilation, the passes' source in config.version, a user's pass
                           in config.compilation.inductor_compile_config, the TP size in
                           config.parallel
    model, constants,      config.model.class, .forward, .parameters, .buffers, .constants,
      inputs, tag            .inputs, .tag
    parallel               config.parallel (at every TP size, 1 included)
    device                 config.device
    traced_files           code.files

The model is what vLLM's ModelConfig stands for (config.model): its class and forward's text where
it can be read (a file, a notebook cell), every parameter's and buffer's name, shape, dtype and
device (weights are graph inputs: their values are not baked in), every plain value the module
and its submodules hold (an eps, a head count, a layer name, a bool that picks a branch: Dynamo
bakes such values into the graph as constants, and with the guards dropped nothing would notice a
change; vLLM hashes the model's configuration for this), the first call's arguments (each tensor's
dtype, device, static sizes and contiguity; each plain argument's value) and which compiled part of
the model it is (its tag, vLLM's model tag, "backbone" by default).

The AOT key is known before Dynamo runs: env, config (no device) and compiler. What only the trace
finds out, the functions it read (a notebook cell's too) and every value it baked in and guarded
on (a private or class attribute, a module global, a nested object's field), is recorded with the
artifact and checked when it is loaded instead (traced_state.py).
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
from pathlib import Path
from typing import Any

import torch

from minivllm_compile import envs
from minivllm_compile.compilation.cache_files import compiler_source_hash, sha
from minivllm_compile.compilation.compiler_interface import (
    CompilerInterface,
    EagerAdaptor,
    InductorAdaptor,
    InductorStandaloneAdaptor,
)
from minivllm_compile.config import (
    CompilationConfig,
    CompileFactors,
    ParallelConfig,
    hash_factors,
)

DEFAULT_MODEL_TAG = "backbone"
# the three hashes vLLM writes beside the factors into cache_key_factors.json
HASHES = ("config_hash", "code_hash", "compiler_hash")


_SKIP = object()

# set by the decorator and the wrapper on the compiled module itself: how it is compiled (the
# config has its own factor), not what it computes
_COMPILE_STATE = frozenset({"compilation_config", "do_not_compile", "compiled", "first_compile",
                           "aot_compiled_fn", "aot_path", "guard_table", "guard_values",
                           "traced_code", "input_spec", "model_factors"})


def _constant(value: Any, _seen: frozenset = frozenset(), _in_object: bool = False) -> Any:
    """`value` as JSON if a trace could bake it into the graph as a constant, else _SKIP. Tensors,
    modules and functions are not constants (they are inputs, walked on their own, or traced
    source, which the code factor covers). A top-level None is skipped, so that a cache slot filled
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


def _tensor_row(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)}:{t.dtype}:{t.device.type}"


def model_factors(module: torch.nn.Module, inputs: dict | None = None) -> CompileFactors:
    """The key's config.model: what the compiled module is, what it holds, what it was first called
    with, and its tag. Weights are graph inputs, so a compiled artifact fits exactly the models
    with these parameters' names, shapes, dtypes and device types (C++ kernels built for CPU
    tensors are no use to a model on the GPU); their values are in no factor."""
    cls = type(module)
    try:  # forward's text where it can be read (a file, a notebook cell): an edit is a new key
        forward = sha(inspect.getsource(cls.forward), 16)
    except (OSError, TypeError):  # python -c, exec: the AOT save refuses such code (aot.py)
        forward = f"line {cls.forward.__code__.co_firstlineno}"
    return {"class": f"{cls.__module__}.{cls.__qualname__}",
            "forward": forward,
            "parameters": {n: _tensor_row(p) for n, p in module.named_parameters()},
            "buffers": {n: _tensor_row(b) for n, b in module.named_buffers()},
            "constants": model_constants(module),
            "inputs": inputs,
            "tag": getattr(getattr(module, "backend", None), "prefix", DEFAULT_MODEL_TAG)}


def parallel_factor() -> CompileFactors:
    """The key's config.parallel: this process's ParallelConfig factors, the TP size (vLLM hashes
    its ParallelConfig: the sizes, never the rank). A TP=2 rank's graph holds all-reduces and
    half-size weights, and must not load what a TP=1 start compiled."""
    return ParallelConfig.current().compile_factors()


def passes_uuid(cc: CompilationConfig) -> str | None:
    """The post-grad pass manager's uuid for this config (each pass's source and settings): a key
    of Inductor's own FX-graph cache, as in vLLM (the backend installs the manager as Inductor's
    post_grad_custom_post_pass), not of these keys, which hold what it hashes in `config`."""
    if cc.backend != "inductor":
        return None
    from minivllm_compile.compilation.passes import make_pass_manager

    return make_pass_manager(cc).uuid()[:16]


def compiler_for(cc: CompilationConfig) -> CompilerInterface:
    """The adaptor this config's pieces go to, as backends.make_compiler picks it (its AOT setting
    changes what the adaptor saves, not its factors)."""
    if cc.backend == "eager":
        return EagerAdaptor()
    if envs.VLLM_USE_STANDALONE_COMPILE and hasattr(torch._inductor, "standalone_compile"):
        return InductorStandaloneAdaptor()
    return InductorAdaptor()


def compiler_factors(cc: CompilationConfig) -> CompileFactors:
    """The key's compiler: the adaptor's own factors (vLLM's CompilerManager.compile_factors)."""
    return compiler_for(cc).compile_factors(cc)


def config_factors(cc: CompilationConfig, factors_of_model: dict | None = None,
                   device: str | None = None) -> CompileFactors:
    """The key's config (vLLM's VllmConfig.compile_factors(), from this project's configs): the
    model's factors ({} for a backend used without a model), the compilation config's, the
    parallel settings', the device type (the backend key only) and the compiler's source."""
    factors: CompileFactors = {"model": factors_of_model or {},
                               "compilation": cc.compile_factors(),
                               "parallel": parallel_factor(),
                               "version": compiler_source_hash()}
    if device is not None:
        factors["device"] = {"device_type": device}
    return factors


def read_code_files(files: Any) -> dict[str, str | None]:
    """Each traced file's text, None where it cannot be read (vLLM's, caching.py): `<string>` from
    exec, a notebook cell's name (its text is checked on load instead, traced_state.py), a file
    removed since."""
    contents: dict[str, str | None] = {}
    for path in files:
        try:
            contents[str(path)] = Path(path).read_text()
        except (OSError, UnicodeDecodeError):
            contents[str(path)] = None
    return contents


def get_code_factors(contents: dict[str, str | None]) -> list[dict[str, str]]:
    """One entry per file, sorted by path: its path, and the hash of its content where it was read
    (vLLM's, caching.py; a `<...>` path never gets a hash)."""
    factors = []
    for path, content in sorted(contents.items()):
        entry = {"path": path}
        if content is not None and not path.startswith("<"):
            entry["hash"] = hash_factors({"content": content})
        factors.append(entry)
    return factors


def _canonical(factors: dict) -> dict:
    """As JSON holds it: tuples as lists, every dict's keys sorted (so the file written from it is
    sorted as vLLM's, and equal factors compare equal however they were built)."""
    return json.loads(json.dumps(factors, sort_keys=True))


def aot_cache_key(module: torch.nn.Module, cc: CompilationConfig,
                  factors_of_model: dict | None = None) -> tuple[str, dict]:
    """Known before Dynamo runs: env, config and compiler, without the device and the traced files
    (the load checks those itself)."""
    model = factors_of_model if factors_of_model is not None else model_factors(module)
    factors = _canonical({"env": envs.compile_factors(), "config": config_factors(cc, model),
                          "compiler": compiler_factors(cc)})
    return hash_factors(factors)[:10], factors


def backend_cache_key(cc: CompilationConfig, device: str,
                      factors_of_model: dict | None = None) -> tuple[str, dict]:
    """After tracing (vLLM's VllmBackend.__call__): the folder's key, and what
    cache_key_factors.json holds: env, config (with the device type the graph runs on), code
    (every traced file), compiler, and the hashes of config, code and compiler."""
    factors = _canonical({
        "env": envs.compile_factors(),
        "config": config_factors(cc, factors_of_model, device),
        "code": {"files": get_code_factors(read_code_files(cc.traced_files))},
        "compiler": compiler_factors(cc),
    })
    key = hash_factors(factors)[:10]
    hashes = {name: hash_factors(factors[name.removesuffix("_hash")]) for name in HASHES}
    return key, dict(sorted({**factors, **hashes}.items()))
