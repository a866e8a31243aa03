"""`UnsafeCloneEliminationPass`: drop the copies the lowering made for in-place providers
(vLLM 0.34's compilation/passes/ir/clone_elimination.py).

An in-place provider (vllm_c's fused_add_rms_norm) is lowered writing into `clone(x)`. The clone
can go, and the provider write into `x` itself, when nothing reads `x` after the write, and `x` is
not an input of the graph the caller still owns: an input is fair game only if the
VllmIRInplaceFunctionalizationPass recorded it as donated (a `maybe_inplace` activation). A clone
nobody writes can go unless its result would then share memory with a graph input or output.

"Unsafe", as vLLM names it: it follows direct uses only, not views, which is enough for the graphs
vLLM (and this project) produce, not a proof for any graph.
"""

from __future__ import annotations

import logging

import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._ops import HigherOrderOperator, OpOverload

from minivllm_compile.compilation.passes.fx_utils import is_func
from minivllm_compile.compilation.passes.ir.utils import get_donated_input_ids
from minivllm_compile.compilation.passes.vllm_inductor_pass import VllmInductorPass

logger = logging.getLogger(__name__)


def clone_preserves_layout(clone: fx.Node, original: fx.Node) -> bool:
    a, b = clone.meta.get("val"), original.meta.get("val")
    if a is None or b is None:
        return True
    try:
        return tuple(a.stride()) == tuple(b.stride()) and a.storage_offset() == b.storage_offset()
    except (AttributeError, RuntimeError):
        return True


def user_writes_to_node(user: fx.Node, node: fx.Node) -> bool:
    """Whether `user` writes into `node` (its schema marks that argument written)."""
    if user.op == "output" or is_func(user, auto_functionalized):
        return False  # auto_functionalized writes a copy and hands it back
    if user.op == "call_function" and isinstance(user.target, HigherOrderOperator):
        return True  # unknown: assume it writes
    if not isinstance(user.target, OpOverload):
        return False  # operator.getitem and the like
    schema = user.target._schema
    return any(arg is node and schema.arguments[i].is_write for i, arg in enumerate(user.args))


def would_alias_graph_io(clone: fx.Node, original: fx.Node) -> bool:
    """Whether using `original` for `clone` would make a graph output share memory with a graph
    input or another output, which the caller may write. Unknown storage counts as aliasing."""
    from torch._inductor.fx_utils import get_node_storage

    clone_storage, original_storage = get_node_storage(clone), get_node_storage(original)
    if clone_storage is None or original_storage is None:
        return True
    graph = clone.graph
    outputs = {get_node_storage(n) for n in graph.output_node().all_input_nodes}
    inputs = {get_node_storage(n) for n in graph.find_nodes(op="placeholder")}
    return clone_storage in outputs and original_storage in inputs | outputs


class UnsafeCloneEliminationPass(VllmInductorPass):
    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        order = {node: i for i, node in enumerate(graph.nodes)}
        donated = get_donated_input_ids()
        self.removed = 0
        for node in list(graph.nodes):
            if not is_func(node, torch.ops.aten.clone.default):
                continue
            original = node.args[0]
            if not isinstance(original, fx.Node) or not clone_preserves_layout(node, original):
                continue
            writes = [order[u] for u in node.users if user_writes_to_node(u, node)]
            if len(writes) > 1:
                continue  # not a lowering's copy
            if writes:
                # the old value must not be read after the write, nor belong to the caller
                if any(order[u] > writes[0] for u in original.users):
                    continue
                if original.op == "placeholder" and order[original] not in donated:
                    continue
            elif would_alias_graph_io(node, original):
                continue
            node.replace_all_uses_with(original)
            graph.erase_node(node)
            self.removed += 1
        logger.debug(
            "%s removed %d clones (donated inputs %s)",
            self.pass_name,
            self.removed,
            sorted(donated),
        )
