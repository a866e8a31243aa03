"""Which FX nodes split the graph (vLLM's compilation/partition_rules.py; seed §15).

A node splits when one of the names its target answers to is in `splitting_ops`. As in vLLM 0.34,
which compares `target.name()`, and torch's `OpOverload.name()` is "ns::op" for the `.default`
overload but "ns::op.overload" for any other:

| entry              | packet `ns.op` | `ns.op.default` | `ns.op.Tensor` |
|--------------------|----------------|-----------------|----------------|
| "ns::op"           | splits         | splits          | no             |
| "ns::op.default"   | no             | splits          | no             |
| "ns::op.Tensor"    | no             | no              | splits         |

So the bare name does not reach a non-default overload ("aten::add" does not split
`aten.add.Tensor`), and an overload-qualified name never splits a packet, which is what Dynamo
records for a call `torch.ops.ns.op(...)`. (vLLM also happens to accept "ns::op.Tensor.Tensor" for
`ns.op.Tensor`, its name() plus the overload again; that spelling is not supported here.)

A name no registered op answers to is warned about once: a typo would otherwise silently compile
the op into a piece instead of splitting there.
"""

from __future__ import annotations

import logging

import torch
import torch.fx as fx

logger = logging.getLogger("minivllm_compile")
_warned: set[str] = set()


def op_exists(name: str) -> bool:
    """Whether some packet or overload answers to `name` under the rule above: "ns::op" when the
    packet exists (whatever its overloads), "ns::op.overload" when that overload exists."""
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


def split_names(target: object) -> tuple[str, ...]:
    """The `splitting_ops` entries that split a call of `target`."""
    if isinstance(target, torch._ops.OpOverloadPacket):
        # only the bare name: a packet is not its .default overload here, though it dispatches to it
        return (target._qualified_op_name,)
    if isinstance(target, torch._ops.OpOverload):
        # name() is "ns::op" for .default (the bare name reaches it), "ns::op.Tensor" otherwise
        if target._overloadname == "default":
            return (target.name(), f"{target.name()}.default")
        return (target.name(),)
    return ()  # a Python function, a torch function (torch.add), a method: never a splitting op


def should_split(node: fx.Node, splitting_ops: list[str]) -> bool:
    if node.op != "call_function":
        return False
    return any(name in splitting_ops for name in split_names(node.target))
