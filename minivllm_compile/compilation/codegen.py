"""The stitching function: the split graph written out as plain Python (vLLM's
compilation/codegen.py, the same in 0.33 and 0.34; seed §10, §11).

After the split (backends.split_graph), the stitching graph `split_gm` calls the compiled pieces
and, between them, the splitting ops. vLLM never runs it as an FX GraphModule at run time: every
call would go through nn.Module.__call__ and a __getattr__ per submodule. Instead it writes one
Python function from its nodes and `exec`s it:

    def __vllm_inlined_submods__1(query, key, value, output, layer_name):   # a splitting piece,
        unified_attention_with_output = torch.ops.minivllm....default(...)  # its code inlined
        return ...

    def execution_fn(l_input_ids_, s72, ..., *, __vllm_submods__):
        submod_0 = __vllm_submods__[0](l_input_ids_, s72, ...)             # a compiled piece
        getitem = submod_0[0]
        ...
        submod_1 = __vllm_inlined_submods__1(getitem, getitem_1, ...)
        del getitem, getitem_1                                               # freed after last use
        ...
        return (submod_4,)

Compiled pieces are called from a list bound once (`compile_execution_fn`), a splitting piece (a
plain GraphModule) is inlined as a function of its own, an argument that is not a literal (a
device, a dtype) is kept in a list `__vllm_consts__` and named by its index, and every value is
deleted after its last use. The backend returns this function (caching.VllmSerializableFunction
calls it), logs it to TORCH_TRACE as `vllm_execution_code` (a tlparse page), and the mega AOT
artifact saves its source, to be `exec`'d again on load.
"""

from __future__ import annotations

import builtins
import functools
import math
import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.utils import dynamo_timed
from torch._logging import trace_structured
from torch.fx.node import _get_qualified_name

# what the generated module imports: a qualified name is written as code only when it resolves
# to the same object from these
_IMPORTED = {"torch": torch, "operator": operator}


def _resolves_to(path: str, target: Any) -> bool:
    head, *rest = path.split(".")
    obj = _IMPORTED.get(head, getattr(builtins, head, None))
    for part in rest:
        obj = getattr(obj, part, None)
    return obj is target


class _Writer:
    """Writes one graph's nodes as the body of a function; the constants it cannot write as
    literals are shared by every function of one stitching graph."""

    def __init__(self, consts: list[Any], const_index: dict[int, int]):
        self.consts, self.const_index = consts, const_index

    def const(self, value: Any) -> str:
        # by identity: the graph's arguments stay alive while it is written, and each object is
        # kept once (vLLM's choice too); it must pickle, for the AOT artifact
        key = id(value)
        if key not in self.const_index:
            self.const_index[key] = len(self.consts)
            self.consts.append(value)
        return f"__vllm_consts__[{self.const_index[key]}]"

    def ref(self, arg: Any) -> str:
        """An argument as source: a node by its name, containers element by element, literals by
        repr, anything else through __vllm_consts__."""
        if isinstance(arg, fx.Node):
            return arg.name
        if isinstance(arg, (list, tuple)):
            items = ", ".join(self.ref(a) for a in arg)
            if isinstance(arg, list):
                return f"[{items}]"
            return f"({items},)" if len(arg) == 1 else f"({items})"
        if isinstance(arg, dict):
            return "{" + ", ".join(f"{self.ref(k)}: {self.ref(v)}" for k, v in arg.items()) + "}"
        if isinstance(arg, float) and not math.isfinite(arg):
            return self.const(arg)  # repr gives inf / nan, which are not Python names
        if arg is None or isinstance(arg, (bool, int, float, str, bytes)):
            return repr(arg)
        return self.const(arg)

    def callee(self, target: Any) -> str:
        """A call_function target by its qualified name when that name reaches it from the
        generated module's imports (torch.ops.minivllm.unified_attention_with_output.default),
        else through __vllm_consts__ (operator.mul's qualified name is `_operator.mul`)."""
        name = _get_qualified_name(target)
        if _resolves_to(name, target):
            return name
        alias = "operator." + name.removeprefix("_operator.")
        return alias if _resolves_to(alias, target) else self.const(target)

    def call_args(self, node: fx.Node) -> str:
        parts = [self.ref(a) for a in node.args]
        parts += [f"{k}={self.ref(v)}" for k, v in node.kwargs.items()]
        return ", ".join(parts)


def _last_uses(nodes: list[fx.Node]) -> dict[int, list[str]]:
    """Position -> the values to delete after it: each value after its last user, unless that
    user is the output (the return releases it anyway)."""
    order = {node: i for i, node in enumerate(nodes)}
    after: dict[int, list[str]] = {}
    for node in nodes:
        if node.op == "output" or not node.users:
            continue
        last = max(node.users, key=order.__getitem__)
        if last.op != "output":
            after.setdefault(order[last], []).append(node.name)
    return after


def generate_execution_code_with_name(
    split_gm: fx.GraphModule, fn_name: str, with_submod: bool,
    consts: list[Any] | None = None, const_index: dict[int, int] | None = None,
) -> tuple[str, list[str], list[Any]]:
    """The source of `fn_name`, the list of submodule names its `__vllm_submods__` indexes, and
    the constants. A submodule that is a plain GraphModule (a splitting piece) is inlined as a
    function of its own; anything else in its place (a PiecewiseBackend, a wrapper) is called
    from the list. `with_submod=False`: the graph must call no submodule (an inlined piece)."""
    consts = [] if consts is None else consts
    writer = _Writer(consts, {} if const_index is None else const_index)
    nodes = list(split_gm.graph.nodes)
    delete_after = _last_uses(nodes)
    params: list[str] = []
    lines: list[str] = []
    submod_names: list[str] = []
    inlined: list[str] = []
    for i, node in enumerate(nodes):
        if node.op == "placeholder":
            params.append(node.name)
        elif node.op == "call_module":
            if not with_submod:
                raise RuntimeError(f"an inlined piece calls a submodule, {node.target}: only the "
                                   "stitching graph may")
            if node.target not in submod_names:
                submod_names.append(node.target)
            index = submod_names.index(node.target)
            submod = getattr(split_gm, node.target)  # what is installed in its place, if anything
            if isinstance(submod, fx.GraphModule):
                callee = f"__vllm_inlined_submods__{index}"
                code, _, _ = generate_execution_code_with_name(
                    submod, callee, with_submod=False, consts=consts,
                    const_index=writer.const_index)
                inlined.append(code)
            else:
                callee = f"__vllm_submods__[{index}]"
            lines.append(f"    {node.name} = {callee}({writer.call_args(node)})")
        elif node.op == "call_function" and node.target is operator.getitem:
            index = node.args[1]
            if not isinstance(index, int):
                raise RuntimeError(f"{node.format_node()}: getitem with a non-int index")
            lines.append(f"    {node.name} = {writer.ref(node.args[0])}[{index}]")
        elif node.op == "call_function":
            callee = writer.callee(node.target)
            lines.append(f"    {node.name} = {callee}({writer.call_args(node)})")
        elif node.op == "output":
            lines.append(f"    return {writer.ref(node.args[0])}")
        else:
            raise RuntimeError(f"the stitching code has no form for {node.format_node()}")
        # (not right before the return: it releases everything anyway)
        if i in delete_after and i < len(nodes) - 2:
            lines.append(f"    del {', '.join(sorted(delete_after[i]))}")
    if not params:
        raise RuntimeError(f"{fn_name}: the graph takes no input")
    keyword = ", *, __vllm_submods__" if with_submod else ""
    header = f"\ndef {fn_name}({', '.join(params)}{keyword}):"
    return "".join(inlined) + "\n".join([header, *lines]) + "\n", submod_names, consts


@dynamo_timed("vllm.generate_execution_code")
def generate_execution_code(split_gm: fx.GraphModule) -> tuple[str, list[str], list[Any]]:
    """(source, submodule names, constants) of `execution_fn`, the stitching graph as Python."""
    code, submod_names, consts = generate_execution_code_with_name(
        split_gm, "execution_fn", with_submod=True)
    return "import torch\nimport operator\n" + code, submod_names, consts


@dynamo_timed("vllm.compile_execution_fn")
def compile_execution_fn(code: str, submod_callables: dict[str, Callable[..., Any]],
                         submod_names: list[str],
                         consts: list[Any] | None = None) -> Callable[..., Any]:
    """`exec` the source and bind the callables (by name, in `submod_names`' order) as
    `__vllm_submods__`; a name with no callable (an inlined piece) keeps its index as None. The
    source is logged to TORCH_TRACE as `vllm_execution_code`."""
    trace_structured("artifact",
                     metadata_fn=lambda: {"name": "vllm_execution_code", "encoding": "string"},
                     payload_fn=lambda: code)
    namespace: dict[str, Any] = {"__vllm_consts__": consts if consts is not None else []}
    exec(compile(code, "<vllm_execution_code>", "exec"), namespace)  # noqa: S102
    submods = [submod_callables.get(name) for name in submod_names]
    return functools.partial(namespace["execution_fn"], __vllm_submods__=submods)
