"""Finding IR op nodes in a graph, and the donated inputs the pre-grad pass hands to the post-grad
ones (vLLM 0.34's compilation/passes/ir/utils.py; vLLM keeps the donated inputs in its pass
context, PassContext.donated_input_ids)."""

from __future__ import annotations

import logging

from torch import fx
from torch._ops import OpOverload, OpOverloadPacket

from minivllm_compile.ir import op as ir_op_module
from minivllm_compile.ir.op import IrOp

logger = logging.getLogger(__name__)

# Placeholder positions of the graph being compiled whose memory a maybe_inplace op may reuse:
# set by VllmIRInplaceFunctionalizationPass (before AOTAutograd), read by UnsafeCloneEliminationPass
# (after it) in the same compile, and cleared by the pass manager when it is done.
_donated_input_ids: set[int] = set()


def set_donated_input_ids(ids: set[int]) -> None:
    _donated_input_ids.clear()
    _donated_input_ids.update(ids)


def get_donated_input_ids() -> set[int]:
    return set(_donated_input_ids)


def overload_or_default(op: OpOverload | OpOverloadPacket) -> OpOverload:
    return op.default if isinstance(op, OpOverloadPacket) else op


def get_ir_op(node: fx.Node) -> IrOp | None:
    """The IR op a node calls (either overload), or None."""
    if node.op != "call_function" or not isinstance(node.target, (OpOverload, OpOverloadPacket)):
        return None
    overload = overload_or_default(node.target)
    ns = ir_op_module.ir_torch_lib.ns  # read at each call: tests swap the library
    if overload.namespace != ns:
        return None
    op = IrOp.registry.get(overload._opname)
    if op is None:
        logger.warning(
            "unknown vLLM IR op %s: an op was registered in the %s namespace outside register_op",
            overload._opname,
            ns,
        )
    return op


def find_rms_norm_eps(graph: fx.Graph) -> set[float]:
    """The eps of every RMSNorm in the graph: each IR norm node's `epsilon` argument."""
    found = set()
    for node in graph.nodes:
        op = get_ir_op(node)
        if op is not None and op.name in ("rms_norm", "fused_add_rms_norm"):
            eps = node.args[list(op.py_signature.parameters).index("epsilon")]
            if isinstance(eps, float):
                found.add(eps)
    return found
