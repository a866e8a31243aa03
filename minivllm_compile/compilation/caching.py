"""The compile cache's keys and the AOT artifact (vLLM's compilation/caching.py; seed §10, §11).

Layout under VLLM_CACHE_ROOT/torch_compile_cache/ (as vLLM lays it):

    torch_aot_compile/<aot hash>/rank_0_0/model     the whole compiled forward (torch's AOT format);
                                                    with VLLM_USE_MEGA_AOT_ARTIFACT (the default)
                                                    the pieces' artifacts are inside it. Our part of
                                                    it carries its SHA-256 and its record of what it
                                                    was built for (key, model, traced sources and
                                                    values: aot.py, traced_state.py), checked on
                                                    load
    <backend hash>/rank_0_0/<tag>/                  what VllmBackend wrote for that model:
        cache_key_factors.json                      every factor of <backend hash>
        computation_graph.py                        the split graph, readable
        artifact_compile_range_<s>_<e>_subgraph_<i> one Inductor artifact per piece and entry, and
        vllm_compile_cache.py                       the CompilerManager's index of them (each one's
                                                    SHA-256 and its piece's graph key, checked on
                                                    load): both only with AOT on and
                                                    VLLM_USE_MEGA_AOT_ARTIFACT=0
    <backend hash>/rank_0_0/inductor_cache/, triton_cache/
                                                    Inductor's and Triton's own caches, moved here
                                                    by the compile_fx adaptor
                                                    (VLLM_USE_STANDALONE_COMPILE=0) and by the
                                                    standalone one with VLLM_USE_AOT_COMPILE=0

rank_0_0 is a single process's folder; under tensor parallelism each rank has its own,
rank_{rank}_{dp_rank} (vLLM's name; dp_rank is always 0 here), below the hash all ranks share: the
TP size is in the key, the rank is not (cache_files.rank_folder, cache_keys.parallel_factor).

The keys that name these folders, and what each of their factors covers: cache_keys.py.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import pickle
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch._dynamo.aot_compile_types import SerializableCallable

from minivllm_compile import envs
from minivllm_compile.compilation import cpu_isa
from minivllm_compile.compilation.cache_keys import DEFAULT_MODEL_TAG
from minivllm_compile.compilation.compiler_interface import first_output
from minivllm_compile.compilation.counter import compilation_counter
from minivllm_compile.compilation.cuda_graph import wrap_with_cudagraph_if_needed
from minivllm_compile.compilation.piecewise_backend import PiecewiseBackend, StitchingRecord
from minivllm_compile.config import CompilationConfig, CompilationMode, Range

logger = logging.getLogger("minivllm_compile")

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


def compile_cache_enabled(cc: CompilationConfig) -> bool:
    """vLLM's is_compile_cache_enabled (compiler_interface.py): the cache is off with
    VLLM_DISABLE_COMPILE_CACHE=1, and with Inductor's force_disable_caches, set in this process
    (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1) or in inductor_compile_config. Off, nothing is loaded
    from it or saved to it."""
    import torch._inductor.config as inductor_config

    return not (envs.VLLM_DISABLE_COMPILE_CACHE or inductor_config.force_disable_caches
                or cc.inductor_compile_config.get("force_disable_caches", False))


def use_aot_compile(cc: CompilationConfig) -> bool:
    """VLLM_USE_AOT_COMPILE applies to VLLM_COMPILE with Inductor through standalone_compile."""
    if not (envs.VLLM_USE_AOT_COMPILE and cc.mode == CompilationMode.VLLM_COMPILE
            and cc.backend == "inductor"):
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
    logger.warning("VLLM_USE_AOT_COMPILE is ignored with VLLM_USE_STANDALONE_COMPILE=0: the "
                   "AOT artifact needs standalone_compile's artifacts. Each start traces "
                   "again, and Inductor finds what it compiled in its FX graph cache under "
                   "the compile cache directory.")


# --- the backend's serializable result ----------------------------------------------------------

class VllmSerializableFunction(SerializableCallable):
    """What VllmBackend returns: it runs the stitching function (codegen.py: the stitching graph
    written as plain Python, `optimized_call`), and it can be saved with the AOT artifact. What is
    saved depends on VLLM_USE_MEGA_AOT_ARTIFACT, as in vLLM:

    mega      the stitching function's source and constants, the stitching graph (pieces and
              splitting ops as FX code, vLLM's fallback) and, per compiled piece and entry, its
              artifact's bytes: the AOT file holds everything, and a load rebuilds the pieces from
              it and exec's the saved source, without running the backend (vLLM's
              reconstruct_serializable_fn_from_mega_artifact)
    not mega  the Dynamo graph, as traced: a load runs VllmBackend on it again (split, interpret,
              every piece and entry through CompilerManager.compile), and the CompilerManager finds
              each artifact in its index instead of compiling (finalize_loading)
    """

    def __init__(self, record: StitchingRecord, compilation_config: CompilationConfig,
                 pieces: list[dict], cache_dir: str | None, save_format: str,
                 example_inputs: Sequence = (),
                 execution: tuple[str, list[str], list[Any]] | bool = True):
        # the stitching graph and its pieces, as the backend (or the mega load) built them
        self.record = record
        self.split_gm = record.split_gm
        # as vLLM's: the ShapeEnv of the trace (its symbols, their ranges and guards), from the
        # first SymInt input (a mega load's: the one its saved inputs were unpickled into)
        sym_input = next((i for i in example_inputs if isinstance(i, torch.SymInt)), None)
        self.shape_env = sym_input.node.shape_env if sym_input is not None else None
        self.compilation_config = compilation_config
        # [{"submod": name, "index": i, "sym_shape_indices": [...], "entries": {...}}]
        self.pieces = pieces
        self.cache_dir = cache_dir
        self.save_format = save_format
        # the backend that built it (the pieces know it), as vLLM's holds vllm_backend: the
        # non-mega save needs its Dynamo graph. None for a loaded one.
        self.vllm_backend = next((b.vllm_backend for b in record.backends.values()
                                  if b.vllm_backend is not None), None)
        self._pending: tuple | None = None  # a non-mega load, until finalize_loading
        if compilation_config.enable_layerwise_nvtx_tracing:  # seed §12: not saved, so added here
            from minivllm_compile.compilation.nvtx import add_stitching_ranges

            add_stitching_ranges(record)
        # the stitching function, bound to the pieces as installed (ranges included): written
        # from the stitching graph (True), or the (code, submod_names, consts) a load saved; False,
        # an artifact without one: the stitching graph runs as a GraphModule (vLLM's fallback)
        if execution is False:
            record.execution_fn = record.split_gm
        else:
            record.stitch(None if execution is True else execution)

    @property
    def optimized_call(self) -> Callable[..., Any] | None:
        """What a call runs (vLLM's name): the record's stitching function, the one place it is
        kept (a benchmark may wrap it there to see its arguments)."""
        return self.record.execution_fn if self.record is not None else None

    @property
    def co_name(self) -> str:
        """depyf (debug_dump_path) names what a backend returned by its co_name, as it names code
        (vLLM's has the same property)."""
        return "VllmSerializableFunction"

    def __call__(self, *args: Any) -> Any:
        if self._pending is not None:
            raise RuntimeError("a VllmSerializableFunction loaded without the mega artifact runs "
                               "its backend first: call finalize_loading "
                               "(aot._try_load_aot_compiled_fn does)")
        return self.optimized_call(*args)

    @classmethod
    def serialize_compile_artifacts(cls, fn: "VllmSerializableFunction") -> bytes:
        """The state below, pickled, inside a record of its SHA-256: a load checks it before it
        trusts a byte (a flipped bit in an artifact gave wrong logits, with no warning, wherever
        Inductor's own cache did not have the kernel)."""
        mega = envs.VLLM_USE_MEGA_AOT_ARTIFACT
        state = {"mega": mega, "save_format": fn.save_format,
                 "prefix": getattr(fn.vllm_backend, "prefix", DEFAULT_MODEL_TAG),
                 # which model and key it was built for, its sources and baked values (aot.py)
                 "built_for": getattr(fn, "built_for", None)}
        if mega:
            pieces, store = _piece_bytes(fn)
            record = fn.record
            # the inputs' fake values too: a load rebuilds its shape environment from them, as
            # vLLM's keeps example_inputs for the same reason
            state.update(graph=_pickle_graph(fn.split_gm, keep_inputs=True),
                         config=pickle.dumps(fn.compilation_config), pieces=pieces, artifacts=store,
                         # vLLM's: the source a load exec's again (the graph is its fallback)
                         execution_code=record.execution_code, submod_names=record.submod_names,
                         consts=pickle.dumps(record.consts))
        else:
            if fn.vllm_backend is None or not fn.vllm_backend.graphs:
                raise RuntimeError("without VLLM_USE_MEGA_AOT_ARTIFACT the Dynamo graph is saved, "
                                   "and this function does not know it (was it loaded?)")
            state.update(graph=_pickle_graph(fn.vllm_backend.graphs[0], keep_inputs=True))
        payload = pickle.dumps(state)
        return pickle.dumps({"sha256": hashlib.sha256(payload).hexdigest(), "payload": payload})

    @classmethod
    def deserialize_compile_artifacts(cls, data: bytes) -> "VllmSerializableFunction":
        from torch._subclasses import FakeTensorMode
        from torch.fx._graph_pickler import GraphPickler
        from torch.fx.experimental.symbolic_shapes import ShapeEnv

        state = _checked_state(data)
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())
        gm = GraphPickler.loads(state["graph"], fake_mode)
        gm.recompile()
        if not state["mega"]:
            # the traced files are not known yet (aot._verify_source_unchanged adds them after
            # this, and the backend's cache dir is keyed on them): the backend runs in
            # finalize_loading
            fn = cls.__new__(cls)
            fn.record, fn.split_gm, fn.compilation_config = None, None, None
            fn.pieces, fn.cache_dir = [], None
            fn.save_format, fn.vllm_backend, fn.shape_env = state["save_format"], None, None
            fn._pending = (gm, state["prefix"], fake_mode)
            fn.built_for = state["built_for"]
            return fn
        for child in gm.children():
            if isinstance(child, fx.GraphModule):
                child.recompile()
        cc = _loading_config or pickle.loads(state["config"])
        with cpu_isa.remembered_probe():  # else Inductor's ISA probe is most of the load's time
            record = _load_pieces(gm, cc, state["pieces"], state["artifacts"])
        execution = False
        if state.get("execution_code") is not None:
            execution = (state["execution_code"], state["submod_names"],
                         pickle.loads(state["consts"]))
        else:
            logger.warning("the AOT artifact holds no stitching function: running its stitching "
                           "graph as a GraphModule")
        inputs = [n.meta.get("example_value") for n in gm.graph.find_nodes(op="placeholder")]
        fn = cls(record, cc, state["pieces"], None, state["save_format"], example_inputs=inputs,
                 execution=execution)
        fn.built_for = state["built_for"]
        return fn

    def finalize_loading(self, compilation_config: CompilationConfig, make_backend: Any) -> None:
        """As vLLM's: run the backend on the loaded Dynamo graph, now that the traced files are in
        `compilation_config` (the cache dir is keyed on them). Each piece's entries are loaded from
        the CompilerManager's index; one that is missing or unusable is compiled. Nothing to do for
        a mega load (rebuilt already) or a fresh compile."""
        if self._pending is None:
            return
        from torch._guards import TracingContext, tracing

        gm, prefix, fake_mode = self._pending
        # a VllmBackend, from the module above this one
        backend = make_backend(compilation_config, prefix)
        example_inputs = [n.meta["example_value"] for n in gm.graph.find_nodes(op="placeholder")]
        with tracing(TracingContext(fake_mode)), cpu_isa.remembered_probe():
            with fake_mode:
                _ExampleValues(gm).run(*example_inputs)
            built = backend(gm, example_inputs)
        self._pending = None
        self.record, self.split_gm = built.record, built.split_gm
        self.compilation_config, self.pieces = compilation_config, built.pieces
        self.cache_dir, self.vllm_backend = built.cache_dir, backend
        self.shape_env = built.shape_env


def _checked_state(data: bytes) -> dict:
    """The saved state, once its SHA-256 matches the one recorded with it."""
    record = pickle.loads(data)
    if not (isinstance(record, dict) and {"sha256", "payload"} <= record.keys()):
        raise RuntimeError("not an artifact this version wrote (no SHA-256 recorded with it)")
    if hashlib.sha256(record["payload"]).hexdigest() != record["sha256"]:
        raise RuntimeError("its content does not match the SHA-256 recorded with it: the file is "
                           "corrupt (a flipped bit, a bad copy)")
    return pickle.loads(record["payload"])


def _pickle_graph(gm: fx.GraphModule, keep_inputs: bool) -> bytes:
    """GraphPickler.dumps(gm), without what stands in for a submodule at run time (a piece's
    PiecewiseBackend, a profiler range: the modules are saved, not those) and without the
    metadata a load does not need: stacks, and the fake values, but for the graph's inputs when
    `keep_inputs` (the backend's re-run starts from them; torch 2.13's GraphPickler cannot pickle a
    fake view, such as a split's outputs, so the others are computed again at load)."""
    from torch.fx._graph_pickler import GraphPickler, Options

    saved = {name: gm.__dict__.pop(name) for name in list(gm._modules) if name in gm.__dict__}
    views = {}
    try:
        for m in [gm, *gm.children()]:
            if isinstance(m, fx.GraphModule):
                for node in m.graph.nodes:
                    drop = ("nn_module_stack", "source_fn_stack", "stack_trace")
                    if not (keep_inputs and node.op == "placeholder"):
                        drop += ("example_value", "val")
                    for key in drop:
                        node.meta.pop(key, None)
                    value = node.meta.get("example_value")
                    if getattr(value, "_base", None) is not None and hasattr(value, "fake_mode"):
                        # an input that was a view (x.view(...) passed to the first call): the
                        # same sizes and strides, without the base GraphPickler cannot pickle
                        views[node] = value
                        with value.fake_mode:
                            node.meta["example_value"] = torch.empty_strided(
                                value.shape, value.stride(), dtype=value.dtype, device=value.device,
                                requires_grad=value.requires_grad)
        return GraphPickler.dumps(gm, Options(ops_filter=None))
    finally:
        gm.__dict__.update(saved)
        for node, value in views.items():
            node.meta["example_value"] = value


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
    standalone_compile(aot=True) made them self-contained: no file of the
    backend's cache is needed."""
    pieces, store = [], {}
    for p in fn.pieces:
        backend = fn.record.backends[p["submod"]]
        entries = {}
        for r, e in backend.range_entries.items():
            artifact = e.compiled.runnable
            if not hasattr(artifact, "serialize"):
                raise RuntimeError(f"piece {p['index']} for {r} was not compiled for the mega "
                                   "artifact (standalone_compile(aot=True)): "
                                   "VLLM_USE_MEGA_AOT_ARTIFACT changed between compiling and "
                                   "saving?")
            data = artifact.serialize()
            digest = hashlib.sha256(data).hexdigest()
            if digest not in store:
                store[digest] = data
                compilation_counter.num_compiled_artifacts_saved += 1
            entries[r] = {"sha256": digest}
        pieces.append({**p, "entries": entries})
    return pieces, store


def _load_pieces(gm: fx.GraphModule, cc: CompilationConfig, pieces: list[dict],
                 store: dict[str, bytes]) -> StitchingRecord:
    """Put a PiecewiseBackend over each piece's loaded artifacts in the stitching graph; each
    distinct artifact is deserialized (and counted) once, as vLLM's load_all does."""
    from torch._inductor.standalone_compile import AOTCompiledArtifact

    record = StitchingRecord(gm)
    loaded: dict[str, Any] = {}
    for p in pieces:
        runnables = {}
        for r, ref in p["entries"].items():
            digest = ref["sha256"]
            if digest not in loaded:
                data = store.get(digest)
                if data is None or hashlib.sha256(data).hexdigest() != digest:
                    raise RuntimeError(f"piece {p['index']}'s artifact for {r} does not match the "
                                       "SHA-256 recorded for it")
                loaded[digest] = AOTCompiledArtifact.deserialize(data)
                compilation_counter.num_compiled_artifacts_loaded += 1
            runnables[r] = loaded[digest]
            if p.get("single_output"):  # a loaded artifact returns a list even for one value
                runnables[r] = first_output(runnables[r])
        backend = PiecewiseBackend.from_runnables(cc, p["index"], p["sym_shape_indices"],
                                                  runnables)
        record.install(p["submod"], wrap_with_cudagraph_if_needed(backend, cc), backend=backend)
    return record


def range_key(r: Range) -> str:
    return f"{r.start}_{r.end}"
