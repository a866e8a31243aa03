"""CUDA graphs: CUDAGraphWrapper, the per-step dispatcher, and the CPU stand-in (vLLM's
compilation/cuda_graph.py, and vLLM 0.33's v1/cudagraph_dispatcher.py: 0.34's model runner V2
dispatches in CudaGraphManager, v1/worker/gpu/cudagraph_utils.py).

A graph is recorded for one batch shape and replays the same kernels on the same addresses: its
inputs must sit in the buffers it was recorded on, and its outputs are always the same tensors,
overwritten by the next replay. So a step is padded up to a captured size (BatchDescriptor), and
the wrappers read from the forward context which runtime mode and descriptor the dispatcher chose.
On a CPU there is no graph to record; StaticBufferReplay keeps the same contract (static inputs,
static outputs, re-run on replay) so the hazards can be shown and tested there.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from minivllm_compile.compilation.counter import compilation_counter
from minivllm_compile.compilation.monitor import validate_cudagraph_capturing_enabled
from minivllm_compile.config import CompilationConfig, CUDAGraphMode
from minivllm_compile.config.compilation import AttentionCGSupport
from minivllm_compile.forward_context import get_forward_context, is_forward_context_available


@dataclasses.dataclass(frozen=True)
class BatchDescriptor:
    """The key of one captured graph: the padded batch (vLLM's; its LoRA fields do not apply)."""

    num_tokens: int
    num_reqs: int | None = None  # None for PIECEWISE: a piece serves any number of requests
    uniform: bool = False  # every request has the same query length (a decode batch)


_graph_pool = None


def get_global_graph_pool() -> Any:
    """One memory pool for every graph (vLLM's current_platform.get_global_graph_pool): graphs
    replay one after another, so they may share the memory of their intermediates."""
    global _graph_pool
    if _graph_pool is None:
        _graph_pool = torch.cuda.graph_pool_handle()
    return _graph_pool


class StaticBufferReplay:
    """The CPU stand-in for a CUDA graph, never one: "capture" runs the runnable once and keeps its
    outputs as static buffers; "replay" runs the runnable again on the static inputs and writes the
    static outputs, returning the same tensors every time."""

    def __init__(self, runnable: Callable, static_args: tuple, kwargs: dict):
        self.runnable, self.static_args, self.kwargs = runnable, static_args, kwargs
        leaves, self.spec = tree_flatten(runnable(*static_args, **kwargs))
        self.static_outputs = [x.clone() if isinstance(x, torch.Tensor) else x for x in leaves]
        self.output = tree_unflatten(self.static_outputs, self.spec)

    def replay(self) -> None:
        leaves, _ = tree_flatten(self.runnable(*self.static_args, **self.kwargs))
        for static, new in zip(self.static_outputs, leaves):
            if isinstance(static, torch.Tensor):
                static.copy_(new)


@dataclasses.dataclass
class CUDAGraphEntry:
    batch_descriptor: BatchDescriptor
    cudagraph: Any = None  # torch.cuda.CUDAGraph, or a StaticBufferReplay on a CPU
    output: Any = None
    # what the graph reads: the caller's tensors, or copies (cudagraph_copy_inputs)
    static_args: tuple = ()


class CUDAGraphWrapper:
    """Wraps a runnable with capture and replay, keyed by the forward context's BatchDescriptor.
    A step whose runtime mode is NONE or another wrapper's runs the runnable plainly, which is how
    a FULL wrapper around the model and PIECEWISE wrappers inside it coexist."""

    def __init__(self, runnable: Callable, compilation_config: CompilationConfig,
                 runtime_mode: CUDAGraphMode):
        if not isinstance(runtime_mode, CUDAGraphMode) or runtime_mode not in (
                CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL):
            raise ValueError("CUDAGraphWrapper runtime_mode must be PIECEWISE or "
                             f"FULL, got {runtime_mode!r}")
        self.runnable, self.compilation_config, self.runtime_mode = (
            runnable, compilation_config, runtime_mode)
        self.concrete_cudagraph_entries: dict[BatchDescriptor, CUDAGraphEntry] = {}

    # the runnable's attributes (range_entries, ...) stay visible
    def __getattr__(self, key: str) -> Any:
        if key == "runnable":
            raise AttributeError(key)
        return getattr(self.runnable, key)

    def unwrap(self) -> Callable:
        return self.runnable

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not is_forward_context_available():
            return self.runnable(*args, **kwargs)
        ctx = get_forward_context()
        mode = ctx.cudagraph_runtime_mode or CUDAGraphMode.NONE
        if mode == CUDAGraphMode.NONE or mode != self.runtime_mode:
            return self.runnable(*args, **kwargs)
        desc = ctx.batch_descriptor
        entry = self.concrete_cudagraph_entries.get(desc)
        if entry is None:
            return self._capture(desc, args, kwargs)
        if self.compilation_config.cudagraph_copy_inputs:
            for static, new in zip(entry.static_args, args):
                if isinstance(static, torch.Tensor) and new.data_ptr() != static.data_ptr():
                    static.copy_(new)
        # without copying, the graph reads the tensors it was captured on: a new tensor is not seen
        # (vLLM checks the addresses only when debug logging is on)
        entry.cudagraph.replay()
        return entry.output

    def _capture(self, desc: BatchDescriptor, args: tuple, kwargs: dict) -> Any:
        try:
            validate_cudagraph_capturing_enabled()
        except RuntimeError as e:
            raise RuntimeError(f"CUDAGraphWrapper({self.runtime_mode.name}) has no graph for "
                               f"{desc}. {e}. The dispatcher gave a descriptor that was never "
                               "captured") from None
        if self.compilation_config.cudagraph_copy_inputs:
            args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        entry = CUDAGraphEntry(desc, static_args=args)
        if any(isinstance(a, torch.Tensor) and a.is_cuda for a in args):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=get_global_graph_pool()):
                # lives in the pool, rewritten by each replay
                entry.output = self.runnable(*args, **kwargs)
            entry.cudagraph = graph
        else:
            entry.cudagraph = StaticBufferReplay(self.runnable, args, kwargs)
            entry.output = entry.cudagraph.output
        self.concrete_cudagraph_entries[desc] = entry
        compilation_counter.num_cudagraph_captured += 1
        if isinstance(entry.cudagraph, torch.cuda.CUDAGraph):
            entry.cudagraph.replay()  # recording ran nothing: compute this step's output
        return entry.output


def wrap_with_cudagraph_if_needed(piece: Any, compilation_config: CompilationConfig) -> Any:
    """A compiled piece under a PIECEWISE wrapper when the mode has piecewise graphs (vLLM's
    function of the same name, used for a compiled piece and a loaded one alike)."""
    if not compilation_config.cudagraph_mode.has_piecewise_cudagraphs():
        return piece
    return CUDAGraphWrapper(piece, compilation_config, CUDAGraphMode.PIECEWISE)


def min_cudagraph_support(layers: Any, device: torch.device) -> tuple[AttentionCGSupport, str]:
    """The weakest support among the splitting ops' layers, each declaring its own (vLLM reads
    each attention backend's builder's _cudagraph_support)."""
    found = [(layer.cudagraph_support(device), type(layer).__name__) for layer in layers
             if hasattr(layer, "cudagraph_support")]
    return min(found, key=lambda f: f[0].value, default=(AttentionCGSupport.ALWAYS,
                                                         "no splitting op"))


class CudagraphDispatcher:
    """Per step: the runtime mode and padded BatchDescriptor (vLLM's CudagraphDispatcher). Its keys
    are the only graphs that exist; a step above the largest capture size gets NONE."""

    def __init__(self, compilation_config: CompilationConfig):
        cc = self.compilation_config = compilation_config
        self.cudagraph_mode = cc.cudagraph_mode
        self.cudagraph_keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.PIECEWISE: set(), CUDAGraphMode.FULL: set()}
        if self.cudagraph_mode == CUDAGraphMode.NONE:
            return
        sizes, max_size = cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size
        # a size pads up to the next capture size; a capture size maps to itself
        self._bs_to_padded_graph_size = [0] * (max_size + 1)
        for start, end in zip([0, *sizes], [*sizes, max_size + 1]):
            for bs in range(start, end):
                self._bs_to_padded_graph_size[bs] = start if bs == start else end
        for size in cc.compile_sizes or []:  # vLLM: a compile size padding changes is never run
            if size <= max_size and self._bs_to_padded_graph_size[size] != size:
                raise ValueError(f"CompilationConfig.compile_sizes contains {size}, "
                                 "which CUDA-graph padding turns into "
                                 f"{self._bs_to_padded_graph_size[size]}: use sizes "
                                 "from cudagraph_capture_sizes")
        mixed = self.cudagraph_mode.mixed_mode()
        if mixed != CUDAGraphMode.NONE:
            for s in sizes:
                self.cudagraph_keys[mixed].add(self._descriptor(s, uniform=False, mode=mixed))
        if (self.cudagraph_mode.separate_routine() and self.cudagraph_mode.decode_mode()
            == CUDAGraphMode.FULL):
            for s in sizes:  # decode query length 1: every size is a uniform decode batch
                self.cudagraph_keys[CUDAGraphMode.FULL].add(
                    self._descriptor(s, uniform=True, mode=CUDAGraphMode.FULL))

    def _descriptor(self, num_tokens: int, uniform: bool, mode: CUDAGraphMode) -> BatchDescriptor:
        padded = self._bs_to_padded_graph_size[num_tokens]
        if mode == CUDAGraphMode.PIECEWISE:
            return BatchDescriptor(padded)
        # no scheduler here, so no max_num_seqs to cap it: n tokens hold at most n requests
        return BatchDescriptor(padded, num_reqs=padded, uniform=uniform)

    def dispatch(self, num_tokens: int, uniform_decode: bool = False) -> tuple[CUDAGraphMode,
                                                                               BatchDescriptor]:
        if (self.cudagraph_mode == CUDAGraphMode.NONE
            or num_tokens > self.compilation_config.max_cudagraph_capture_size):
            return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)
        uniform = uniform_decode and self.cudagraph_mode.separate_routine()
        full = self._descriptor(num_tokens, uniform, CUDAGraphMode.FULL)
        if full in self.cudagraph_keys[CUDAGraphMode.FULL]:
            return CUDAGraphMode.FULL, full
        piecewise = self._descriptor(num_tokens, False, CUDAGraphMode.PIECEWISE)
        if piecewise in self.cudagraph_keys[CUDAGraphMode.PIECEWISE]:
            return CUDAGraphMode.PIECEWISE, piecewise
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens)

    def get_capture_descs(self) -> list[tuple[CUDAGraphMode, list[BatchDescriptor]]]:
        """PIECEWISE first, then FULL; largest first, so smaller graphs reuse the pool's memory."""
        return [(m, sorted(self.cudagraph_keys[m], key=lambda d: d.num_tokens, reverse=True))
                for m in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL) if self.cudagraph_keys[m]]
