"""`FixFunctionalizationPass` (seed §1; vLLM's passes/utility/fix_functionalization.py).

AOT functionalization turns every in-place custom op into
    res = auto_functionalized(op, out=buf, input=x, ...)    # v1: Inductor clones `buf` first
    y = res[1]                                              # the mutated `out`
Inductor's own reinplacing removes the clone only when it can prove the input dead afterwards;
a mutated *view* (RoPE on q and k, which are slices of the qkv matmul) it cannot. This pass turns
the ops it knows back into direct in-place calls, `op(buf, x, ...)`, and points every `res[i]` at
the argument `i` stands for. It runs last: the graph is no longer functional after it, and an
in-place call has no users, so a dead-code pass that counts users would delete it.

A piece that mutates a graph input (the residual, under VLLM_COMPILE) ends with AOTAutograd's
write-back `copy_(arg, res[i])`. Once the op writes `arg` itself that is `copy_(arg, arg)`, which
the pass erases. The one reason it leaves a listed op functional is a real reader of the old
value after it (`_read_later`); vLLM's pass has no such check.
"""

from __future__ import annotations

import logging
import operator
from collections import Counter
from typing import ClassVar

import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized, auto_functionalized_v2

import minivllm_compile.distributed.fused_allreduce_norm  # registers its fused op
import minivllm_compile.ops  # noqa: F401  (registers torch.ops.minivllm.*)
from minivllm_compile.compilation.passes.fx_utils import is_func
from minivllm_compile.compilation.passes.vllm_inductor_pass import VllmInductorPass

logger = logging.getLogger(__name__)
minivllm = torch.ops.minivllm


class FixFunctionalizationPass(VllmInductorPass):
    # op -> {getitem index: mutated argument}. Index 0 is the op's return value (None for all of
    # these; an op that returns something keeps it, through the direct call); 1.. are the mutated
    # arguments in schema order. Any other op is left to Inductor.
    MUTATED_ARGS: ClassVar[dict[torch._ops.OpOverload, dict[int, str]]] = {
        minivllm.rms_norm.default: {1: "out"},
        minivllm.fused_add_rms_norm.default: {1: "input", 2: "residual"},
        minivllm.rotary_embedding.default: {1: "query", 2: "key"},
        minivllm.fused_qk_norm_rope.default: {1: "qkv"},
        minivllm.silu_and_mul.default: {1: "out"},
        # FP8 (vLLM's _C names): the static quant, and what the fusion passes
        # turn norm/act + quant into
        minivllm.static_scaled_fp8_quant.default: {1: "result"},
        minivllm.rms_norm_static_fp8_quant.default: {1: "result"},
        minivllm.fused_add_rms_norm_static_fp8_quant.default: {1: "result", 2: "residual"},
        minivllm.silu_and_mul_quant.default: {1: "result"},
        # what AllReduceFusionPass makes of all-reduce + RMSNorm (vLLM lists it here too, less
        # FlashInfer's quant outputs)
        minivllm.flashinfer_trtllm_fused_allreduce_norm.default:
            {1: "allreduce_in", 2: "residual", 3: "norm_out"},
    }

    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        self.nodes_to_remove: list[fx.Node] = []
        self.defunctionalized: Counter[str] = Counter()
        self.skipped_v2: Counter[str] = Counter()
        self.skipped_read_later: Counter[str] = Counter()
        order = {n: i for i, n in enumerate(graph.nodes)}
        for node in graph.nodes:
            if is_func(node, auto_functionalized_v2) and node.args[0] in self.MUTATED_ARGS:
                self.skipped_v2[node.args[0].name()] += 1
                continue
            if not is_func(node, auto_functionalized) or node.args[0] not in self.MUTATED_ARGS:
                continue
            op = node.args[0]
            if name := self._read_later(node, order):
                # an earlier pass left a reader of the old value after the op (Inductor's
                # reorder_for_locality, a CSE): writing in place would change what it reads.
                # Inductor's clone keeps it right.
                logger.info("FixFunctionalizationPass: %s is read after %s; left functional",
                               node.kwargs[name], node.name)
                self.skipped_read_later[op.name()] += 1
                continue
            if op == minivllm.rotary_embedding.default and self._rope_on_split_views(node, order):
                self._defunctionalize_rope_on_split_views(graph, node)
            else:
                self.defunctionalize(graph, node, self.MUTATED_ARGS[op])
            self.defunctionalized[op.name()] += 1
        if self.skipped_v2:
            logger.warning(
                "FixFunctionalizationPass handles auto_functionalized (v1) only; left %s as "
                "auto_functionalized_v2 to Inductor. Compile with "
                "torch._inductor.config.enable_auto_functionalized_v2=False (as vLLM does).",
                dict(self.skipped_v2))
        self.erase_self_copies(graph)
        self.dump_graph(graph, "before_cleanup")
        doomed = set(self.nodes_to_remove)
        for node in reversed([n for n in graph.nodes if n in doomed]):  # users before producers
            graph.erase_node(node)
        logger.debug("de-functionalized %s, removed %d nodes",
                     dict(self.defunctionalized), len(self.nodes_to_remove))
        self.nodes_to_remove = []

    def _read_later(self, node: fx.Node, order: dict[fx.Node, int]) -> str | None:
        """The first mutated argument some later node reads directly (views are not followed).
        In a functional graph everything after the op reads its `res[i]`; a later user of the
        argument itself reads the old value, except a `copy_` *into* it: that overwrites it
        whole (AOTAutograd's write-back of a mutated graph input)."""
        for name in self.MUTATED_ARGS[node.args[0]].values():
            arg = node.kwargs[name]
            if not isinstance(arg, fx.Node):
                continue
            later = [u for u in arg.users if order.get(u, -1) > order[node]]
            if any(not self._copies_into(u, arg) for u in later):
                return name
        return None

    @staticmethod
    def _copies_into(node: fx.Node, dst: fx.Node) -> bool:
        return is_func(node, torch.ops.aten.copy_.default) and node.args[0] is dst

    def erase_self_copies(self, graph: fx.Graph) -> None:
        """The write-back `copy_(arg, res[i])` of an op now writing `arg` in place reads
        `copy_(arg, arg)`: a no-op (eager returns early, Inductor's copy_ lowering too), so it
        goes. Its work is done by the in-place call, which Inductor sees mutate the input."""
        for node in graph.find_nodes(op="call_function", target=torch.ops.aten.copy_.default):
            if node.args[0] is node.args[1] and not node.users:
                self.nodes_to_remove.append(node)

    def defunctionalize(self, graph: fx.Graph, node: fx.Node, mutated_args: dict[int, str]) -> None:
        self.replace_users_with_mutated_args(node, mutated_args)
        call = self.insert_defunctionalized(graph, node)
        # an op that returns a value as well as mutating its arguments: `res[0]` is that value,
        # which the direct call now returns (vLLM's insert_defunctionalized does the same)
        if (result := self.getitem_users(node).get(0)) is not None:
            result.replace_all_uses_with(call)
            self.nodes_to_remove.append(result)
        self.nodes_to_remove.append(node)

    def replace_users_with_mutated_args(self, node: fx.Node, mutated_args: dict[int, str]) -> None:
        """Each `res[i]`, i >= 1, becomes the argument the op mutated in place."""
        for idx, user in self.getitem_users(node).items():
            if idx == 0:  # the op's return value, not a mutated argument
                if idx in mutated_args:
                    raise AssertionError(f"MUTATED_ARGS[{node.args[0]}] maps index 0, the op's "
                                         "return value; mutated arguments start at 1")
                continue
            user.replace_all_uses_with(node.kwargs[mutated_args[idx]])
            self.nodes_to_remove.append(user)

    @staticmethod
    def getitem_users(node: fx.Node) -> dict[int, fx.Node]:
        return {u.args[1]: u for u in node.users if is_func(u, operator.getitem)}

    @staticmethod
    def insert_defunctionalized(graph: fx.Graph, node: fx.Node) -> fx.Node:
        """The direct in-place call, before `node`. Positional, in schema order: Inductor's
        fallback lowering refuses a kwarg named `out` (it takes it for an out= variant)."""
        op = node.args[0]
        missing = [a.name for a in op._schema.arguments if a.name not in node.kwargs]
        if missing:
            raise AssertionError(f"{node.name}: auto_functionalized lacks {missing} of {op}")
        with graph.inserting_before(node):
            args = tuple(node.kwargs[a.name] for a in op._schema.arguments)
            return graph.call_function(op, args=args)

    # --- RoPE on q and k that are slices of one qkv matmul ------------------------------------
    # Functionalized, the rotated q and k are scattered back into a copy of qkv:
    #     q, k, v = split_with_sizes(mm, ...); res = auto_functionalized(rope, query=q, key=k)
    #     qkv2 = slice_scatter(slice_scatter(mm, res[1], ...), res[2], ...)
    # In place, RoPE has already written into mm's memory, so qkv2 *is* mm: no scatter copies.

    def _rope_on_split_views(self, node: fx.Node, order: dict[fx.Node, int]) -> bool:
        q, k = node.kwargs["query"], node.kwargs["key"]
        if not (isinstance(q, fx.Node) and isinstance(k, fx.Node) and is_func(q, operator.getitem)
                and is_func(k, operator.getitem) and q.args[0] is k.args[0]
                and is_func(q.args[0], torch.ops.aten.split_with_sizes.default)):
            return False
        mm = q.args[0].args[0]
        scatters = [u for g in self.getitem_users(node).values() for u in g.users]
        # ... and nothing but those scatters reads mm after RoPE (it would expect the old q, k)
        return all(is_func(s, torch.ops.aten.slice_scatter.default)
                   and (s.args[0] is mm or s.args[0] in scatters) for s in scatters) and all(
            order.get(u, -1) < order[node] or u in scatters for u in mm.users)

    def _defunctionalize_rope_on_split_views(self, graph: fx.Graph, node: fx.Node) -> None:
        mm = node.kwargs["query"].args[0].args[0]
        for getitem in self.getitem_users(node).values():
            for scatter in list(getitem.users):
                scatter.replace_all_uses_with(mm)
                self.nodes_to_remove.append(scatter)
            self.nodes_to_remove.append(getitem)
        self.insert_defunctionalized(graph, node)
        self.nodes_to_remove.append(node)
