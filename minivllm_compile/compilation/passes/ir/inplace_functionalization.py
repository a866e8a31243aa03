"""`VllmIRInplaceFunctionalizationPass`: `op.maybe_inplace(...)` -> `op(...)`, before AOTAutograd
(vLLM 0.34's compilation/passes/ir/inplace_functionalization.py).

The backend installs it as Inductor's `pre_grad_custom_pass`, so it sees each piece as Dynamo
traced it, before AOTAutograd functionalizes anything. `maybe_inplace` has the default overload's
signature, so the rewrite only swaps the node's target; the graph is functional after it, and
AOTAutograd keeps the IR op whole for the lowering. What it must check first: a donated activation
has no later reader (its contents are undefined after the call). A donated activation that is a
graph input is recorded (`donated_input_ids`): UnsafeCloneEliminationPass may then let an in-place
provider write into that input's memory instead of a copy.
"""

from __future__ import annotations

import logging
from collections import Counter

from torch import fx

from minivllm_compile.compilation.passes.ir.utils import (
    get_ir_op,
    overload_or_default,
    set_donated_input_ids,
)
from minivllm_compile.compilation.passes.vllm_inductor_pass import VllmInductorPass

logger = logging.getLogger(__name__)


class VllmIRInplaceFunctionalizationPass(VllmInductorPass):
    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        # cleared at the start, not the end, so that a test can read what the last call did
        self.functionalized_ops: Counter[str] = Counter()
        order = {node: i for i, node in enumerate(graph.nodes)}
        donated: set[int] = set()
        for node in graph.nodes:
            if (op := get_ir_op(node)) is None:
                continue
            overload = overload_or_default(node.target)._overloadname
            if overload != "maybe_inplace":
                assert overload == "default", f"{op.name}: unexpected overload {overload}"
                continue
            for i in op.activation_indices:
                arg = node.args[i] if i < len(node.args) else None
                if not isinstance(arg, fx.Node):
                    raise ValueError(
                        f"{op.name}.maybe_inplace (node {node.name}): activation "
                        f"{op.activations[op.activation_indices.index(i)]!r} must be "
                        f"a tensor computed in the graph, got {arg!r}"
                    )
                later = [u.name for u in arg.users if order[u] > order[node]]
                if later:  # vLLM's words first (its tests match "is used again after the node")
                    raise ValueError(
                        f"Input {arg} to maybe_inplace node {node} is used again after the node "
                        f"(by {later}). This is not allowed; activation inputs to maybe_inplace "
                        f"ops are donated to the op, meaning their memory may be recycled for "
                        f"outputs: {arg.name} is {op.name}'s activation "
                        f"{op.activations[op.activation_indices.index(i)]!r}, and its contents "
                        f"are undefined after the call.\n\nTo preserve the inputs, use the "
                        f"default overload (ir.ops.{op.name}(...)) or clone them manually "
                        f"beforehand."
                    )
                if arg.op == "placeholder":
                    donated.add(order[arg])
            node.target = op.torch_op  # same signature: only the overload changes
            self.functionalized_ops[op.name] += 1
        set_donated_input_ids(donated)
        logger.debug(
            "%s functionalized %s; donated inputs %s",
            self.pass_name,
            dict(self.functionalized_ops),
            sorted(donated),
        )
