"""PiecewiseBackend: one compiled piece of the split graph, compiled for every entry up front, and
dispatched by num_tokens at run time (vLLM's compilation/piecewise_backend.py; seed §5, §6).

Entries: each compile size is a single-size Range(n, n) compiled on concrete inputs (a static
kernel); each compile range keeps num_tokens symbolic (a dynamic kernel). A size wins over the
range containing it. A num_tokens outside every entry is an error: no recompile, no fallback.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch._logging import trace_structured
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from minivllm_compile.compilation.compiler_interface import CompiledEntry
from minivllm_compile.config import Range

if TYPE_CHECKING:
    from minivllm_compile.compilation.backends import VllmBackend


@dataclass
class RangeEntry:
    compile_range: Range
    compiled: CompiledEntry | None = None


def _concretize(value: Any, size: int) -> Any:
    """Substitute every symbol in a SymInt expression by `size` (s0 -> 512, 2*s0 -> 1024)."""
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        return int(expr.subs({s: size for s in expr.free_symbols}))
    return value


def create_concrete_args(graph: fx.GraphModule, size: int) -> list[Any]:
    """The piece's inputs with num_tokens fixed to `size`: ints for SymInts, and fake tensors with
    concrete sizes, strides and storage offsets. Inductor specialises on them: a static kernel."""
    fake_mode = FakeTensorMode(shape_env=ShapeEnv())
    args = []
    for node in graph.graph.nodes:
        if node.op != "placeholder":
            break
        value = node.meta["example_value"]
        if isinstance(value, torch.Tensor):
            shape = [_concretize(d, size) for d in value.shape]
            stride = [_concretize(d, size) for d in value.stride()]
            offset = _concretize(value.storage_offset(), size)
            extent = offset + sum((n - 1) * st
                                  for n, st in zip(shape, stride)) + 1 if all(shape) else offset
            # a view into a storage large enough for the offset, as the real input is
            with fake_mode:
                base = torch.empty(extent, dtype=value.dtype, device=value.device)
                value = base.as_strided(shape, stride, offset)
        else:
            value = _concretize(value, size)
        args.append(value)
    return args


def get_fake_args_from_graph(graph: fx.GraphModule) -> list[Any]:
    """The piece's inputs exactly as Dynamo traced them: num_tokens stays a symbol, so Inductor
    generates one kernel taking it as a runtime argument."""
    return [n.meta["example_value"] for n in graph.graph.nodes if n.op == "placeholder"]


class PiecewiseBackend:
    def __init__(self, graph: fx.GraphModule, vllm_backend: "VllmBackend",
                 piecewise_compile_index: int,
                 total_piecewise_compiles: int, sym_shape_indices: list[int],
                 submod_name: str = ""):
        self.graph = graph
        self.submod_name = submod_name  # its name in the split graph (submod_0, ...), as in vLLM
        self.vllm_backend = vllm_backend
        self.total_piecewise_compiles = total_piecewise_compiles
        if not sym_shape_indices:
            raise RuntimeError(f"piece {piecewise_compile_index} takes no num_tokens argument; "
                               "a piece must depend on the marked dynamic dimension")
        self._init_dispatch(vllm_backend.compilation_config, piecewise_compile_index,
                            sym_shape_indices)
        self.range_entries: dict[Range, RangeEntry] = {}
        # a size is its own single-size range, winning over its range
        for size in self.compile_sizes:
            self.range_entries[Range(size, size)] = RangeEntry(Range(size, size))
        for r in self.compile_ranges:
            self.range_entries.setdefault(r, RangeEntry(r))
        self.compile_all_ranges()

    @classmethod
    def from_runnables(cls, compilation_config, index: int, sym_shape_indices: list[int],
                       runnables: dict[Range, Any]) -> "PiecewiseBackend":
        """A piece loaded from the cache: the same dispatch, nothing compiled."""
        self = cls.__new__(cls)
        self.graph, self.vllm_backend = None, None
        self._init_dispatch(compilation_config, index, sym_shape_indices)
        self.range_entries = {r: RangeEntry(r, CompiledEntry(fn, r, index))
                              for r, fn in runnables.items()}
        return self

    def _init_dispatch(self, cc, index: int, sym_shape_indices: list[int]) -> None:
        """What __call__ reads, for a compiled piece and a loaded one alike."""
        self.compilation_config = cc
        self.piecewise_compile_index, self.sym_shape_indices = index, sym_shape_indices
        self.compile_ranges = cc.get_compile_ranges()
        self.compile_sizes = list(cc.compile_sizes or [])  # None is [] (seed §5's bug: gone)
        self._entry_for_shape: dict[int, RangeEntry] = {}  # filled by __call__

    def compile_all_ranges(self) -> None:
        """Compile every entry now, at start-up, so no request ever waits for a compile (§5)."""
        for entry in self.range_entries.values():
            r = entry.compile_range
            self._log_compile_start(r)
            args = create_concrete_args(self.graph, r.start) if r.is_single_size() \
                else get_fake_args_from_graph(self.graph)
            entry.compiled = self.vllm_backend.compiler_manager.compile(
                self.graph, args, r, graph_index=self.piecewise_compile_index)

    def _log_compile_start(self, r: Range) -> None:
        """What vLLM records for TORCH_TRACE (tlparse lists it): an artifact per piece and entry,
        and the piece's graph once (the same graph serves every size)."""
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": "vllm_piecewise_compile_start", "encoding": "json"},
            payload_fn=lambda: json.dumps({
                "piecewise_index": self.piecewise_compile_index, "submod_name": self.submod_name,
                "total_piecewise_compiles": self.total_piecewise_compiles,
                "compile_range_start": r.start, "compile_range_end": r.end,
                "is_single_size": r.is_single_size(),
                "is_cudagraph_capture_size":
                    r.start in (self.compilation_config.cudagraph_capture_sizes or ())}))
        if not getattr(self, "_graph_logged", False):
            self._graph_logged = True
            trace_structured("graph_dump", metadata_fn=lambda: {"name": f"vllm_{self.submod_name}"},
                             payload_fn=lambda: self.graph.print_readable(print_output=False))

    def _find_range_for_shape(self, runtime_shape: int) -> RangeEntry | None:
        if runtime_shape in self.compile_sizes:
            return self.range_entries[Range(runtime_shape, runtime_shape)]
        for r in self.compile_ranges:
            if runtime_shape in r:
                return self.range_entries[r]
        return None

    def __call__(self, *args: Any) -> Any:
        runtime_shape = args[self.sym_shape_indices[0]]
        entry = self._entry_for_shape.get(runtime_shape)  # a size seen before: one dict lookup
        if entry is not None:
            return entry.compiled.runnable(*args)
        entry = self._find_range_for_shape(runtime_shape)
        if entry is None:
            raise ValueError(
                f"num_tokens={runtime_shape} is outside every compiled entry (sizes "
                f"{self.compile_sizes}, ranges {self.compile_ranges}); raise "
                "max_num_batched_tokens or add a compile size/range to the CompilationConfig "
                "(nothing is recompiled at run time)")
        self._entry_for_shape[runtime_shape] = entry
        return entry.compiled.runnable(*args)


@dataclass
class StitchingRecord:
    """What the backend built, in one place: the stitching graph, each compiled piece's
    PiecewiseBackend, what the stitching graph calls in each submodule's place, and the stitching
    function written from it. The views (viz/, the notebooks) and the artifact writer
    (caching.py) read this, never split_gm's attributes through wrappers.

    split_gm    the stitching graph (vLLM's split_gm): it calls the compiled pieces and, between
                them, the splitting ops (attention, conv), which run eagerly
    backends    per compiled piece, by submodule name in program order: its PiecewiseBackend (its
                graph, index, sym_shape_indices and compiled entries, range_entries)
    runnables   per submodule the stitching graph calls through something else: that callable, as
                installed last. A compiled piece's PiecewiseBackend, under a CUDAGraphWrapper
                (cuda_graph.py) when the mode has piecewise graphs, under a profiler range
                (nvtx.RangeWrapper) with layerwise tracing on; a splitting submodule appears only
                when wrapped in a range
    execution_code, submod_names, consts
                the stitching function's source, the submodules its `__vllm_submods__` list
                names, and its constants (codegen.generate_execution_code); set by `stitch`
    execution_fn
                that function, `exec`'d and bound to `runnables`: what runs at every call

    Filled through `install` by the PiecewiseCompileInterpreter (a compile), by the mega
    artifact's load (caching._load_pieces) and by nvtx.add_stitching_ranges. VllmBackend.record
    and VllmSerializableFunction.record are this object.
    """

    split_gm: fx.GraphModule
    backends: dict[str, PiecewiseBackend] = field(default_factory=dict)
    runnables: dict[str, Callable] = field(default_factory=dict)
    execution_code: str | None = None
    submod_names: list[str] = field(default_factory=list)
    consts: list[Any] = field(default_factory=list)
    execution_fn: Callable | None = None

    def install(self, submod_name: str, runnable: Callable,
                backend: PiecewiseBackend | None = None) -> None:
        """Make the stitching graph call `runnable` for `submod_name` (an instance attribute wins
        over the submodule of that name, as vLLM's interpreter relies on), and record it."""
        self.split_gm.__dict__[submod_name] = runnable
        self.runnables[submod_name] = runnable
        if backend is not None:
            self.backends[submod_name] = backend

    def called_for(self, submod_name: str) -> Callable:
        """What the stitching graph calls for this submodule: the installed callable, else the
        submodule itself (a splitting op's piece)."""
        return self.runnables.get(submod_name) or getattr(self.split_gm, submod_name)

    def stitch(self, saved: tuple[str, list[str], list[Any]] | None = None) -> Callable:
        """The stitching function, bound to what is installed now: written from split_gm, or the
        one saved with an AOT artifact, `(code, submod_names, consts)`, exec'd again as saved (a
        load never writes it anew). Install the wrappers first: the list it binds is read here."""
        from minivllm_compile.compilation.codegen import (
            compile_execution_fn,
            generate_execution_code,
        )

        code, names, consts = saved if saved is not None else generate_execution_code(
            self.split_gm)
        self.execution_code, self.submod_names, self.consts = code, list(names), list(consts)
        callables = {name: self.called_for(name) for name, _ in self.split_gm.named_children()}
        self.execution_fn = compile_execution_fn(code, callables, self.submod_names, self.consts)
        return self.execution_fn
