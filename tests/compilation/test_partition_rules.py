"""should_split decides as vLLM 0.34's partition_rules.should_split does: it compares
`target.name()`, which is "ns::op" for the `.default` overload, "ns::op.overload" for any other."""

import logging

import pytest
import torch
import torch.fx as fx

import minivllm_compile.ops  # noqa: F401  (registers the minivllm:: custom ops)
from minivllm_compile.compilation.partition_rules import (
    op_exists,
    should_split,
    warn_unknown_splitting_ops,
)

add = torch.ops.aten.add
TARGETS = {"packet": add, "default": add.default, "Tensor": add.Tensor}

# entry -> does it split (packet, .default overload, .Tensor overload)
TABLE = {
    "aten::add": (True, True, False),           # bare: the packet and .default, not .Tensor
    "aten::add.default": (False, True, False),  # .default spelled out: not the packet
    "aten::add.Tensor": (False, False, True),
    "aten::add.Scalar": (False, False, False),  # another overload of the same op
    "aten::sub": (False, False, False),
}


def _node(target) -> fx.Node:
    return fx.Graph().call_function(target, ())


@pytest.mark.parametrize("entry", TABLE)
def test_decision_table(entry):
    kinds = ("packet", "default", "Tensor")
    got = tuple(should_split(_node(TARGETS[kind]), [entry]) for kind in kinds)
    assert got == TABLE[entry], entry


def test_name_is_what_is_compared():
    # the torch behaviour the table rests on
    assert add.Tensor.name() == "aten::add.Tensor"
    assert torch.ops.aten.relu.default.name() == "aten::relu"


def test_any_entry_of_the_list_matches():
    assert should_split(_node(add.Tensor), ["aten::sub", "aten::add.Tensor"])
    assert not should_split(_node(add.Tensor), [])


def test_only_call_function_nodes_and_ops_split():
    g = fx.Graph()
    x = g.placeholder("x")
    assert not should_split(x, ["aten::add"])
    assert not should_split(g.call_method("add", (x, x)), ["aten::add"])
    # torch.add is a torch function, not an op: Dynamo keeps it as written
    assert not should_split(g.call_function(torch.add, (x, x)), ["aten::add"])


def test_a_traced_graph_holds_the_packet():
    def f(x):
        return torch.ops.aten.add(x, x).relu()

    node = next(n for n in fx.symbolic_trace(f).graph.nodes if n.op == "call_function")
    assert isinstance(node.target, torch._ops.OpOverloadPacket)
    assert should_split(node, ["aten::add"]) and not should_split(node, ["aten::add.default"])


def test_custom_op_formats():
    conv = torch.ops.minivllm.short_conv
    assert should_split(_node(conv), ["minivllm::short_conv"])
    assert not should_split(_node(conv), ["minivllm::short_conv.default"])
    assert should_split(_node(conv.default), ["minivllm::short_conv"])
    assert should_split(_node(conv.default), ["minivllm::short_conv.default"])


@pytest.mark.parametrize("name, known", [
    ("aten::add", True),            # the packet exists (and answers to it)
    ("aten::add.default", True),
    ("aten::add.Tensor", True),
    ("aten::add.Tensr", False),     # no such overload
    ("aten::relu.Tensor", False),
    ("aten::ad", False),            # no such op
    ("nosuchns::op", False),
    ("aten::add.Tensor.Tensor", False),
    ("minivllm::short_conv", True),
    ("minivllm::short_conv.default", True),
])
def test_op_exists(name, known):
    assert op_exists(name) == known


def test_every_known_name_splits_some_node_of_its_op():
    # the warner and should_split agree: a name op_exists accepts splits the packet or an overload
    for name in ("aten::add", "aten::add.default", "aten::add.Tensor", "aten::add.Scalar"):
        assert op_exists(name)
        nodes = [_node(add)] + [_node(getattr(add, o)) for o in add.overloads()]
        assert any(should_split(n, [name]) for n in nodes), name


def test_unknown_names_are_warned_once(caplog):
    with caplog.at_level(logging.WARNING, logger="minivllm_compile"):
        assert warn_unknown_splitting_ops(["aten::add", "aten::add.Tensr"]) == ["aten::add.Tensr"]
        assert warn_unknown_splitting_ops(["aten::add.Tensr"]) == ["aten::add.Tensr"]
    assert sum("aten::add.Tensr" in r.getMessage() for r in caplog.records) == 1
