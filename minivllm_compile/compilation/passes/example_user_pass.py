"""A pass of your own, to copy: `SiluAndMulToNativePass` turns the opaque custom op
`minivllm::silu_and_mul` back into the torch ops it stands for, so that Inductor can fuse them with
their neighbours (the custom op is a call Inductor cannot look into).

Give it to a model as vLLM takes a user's pass, through the Inductor config:

    CompilationConfig(
        inductor_compile_config={"post_grad_custom_post_pass": SiluAndMulToNativePass()})

`PostGradPassManager` then runs it after its own passes and before FixFunctionalizationPass, on
every piece and entry; its uuid (the hash of this class's source) joins the cache key, so editing
it recompiles. It walks the graph by hand, where vLLM's fusion passes use Inductor's pattern
matcher (fusion/qk_norm_rope_fusion.py): for one op with one form, a walk is enough.
"""

from __future__ import annotations

import operator

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._higher_order_ops.auto_functionalize import auto_functionalized

import minivllm_compile.ops  # noqa: F401  (registers torch.ops.minivllm.*)
from minivllm_compile.compilation.passes.fx_utils import is_func
from minivllm_compile.compilation.passes.vllm_inductor_pass import VllmInductorPass

aten = torch.ops.aten


class SiluAndMulToNativePass(VllmInductorPass):
    """out = silu(x[..., :d]) * x[..., d:] in place of
    auto_functionalized(silu_and_mul, out=, input=x)."""

    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        self.matched_count = 0
        for node in list(graph.nodes):
            # post-grad, an in-place custom op is functional: res = auto_functionalized(op, out=,
            # input=) and res[1] is the written `out`
            if not (is_func(node, auto_functionalized)
                    and node.args[0] == torch.ops.minivllm.silu_and_mul.default):
                continue
            x = node.kwargs["input"]
            d = x.meta["val"].shape[-1] // 2
            with graph.inserting_before(node):
                gate = self._call(graph, aten.slice.Tensor, x, -1, 0, d)
                up = self._call(graph, aten.slice.Tensor, x, -1, d, 2 * d)
                # silu(g) = g * sigmoid(g): post-grad graphs hold decomposed ops only (Inductor has
                # no lowering for aten.silu, it decomposes it before this point)
                silu = self._call(graph, aten.mul.Tensor, gate,
                                  self._call(graph, aten.sigmoid.default, gate))
                out = self._call(graph, aten.mul.Tensor, silu, up)
            for user in list(node.users):
                if is_func(user, operator.getitem) and user.args[1] == 1:
                    user.replace_all_uses_with(out)
                    graph.erase_node(user)
            if not node.users:  # res[0] (the op's None result) is never read
                graph.erase_node(node)
                self.matched_count += 1

    @staticmethod
    def _call(graph: fx.Graph, op, *args) -> fx.Node:
        """A new node with the fake value Inductor's lowering reads (node.meta["val"])."""
        node = graph.call_function(op, args)
        vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
        with detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)]):
            node.meta["val"] = op(*vals)
        return node
