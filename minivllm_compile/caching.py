"""The compile cache's keys and the AOT artifact (vLLM's compilation/caching.py; seed §10, §11).

Layout under VLLM_CACHE_ROOT/torch_compile_cache/ (as vLLM lays it):

    torch_aot_compile/<aot hash>/rank_0_0/model     the whole compiled forward (torch's AOT format);
                                                    with VLLM_USE_MEGA_AOT_ARTIFACT (the default) the
                                                    pieces' artifacts are inside it
    <backend hash>/rank_0_0/<tag>/                  what VllmBackend wrote for that model:
        cache_key_factors.json                      every factor of <backend hash>
        computation_graph.py                        the split graph, readable
        artifact_compile_range_<s>_<e>_subgraph_<i> one Inductor artifact per piece and entry, and
        vllm_compile_cache.py                       the CompilerManager's index of them: both only
                                                    with AOT on and VLLM_USE_MEGA_AOT_ARTIFACT=0
    <backend hash>/rank_0_0/inductor_cache/, triton_cache/
                                                    Inductor's and Triton's own caches, moved here by
                                                    the compile_fx adaptor (VLLM_USE_STANDALONE_COMPILE=0)
                                                    and by the standalone one with VLLM_USE_AOT_COMPILE=0

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
import functools
import hashlib
import inspect
import json
import logging
import pickle
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch._dynamo.aot_compile_types import SerializableCallable

from minivllm_compile import cpu_isa, envs
from minivllm_compile.cache_files import (  # noqa: F401  (atomic_write, locked: used through caching.*)
    atomic_write, cache_root, compiler_source_hash, file_hash, locked, portable_path, resolve_path, sha)
# save_artifact, load_artifact: the adaptor's (compiler_interface.py), kept importable from here
from minivllm_compile.compiler_interface import first_output, load_artifact, save_artifact  # noqa: F401
from minivllm_compile.config import CompilationConfig, CompilationMode, Range
from minivllm_compile.counter import compilation_counter
from minivllm_compile.cuda_graph import wrap_with_cudagraph_if_needed
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

# The loading model's config (vLLM's get_current_vllm_config() in deserialize_compile_artifacts):
# a mega load builds its pieces under it, not under the config pickled at save time, since what
# the key leaves out (cudagraph_mode, capture sizes) may differ between the two processes.
_loading_config: CompilationConfig | None = None


@contextmanager
def loading_for(compilation_config: CompilationConfig) -> Iterator[None]:
    global _loading_config
    prev, _loading_config = _loading_config, compilation_config
    try:
        yield
    finally:
        _loading_config = prev


# set by the decorator and the wrapper on the compiled module itself: how it is compiled (the
# config has its own factor), not what it computes
_COMPILE_STATE = frozenset({"compilation_config", "do_not_compile", "compiled", "first_compile",
                           "aot_compiled_fn", "aot_path", "guard_table", "input_spec", "model_factors"})


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
    if isinstance(value, (torch.Tensor, torch.nn.Module, type)) or callable(value) or id(value) in _seen:
        return _SKIP
    seen = _seen | {id(value)}  # the path down to here: a value that refers back to itself is cut
    if isinstance(value, (tuple, list)):
        items = [None if v is None else _constant(v, seen, _in_object) for v in value]
        return _SKIP if any(i is _SKIP for i in items) else items
    if isinstance(value, dict):
        items = {str(k): None if v is None else _constant(v, seen, _in_object) for k, v in value.items()}
        return {k: v for k, v in items.items() if v is not _SKIP}
    if dataclasses.is_dataclass(value):
        fields = {f.name: _constant(getattr(value, f.name), seen, _in_object) for f in dataclasses.fields(value)}
        return {k: v for k, v in fields.items() if v is not _SKIP}
    if hasattr(value, "__dict__"):  # a plain object: its type and its public attributes
        if _in_object:
            return f"<{type(value).__qualname__}>"
        fields = {k: _constant(v, seen, True) for k, v in vars(value).items() if not k.startswith("_")}
        return {"__type__": type(value).__qualname__, **{k: v for k, v in fields.items() if v is not _SKIP}}
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


def use_aot_compile(cc: CompilationConfig) -> bool:
    """VLLM_USE_AOT_COMPILE applies to VLLM_COMPILE with Inductor through standalone_compile."""
    if not (envs.VLLM_USE_AOT_COMPILE and cc.mode == CompilationMode.VLLM_COMPILE and cc.backend == "inductor"):
        return False
    if not envs.VLLM_USE_STANDALONE_COMPILE:
        # The compile_fx adaptor saves no artifact of its own, so a saved forward would point at
        # nothing. Here such a model traces and compiles each start, and Inductor finds its graphs
        # in its cache under the compile cache directory.
        _warn_aot_needs_standalone()
        return False
    return True


@functools.cache  # once per process
def _warn_aot_needs_standalone() -> None:
    logger.warning("VLLM_USE_AOT_COMPILE is ignored with VLLM_USE_STANDALONE_COMPILE=0: the AOT artifact "
                   "needs standalone_compile's artifacts. Each start traces again, and Inductor finds "
                   "what it compiled in its FX graph cache under the compile cache directory.")


# --- the backend's serializable result ----------------------------------------------------------

class VllmSerializableFunction(SerializableCallable):
    """What VllmBackend returns: it runs the stitching graph, and it can be saved with the AOT
    artifact. What is saved depends on VLLM_USE_MEGA_AOT_ARTIFACT, as in vLLM:

    mega      the stitching graph (pieces and splitting ops as FX code) and, per compiled piece and
              entry, its artifact's bytes: the AOT file holds everything, and a load rebuilds the
              pieces from it without running the backend (vLLM's
              reconstruct_serializable_fn_from_mega_artifact)
    not mega  the Dynamo graph, as traced: a load runs VllmBackend on it again (split, interpret,
              every piece and entry through CompilerManager.compile), and the CompilerManager finds
              each artifact in its index instead of compiling (finalize_loading)
    """

    def __init__(self, split_gm: fx.GraphModule, compilation_config: CompilationConfig,
                 pieces: list[dict], cache_dir: str | None, save_format: str):
        self.split_gm = split_gm
        self.compilation_config = compilation_config
        self.pieces = pieces  # [{"submod": name, "index": i, "sym_shape_indices": [...], "entries": {...}}]
        self.cache_dir = cache_dir
        self.save_format = save_format
        # the backend that built it (the pieces know it), as vLLM's holds vllm_backend: the
        # non-mega save needs its Dynamo graph. None for a loaded one.
        self.vllm_backend = next((m.vllm_backend for m in vars(split_gm).values()
                                  if isinstance(m, PiecewiseBackend) and m.vllm_backend is not None), None)
        self._pending: tuple | None = None  # a non-mega load, until finalize_loading
        if compilation_config.enable_layerwise_nvtx_tracing:  # seed §12: not saved, so added here
            from minivllm_compile.nvtx import add_stitching_ranges

            add_stitching_ranges(split_gm)

    @property
    def co_name(self) -> str:
        """depyf (debug_dump_path) names what a backend returned by its co_name, as it names code
        (vLLM's has the same property)."""
        return "VllmSerializableFunction"

    def __call__(self, *args: Any) -> Any:
        if self._pending is not None:
            raise RuntimeError("a VllmSerializableFunction loaded without the mega artifact runs its backend "
                               "first: call finalize_loading (aot.try_load does)")
        return self.split_gm(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "VllmSerializableFunction") -> bytes:
        mega = envs.VLLM_USE_MEGA_AOT_ARTIFACT
        state = {"mega": mega, "save_format": fn.save_format,
                 "prefix": getattr(fn.vllm_backend, "prefix", DEFAULT_MODEL_TAG)}
        if mega:
            pieces, store = _piece_bytes(fn)
            state.update(graph=_pickle_graph(fn.split_gm, keep_inputs=False),
                         config=pickle.dumps(fn.compilation_config), pieces=pieces, artifacts=store)
        else:
            if fn.vllm_backend is None or not fn.vllm_backend.graphs:
                raise RuntimeError("without VLLM_USE_MEGA_AOT_ARTIFACT the Dynamo graph is saved, and this "
                                   "function does not know it (was it loaded?)")
            state.update(graph=_pickle_graph(fn.vllm_backend.graphs[0], keep_inputs=True))
        return pickle.dumps(state)

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "VllmSerializableFunction":
        from torch._subclasses import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        state = pickle.loads(data)
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        gm = GraphPickler.loads(state["graph"], fake_mode)
        gm.recompile()
        if not state["mega"]:
            # the traced files are not known yet (aot.try_load adds them after this, and the
            # backend's cache dir is keyed on them): the backend runs in finalize_loading
            fn = cls.__new__(cls)
            fn.split_gm, fn.compilation_config, fn.pieces, fn.cache_dir = None, None, [], None
            fn.save_format, fn.vllm_backend = state["save_format"], None
            fn._pending = (gm, state["prefix"], fake_mode)
            return fn
        for child in gm.children():
            if isinstance(child, fx.GraphModule):
                child.recompile()
        cc = _loading_config or pickle.loads(state["config"])
        with cpu_isa.remembered_probe():  # else Inductor's ISA probe is most of the load's time
            _load_pieces(gm, cc, state["pieces"], state["artifacts"])
        return cls(gm, cc, state["pieces"], None, state["save_format"])

    def finalize_loading(self, compilation_config: CompilationConfig, model_factors: dict | None,
                         make_backend: Any) -> None:
        """As vLLM's: run the backend on the loaded Dynamo graph, now that the traced files are in
        `compilation_config` (the cache dir is keyed on them). Each piece's entries are loaded from
        the CompilerManager's index; one that is missing or unusable is compiled. Nothing to do for
        a mega load (rebuilt already) or a fresh compile."""
        if self._pending is None:
            return
        from torch._guards import TracingContext, tracing

        gm, prefix, fake_mode = self._pending
        backend = make_backend(compilation_config, prefix)  # a VllmBackend, from the module above this one
        backend.model_factors = model_factors
        example_inputs = [n.meta["example_value"] for n in gm.graph.find_nodes(op="placeholder")]
        with tracing(TracingContext(fake_mode)), cpu_isa.remembered_probe():
            with fake_mode:
                _ExampleValues(gm).run(*example_inputs)
            built = backend(gm, example_inputs)
        self._pending = None
        self.split_gm, self.compilation_config, self.pieces = built.split_gm, compilation_config, built.pieces
        self.cache_dir, self.vllm_backend = built.cache_dir, backend


def _pickle_graph(gm: fx.GraphModule, keep_inputs: bool) -> bytes:
    """GraphPickler.dumps(gm), without what stands in for a submodule at run time (a piece's
    PiecewiseBackend, a profiler range: the modules are saved, not those) and without the
    metadata a load does not need: stacks, and the fake values, but for the graph's inputs when
    `keep_inputs` (the backend's re-run starts from them; torch 2.13's GraphPickler cannot pickle a
    fake view, such as a split's outputs, so the others are computed again at load)."""
    from torch.fx._graph_pickler import GraphPickler, Options

    saved = {name: gm.__dict__.pop(name) for name in list(gm._modules) if name in gm.__dict__}
    try:
        for m in [gm, *gm.children()]:
            if isinstance(m, fx.GraphModule):
                for node in m.graph.nodes:
                    drop = ("nn_module_stack", "source_fn_stack", "stack_trace")
                    if not (keep_inputs and node.op == "placeholder"):
                        drop += ("example_value", "val")
                    for key in drop:
                        node.meta.pop(key, None)
        return GraphPickler.dumps(gm, Options(ops_filter=None))
    finally:
        gm.__dict__.update(saved)


class _ExampleValues(fx.Interpreter):
    """Runs a graph on fake inputs and puts each node's value back in node.meta["example_value"],
    as Dynamo left it: what split_graph and the pieces' PiecewiseBackends read."""

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        n.meta["example_value"] = value
        return value


def _piece_bytes(fn: VllmSerializableFunction) -> tuple[list[dict], dict[str, bytes]]:
    """Each compiled piece with its entries' artifacts, as vLLM's StandaloneCompiledArtifacts keeps
    them: an entry names its artifact by the bytes' SHA-256, and the store holds each distinct
    artifact once (identical layers compile to one artifact; vLLM counts one save for it).
    standalone_compile(aot=True) made them self-contained: no file of the backend's cache is needed."""
    pieces, store = [], {}
    for p in fn.pieces:
        runnable = fn.split_gm.__dict__[p["submod"]]
        backend = getattr(runnable, "runnable", runnable)  # under a profiler range (nvtx.RangeWrapper)
        entries = {}
        for r, e in backend.range_entries.items():
            artifact = e.compiled.runnable
            if not hasattr(artifact, "serialize"):
                raise RuntimeError(f"piece {p['index']} for {r} was not compiled for the mega artifact "
                                   "(standalone_compile(aot=True)): VLLM_USE_MEGA_AOT_ARTIFACT changed "
                                   "between compiling and saving?")
            data = artifact.serialize()
            digest = hashlib.sha256(data).hexdigest()
            if digest not in store:
                store[digest] = data
                compilation_counter.num_compiled_artifacts_saved += 1
            entries[r] = {"sha256": digest}
        pieces.append({**p, "entries": entries})
    return pieces, store


def _load_pieces(gm: fx.GraphModule, cc: CompilationConfig, pieces: list[dict], store: dict[str, bytes]) -> None:
    """Put a PiecewiseBackend over each piece's loaded artifacts in the stitching graph; each
    distinct artifact is deserialized (and counted) once, as vLLM's load_all does."""
    from torch._inductor.standalone_compile import AOTCompiledArtifact

    loaded: dict[str, Any] = {}
    for p in pieces:
        runnables = {}
        for r, ref in p["entries"].items():
            digest = ref["sha256"]
            if digest not in loaded:
                loaded[digest] = AOTCompiledArtifact.deserialize(store[digest])
                compilation_counter.num_compiled_artifacts_loaded += 1
            runnables[r] = loaded[digest]
            if p.get("single_output"):  # a loaded artifact returns a list even for one value
                runnables[r] = first_output(runnables[r])
        gm.__dict__[p["submod"]] = wrap_with_cudagraph_if_needed(PiecewiseBackend.from_runnables(
            cc, p["index"], p["sym_shape_indices"], runnables), cc)


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


# where compiler_interface.initialize_inductor_cache points Inductor's and Triton's own caches
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
