"""Which FX nodes split the graph (vLLM's compilation/partition_rules.py; seed §15).

"ns::op" matches the op packet and every overload of it; "ns::op.overload" matches that overload
only. A name no registered op answers to is warned about once: a typo would otherwise silently
compile the op into a piece instead of splitting there.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

logger = logging.getLogger("minivllm_compile")
_warned: set[str] = set()


def op_exists(name: str) -> bool:
    namespace, _, rest = name.partition("::")
    op_name, _, overload = rest.partition(".")
    try:
        packet = getattr(getattr(torch.ops, namespace), op_name)
        return not overload or overload in packet.overloads()
    except (AttributeError, RuntimeError):
        return False


def warn_unknown_splitting_ops(splitting_ops: list[str]) -> list[str]:
    unknown = [op for op in splitting_ops if not op_exists(op)]
    for op in unknown:
        if op not in _warned:
            _warned.add(op)
            logger.warning("splitting_ops names %r, but no such op is registered: the graph will "
                           "not split there (check the spelling: 'namespace::op[.overload]')", op)
    return unknown


def should_split(node: fx.Node, splitting_ops: list[str]) -> bool:
    if node.op != "call_function":
        return False
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        # Dynamo records `torch.ops.ns.op(...)` as the packet; it dispatches to .default
        name = target._qualified_op_name
        return name in splitting_ops or f"{name}.default" in splitting_ops
    if isinstance(target, torch._ops.OpOverload):
        packet_name = target._schema.name  # "ns::op"
        return packet_name in splitting_ops or f"{packet_name}.{target._overloadname}" in splitting_ops
    return False
