"""`NoOpEliminationPass`: drop reshapes, views and slices that return their input's shape
(vLLM's passes/utility/noop_elimination.py, reduced to its core). Pattern passes that follow
match `op(x)` and would miss `op(reshape(x, x.shape))`; Inductor's own noop removal runs before
the custom passes and does not see what an earlier custom pass leaves behind.
"""

from __future__ import annotations

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from minivllm_compile.compilation.passes.fx_utils import is_func
from minivllm_compile.compilation.passes.vllm_inductor_pass import VllmInductorPass

aten = torch.ops.aten


def _shape(node) -> torch.Size | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.shape if isinstance(val, torch.Tensor) else None


def _same_shape(a, b) -> bool:
    """Equal without adding a guard: symbolic sizes count only when provably equal."""
    sa, sb = _shape(a), _shape(b)
    return (sa is not None and sb is not None and len(sa) == len(sb)
            and all(statically_known_true(x == y) for x, y in zip(sa, sb)))


class NoOpEliminationPass(VllmInductorPass):
    RESHAPES = (aten.reshape.default, aten.view.default, aten._unsafe_view.default)

    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        self.removed = 0
        for node in list(graph.nodes):
            if node.op != "call_function":
                continue
            if node.target in self.RESHAPES:
                src = node.args[0]
                # reshape(reshape(x, a), b) is reshape(x, b)
                if isinstance(src, fx.Node) and src.target in self.RESHAPES:
                    node.update_arg(0, src.args[0])
                    self._erase_if_unused(graph, src)
                    src = node.args[0]
                if _same_shape(node, src):
                    self._replace(graph, node, src)
            elif is_func(node, aten.slice.Tensor):
                # step 1 and as long as its input along `dim`: it must be [0:len]
                step = node.args[4] if len(node.args) > 4 else 1
                if step == 1 and _same_shape(node, node.args[0]):
                    self._replace(graph, node, node.args[0])
            elif is_func(node, aten.slice_scatter.default):
                base, src = node.args[:2]
                if _same_shape(base, src):  # src overwrites all of base
                    self._replace(graph, node, src)

    def _replace(self, graph: fx.Graph, node: fx.Node, by: fx.Node) -> None:
        node.replace_all_uses_with(by)
        graph.erase_node(node)
        self.removed += 1

    def _erase_if_unused(self, graph: fx.Graph, node: fx.Node) -> None:
        if not node.users:
            graph.erase_node(node)
            self.removed += 1
