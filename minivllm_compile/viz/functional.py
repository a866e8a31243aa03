"""The functional graph a compile's post-grad passes start from, without Inductor: Dynamo, then
AOTAutograd's functionalization, then the passes given, then the graph run as plain FX (notebook
05 and its exercises). Seconds instead of an Inductor compile, and the graph stays readable."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._dynamo.backends.common import aot_autograd


def functional_graph(fn: Callable, call: Callable[[Callable], Any], *, v2: bool = False,
                     passes: Sequence[Callable[[torch.fx.Graph], Any]] = (),
                     keep_inference_input_mutations: bool = False,
                     ) -> tuple[Any, torch.fx.GraphModule]:
    """Compile `fn` with Dynamo and AOTAutograd, apply `passes` (each called on the forward graph,
    in order) and run it as FX: returns (call(the compiled fn), the graph module the passes left).

    `v2`: Inductor's `enable_auto_functionalized_v2`, which decides the form a mutating custom op
    takes in the graph (vLLM sets it False). `keep_inference_input_mutations`: a write into an
    input stays in the graph as a `copy_`, as Inductor keeps it. Dynamo is reset before and after,
    so the compile never leaks into the caller's next torch.compile."""
    graphs = []

    def fw_compiler(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        for p in passes:
            p(gm.graph)
        gm.recompile()
        graphs.append(gm)
        return gm

    backend = aot_autograd(fw_compiler=fw_compiler,
                           keep_inference_input_mutations=keep_inference_input_mutations)
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(enable_auto_functionalized_v2=v2):
            out = call(torch.compile(fn, fullgraph=True, backend=backend))
    finally:
        torch._dynamo.reset()
    if len(graphs) != 1:
        raise RuntimeError(f"expected one forward graph, got {len(graphs)}: functional_graph needs "
                           "`call` to run the compiled fn once, on one set of shapes")
    return out, graphs[0]
