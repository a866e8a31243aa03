"""Layerwise ranges for profilers (seed §12; vLLM's --enable-layerwise-nvtx-tracing).

Every range is a torch.profiler record_function range (the profiler's trace shows it), and on CUDA
also an NVTX range (Nsight Systems shows it over the kernels it covers). Where they can go
depends on what still runs as Python:
- eager: a pre/post forward hook on every decoder layer;
- compiled: Dynamo drops torch.profiler.record_function inside traced code ("Profiler record
  function ... will be ignored", and a raw enter op is a graph break), so VLLM_COMPILE puts them
  where the stitching graph still calls Python: around
  every compiled piece and every splitting op (named after its layer, e.g.
  `model.layers.1.self_attn.attn`).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn

if TYPE_CHECKING:
    from minivllm_compile.compilation.piecewise_backend import StitchingRecord


def _push(name: str) -> Any:
    # always a profiler range (torch.profiler sees it on any device), and NVTX too on CUDA
    if torch.cuda.is_available():
        torch.cuda.nvtx.range_push(name)
    return torch.ops.profiler._record_function_enter_new(name, None)


def _pop(handle: Any) -> None:
    torch.ops.profiler._record_function_exit._RecordFunction(handle)
    if torch.cuda.is_available():
        torch.cuda.nvtx.range_pop()


def add_stitching_ranges(record: StitchingRecord) -> None:
    """A range around every submodule the stitching graph calls: a compiled piece named by its
    index, a splitting op after the layer it serves. Called for a freshly compiled and for a
    loaded stitching graph alike (caching.VllmSerializableFunction)."""
    for name, child in record.split_gm.named_children():
        runnable = record.called_for(name)  # a compiled piece's (maybe wrapped) PiecewiseBackend
        if isinstance(runnable, RangeWrapper):
            continue
        if name in record.backends:
            label = f"piece {record.backends[name].piecewise_compile_index} (compiled)"
        else:  # a splitting op: its layer_name argument
            names = [a for n in child.graph.nodes for a in n.args if isinstance(a, str)]
            label = names[0] if names else name
        record.install(name, RangeWrapper(runnable, label))


@contextmanager
def layer_range(name: str) -> Iterator[None]:
    handle = _push(name)
    try:
        yield
    finally:
        _pop(handle)


def add_layerwise_hooks(layers: nn.ModuleList, prefix: str = "model.layers") -> list:
    """A range around each layer's forward, for eager runs; returns the hook handles."""
    handles = []
    for i, layer in enumerate(layers):
        stack: list[Any] = []

        def pre(module, args, name=f"{prefix}.{i}", stack=stack):
            stack.append(_push(name))

        def post(module, args, output, stack=stack):
            _pop(stack.pop())

        handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
    return handles


class RangeWrapper(nn.Module):
    """Calls `runnable` inside a named range: how the stitching graph gets ranges around pieces."""

    def __init__(self, runnable: Callable, name: str):
        super().__init__()
        self.runnable, self.name = runnable, name

    def forward(self, *args: Any) -> Any:
        with layer_range(self.name):
            return self.runnable(*args)


def profiler_sees(op: torch._ops.OpOverload, *args: Any) -> bool:
    """Whether torch's profiler shows a call of `op` (as Inductor's code calls it: the OpOverload)
    as an event of its own. Not always for an op made by torch.library.custom_op: torch 2.14 runs
    its Python kernels without entering the C++ dispatcher where it can ("PyObject dispatch",
    pytorch#187949), and the dispatcher is what records an op's profiler event. The minivllm ops
    are registered as vLLM's are (ops.direct_register_custom_op), which does not take that path."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        op(*args)
    return any(e.name == op._schema.name for e in prof.events())
