"""The compile cache's keys and the AOT artifact (vLLM's compilation/caching.py; seed §10, §11).

Layout under VLLM_CACHE_ROOT/torch_compile_cache/ (as vLLM lays it):

    torch_aot_compile/<aot hash>/rank_0_0/model     the whole compiled forward (torch's AOT format)
    <backend hash>/rank_0_0/<tag>/                  what VllmBackend wrote for that model:
        cache_key_factors.json                      every factor of <backend hash>
        computation_graph.py                        the split graph, readable
        artifact_compile_range_<r>_subgraph_<i>     one Inductor artifact per piece and entry
    <backend hash>/rank_0_0/inductor_cache/, triton_cache/
                                                    Inductor's and Triton's own caches, moved here
                                                    by the compile_fx adaptor (VLLM_USE_STANDALONE_COMPILE=0)

A key must cover everything that changes the compiled code, or the cache serves kernels built for
something else. Its factors, and what each covers:

    config          the CompilationConfig's fields (mode, sizes, ranges, splitting ops, passes, ...)
    envs            the switches that change what is compiled (VLLM_USE_AOT_COMPILE, ...)
    torch           the torch release that compiled it
    inductor_config Inductor's own settings in this process
    compiler        the source of this package's compiler (backends, passes, ...): vLLM puts its
                    release (vllm.__version__) in the key for the same reason
    passes          the post-grad passes' uuids, a user's pass included (vLLM: PostGradPassManager.uuid)
    model           the compiled module's class and every parameter's and buffer's name, shape,
                    dtype and device (weights are graph inputs: their values are not baked in)
    constants       every plain value the module and its submodules hold (an eps, a head count,
                    a layer name, a bool that picks a branch): Dynamo bakes such values into the
                    graph as constants, and with the guards dropped nothing would notice a change
                    (vLLM hashes the model's configuration for this)
    inputs          the first call's arguments: each tensor's dtype, device, static sizes and
                    contiguity; each plain argument's value
    tag             which compiled part of the model it is (vLLM's model tag, "backbone" by default)
    device          (backend key) where the traced graph's inputs live
    traced_files    (backend key) every file Dynamo traced, with its content. The AOT key is
                    known before Dynamo runs, so the AOT load checks the traced sources instead.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import io
import json
import logging
import os
import pickle
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.aot_compile_types import SerializableCallable

from minivllm_compile import cpu_isa, envs
from minivllm_compile.cache_files import (  # noqa: F401  (atomic_write, locked: used through caching.*)
    atomic_write, cache_root, compiler_source_hash, file_hash, locked, portable_path, resolve_path, sha)
from minivllm_compile.compiler_interface import first_output
from minivllm_compile.config import CompilationConfig, Range
from minivllm_compile.counter import compilation_counter
from minivllm_compile.piecewise_backend import PiecewiseBackend

logger = logging.getLogger("minivllm_compile")

DEFAULT_MODEL_TAG = "backbone"


# --- what the compiled code depends on ------------------------------------------------------------

def model_signature(module: torch.nn.Module) -> str:
    """The model's class and every parameter's name, shape, dtype and device type: weights are graph
    inputs, so a compiled artifact fits exactly the models with this signature (C++ kernels built for
    CPU tensors are no use to a model on the GPU)."""
    cls = type(module)
    forward = cls.forward
    rows = [f"{cls.__module__}.{cls.__qualname__}:{forward.__code__.co_firstlineno}"]
    rows += [f"{n}:{tuple(p.shape)}:{p.dtype}:{p.device.type}" for n, p in module.named_parameters()]
    rows += [f"{n}:{tuple(b.shape)}:{b.dtype}:{b.device.type}" for n, b in module.named_buffers()]
    return sha("\n".join(rows), 16)


_SKIP = object()
# set by the decorator and the wrapper on the compiled module itself: how it is compiled (the
# config has its own factor), not what it computes
_COMPILE_STATE = frozenset({"compilation_config", "do_not_compile", "compiled", "first_compile",
                           "aot_compiled_fn", "aot_path", "guard_table", "input_spec", "model_factors"})


def _constant(value: Any) -> Any:
    """`value` as JSON if a trace could bake it into the graph as a constant, else _SKIP. Tensors
    and modules are not constants (they are inputs, or walked on their own); None is skipped too,
    so that a cache slot filled after construction does not change the key."""
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    if isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)  # nan and inf too, and no rounding
    if isinstance(value, (tuple, list)):
        items = [_constant(v) for v in value]
        return _SKIP if any(i is _SKIP for i in items) else items
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = {f.name: _constant(getattr(value, f.name)) for f in dataclasses.fields(value)}
        return {k: v for k, v in fields.items() if v is not _SKIP}
    return _SKIP


def constant_value(value: Any) -> Any:
    """`value` as JSON if a trace could bake it in as a constant, else None."""
    value = _constant(value)
    return None if value is _SKIP else value


def model_constants(module: torch.nn.Module) -> dict[str, Any]:
    """Every plain value the module and its submodules hold, by dotted name: what Dynamo would bake
    into the graph if forward read it (an RMSNorm's eps, an attention layer's scale and name)."""
    found = {}
    for prefix, m in module.named_modules():
        for name, value in vars(m).items():
            if name.startswith("_") or (m is module and name in _COMPILE_STATE):
                continue
            value = _constant(value)
            if value is not _SKIP:
                found[f"{prefix}.{name}" if prefix else name] = value
    return found


def passes_uuid(cc: CompilationConfig) -> str | None:
    """The post-grad passes this config runs, by their uuids (each one's source and settings)."""
    if cc.backend != "inductor":
        return None
    from minivllm_compile.passes import make_pass_manager

    return make_pass_manager(cc).uuid()[:16]


def inductor_config_hash() -> str:
    import torch._inductor.config as inductor_config

    return sha(str(inductor_config.save_config_portable()) if hasattr(inductor_config, "save_config_portable")
               else repr(sorted(inductor_config.get_config_copy().items(), key=str)), 16)


def model_factors(module: torch.nn.Module, inputs: dict | None = None) -> dict[str, Any]:
    """The factors that tell one compiled module from another: what it is, what it holds, what it
    was first called with, and its tag."""
    return {"model": model_signature(module),
            "constants": sha(json.dumps(model_constants(module), sort_keys=True), 16),
            "inputs": inputs,
            "tag": getattr(getattr(module, "backend", None), "prefix", DEFAULT_MODEL_TAG)}


def compile_factors(cc: CompilationConfig) -> dict[str, Any]:
    """The factors that do not depend on the model: how it is compiled, and by what."""
    return {"config": cc.compute_hash(), "envs": envs.compile_factors(), "torch": torch.__version__,
            "inductor_config": inductor_config_hash(), "compiler": compiler_source_hash(),
            "passes": passes_uuid(cc)}


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


# --- artifacts ----------------------------------------------------------------------------------

def save_artifact(artifact: Any, path: Path, fmt: str) -> None:
    """CompiledArtifact.save into a temporary name, then renamed: never a half-written artifact."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    artifact.save(path=str(tmp), format=fmt)
    if path.is_dir():
        import shutil

        shutil.rmtree(path)
    os.replace(tmp, path)


def load_artifact(path: Path, fmt: str) -> Any:
    from torch._inductor import CompiledArtifact

    return CompiledArtifact.load(path=str(path), format=fmt)


# --- the backend's serializable result ----------------------------------------------------------

class VllmSerializableFunction(SerializableCallable):
    """What VllmBackend returns: it runs the stitching graph, and it can be saved with the AOT
    artifact. Saved: the stitching graph (pieces and splitting ops as FX code) and, per compiled
    piece and entry, its Inductor artifact: a path into the backend's cache dir, or (with
    VLLM_USE_MEGA_AOT_ARTIFACT) the artifact's bytes, so that one file holds everything."""

    def __init__(self, split_gm: fx.GraphModule, compilation_config: CompilationConfig,
                 pieces: list[dict], cache_dir: str | None, save_format: str):
        self.split_gm = split_gm
        self.compilation_config = compilation_config
        self.pieces = pieces  # [{"submod": name, "index": i, "sym_shape_indices": [...], "entries": {...}}]
        self.cache_dir = cache_dir
        self.save_format = save_format
        if compilation_config.enable_layerwise_nvtx_tracing:  # seed §12: not saved, so added here
            from minivllm_compile.nvtx import add_stitching_ranges

            add_stitching_ranges(split_gm)

    def __call__(self, *args: Any) -> Any:
        return self.split_gm(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "VllmSerializableFunction") -> bytes:
        from torch.fx._graph_pickler import GraphPickler, Options

        gm = fn.split_gm
        # what stands in for a submodule at run time (a piece's PiecewiseBackend, a profiler
        # range) is not saved: the modules are, and the pieces' artifacts
        saved = {name: gm.__dict__.pop(name) for name in list(gm._modules) if name in gm.__dict__}
        try:
            for m in [gm, *gm.children()]:
                if isinstance(m, fx.GraphModule):
                    for node in m.graph.nodes:
                        for key in ("example_value", "val", "nn_module_stack", "source_fn_stack", "stack_trace"):
                            node.meta.pop(key, None)
            graph_bytes = GraphPickler.dumps(gm, Options(ops_filter=None))
        finally:
            gm.__dict__.update(saved)
        pieces = []
        mega = envs.VLLM_USE_MEGA_AOT_ARTIFACT
        for p in fn.pieces:
            entries = {}
            for r, path in p["entries"].items():
                # a path relative to the cache root: a moved cache still finds its pieces
                entries[r] = {"bytes": _read_artifact_bytes(Path(path))} if mega else {"path": portable_path(path)}
            pieces.append({**p, "entries": entries})
        state = {"graph": graph_bytes, "config": pickle.dumps(fn.compilation_config), "pieces": pieces,
                 "save_format": fn.save_format, "mega": mega}
        return pickle.dumps(state)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "VllmSerializableFunction":
        from torch._subclasses import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        state = pickle.loads(data)
        gm = GraphPickler.loads(state["graph"], FakeTensorMode(shape_env=ShapeEnv()))
        gm.recompile()
        for child in gm.children():
            if isinstance(child, fx.GraphModule):
                child.recompile()
        cc = pickle.loads(state["config"])
        with cpu_isa.remembered_probe():  # else Inductor's ISA probe is most of the load's time
            cls._load_pieces(gm, cc, state)
        return cls(gm, cc, state["pieces"], None, state["save_format"])

    @staticmethod
    def _load_pieces(gm: fx.GraphModule, cc: CompilationConfig, state: dict) -> None:
        for p in state["pieces"]:
            runnables = {}
            for r, ref in p["entries"].items():
                runnables[r] = (_load_artifact_bytes(ref["bytes"], state["save_format"]) if "bytes" in ref
                                else load_artifact(resolve_path(ref["path"]), state["save_format"]))
                compilation_counter.num_compiled_artifacts_loaded += 1
                if p.get("single_output"):
                    runnables[r] = first_output(runnables[r])
            gm.__dict__[p["submod"]] = PiecewiseBackend.from_runnables(
                cc, p["index"], p["sym_shape_indices"], runnables)


def _read_artifact_bytes(path: Path) -> bytes:
    if path.is_dir():  # unpacked: tar it into memory
        import tarfile

        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            tar.add(path, arcname=path.name)
        return b"DIR" + buf.getvalue()
    return path.read_bytes()


def _load_artifact_bytes(data: bytes, fmt: str) -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "artifact"
        if data.startswith(b"DIR"):
            import tarfile

            with tarfile.open(fileobj=io.BytesIO(data[3:])) as tar:
                tar.extractall(tmp, filter="data")
                path = Path(tmp) / tar.getnames()[0]
        else:
            path.write_bytes(data)
        return load_artifact(path, fmt)


# --- source checks and inspection ---------------------------------------------------------------

def changed_sources(source_info: Any) -> list[str]:
    """The traced functions whose source differs now from when the artifact was saved."""
    changed = set()
    for src in getattr(source_info, "inlined_sources", ()):  # content: the whole module's source
        module = sys.modules.get(src.module)
        try:
            now = inspect.getsource(module) if module else None
        except (OSError, TypeError):
            now = None
        if now != src.content:
            changed.add(src.module)
    return sorted(changed)


# where InductorAdaptor.initialize_cache points Inductor's and Triton's own caches
FOREIGN_CACHES = {"inductor_cache": "Inductor's FX graph cache and generated code",
                  "triton_cache": "Triton's compiled kernels"}


def describe(root: str | Path | None = None) -> str:
    """The cache as a tree with sizes, the factors of each backend entry, and its artifacts."""
    root = Path(root) if root else cache_root()
    if not root.exists():
        return f"{root}: empty (nothing compiled with the cache on yet)"
    lines = [f"{root}"]
    for path in sorted(p for p in root.rglob("*") if not p.name.startswith(".")):
        rel = path.relative_to(root).parts
        if any(part in FOREIGN_CACHES for part in rel[:-1]):
            continue  # inside Inductor's or Triton's own cache: one line for the whole folder
        depth = len(rel)
        files = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else [path]
        size = sum(f.stat().st_size for f in files)
        note = f"  ({len(files)} files: {FOREIGN_CACHES[path.name]})" if path.name in FOREIGN_CACHES else ""
        lines.append(f"{'  ' * depth}{path.name}{'/' if path.is_dir() else ''}  {_human(size)}{note}")
        if path.name == "cache_key_factors.json":
            factors = json.loads(path.read_text())
            for k, v in factors.items():
                shown = f"{len(v)} files" if k == "traced_files" else v
                lines.append(f"{'  ' * (depth + 1)}· {k}: {shown}")
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable: GB always returns")


def range_key(r: Range) -> str:
    return f"{r.start}_{r.end}"
