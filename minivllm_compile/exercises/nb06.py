"""Notebook 06's exercises: which `splitting_ops` entries split which node (partition_rules), and
what adding an op to `splitting_ops` does to the pieces (split_graph)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import fx

from minivllm_compile.exercises import ExerciseFailed, env, exercise

ATTENTION = "minivllm::unified_attention_with_output"




# ---------------------------------------------------------------------------------------------
# 06.1: which entry splits which node

POW_ENTRIES = ("aten::pow", "aten::pow.Tensor_Scalar", "aten::pow.default")
POW_TARGETS = {  # label -> the node's target
    "packet": lambda: torch.ops.aten.pow,  # what Dynamo records for torch.ops.aten.pow(x, 2)
    "Tensor_Scalar": lambda: torch.ops.aten.pow.Tensor_Scalar,  # what AOTAutograd's graphs hold
    "torch.pow": lambda: torch.pow,  # what Dynamo records for torch.pow(x, 2) (or x ** 2: operator.pow)
}


def _pow_truth() -> dict[str, set[str]]:
    from minivllm_compile.partition_rules import should_split

    g = fx.Graph()
    x = g.placeholder("x")
    nodes = {label: g.call_function(target(), (x, 2)) for label, target in POW_TARGETS.items()}
    return {e: {label for label, n in nodes.items() if should_split(n, [e])} for e in POW_ENTRIES}


def _pow_reason(entry: str, label: str) -> str:
    from minivllm_compile.partition_rules import op_exists

    if label == "torch.pow":
        return "torch.pow is a torch function, neither an OpOverloadPacket nor an OpOverload: no entry splits it"
    if not op_exists(entry):
        return (f"aten::pow has no .default overload (its overloads: {', '.join(torch.ops.aten.pow.overloads()[:4])}, "
                f"...), so {entry!r} names no op: warn_unknown_splitting_ops warns and it splits nothing")
    packet, overload = torch.ops.aten.pow, torch.ops.aten.pow.Tensor_Scalar
    if label == "packet":
        return (f"a packet answers to its bare name, target._qualified_op_name = {packet._qualified_op_name!r}, "
                "and to nothing else (never to an overload-qualified entry)")
    if entry == overload.name():
        return f"aten.pow.Tensor_Scalar.name() is {overload.name()!r}, exactly this entry"
    return (f"aten.pow.Tensor_Scalar.name() is {overload.name()!r}: only a .default overload also answers to "
            "the bare name, so the bare name does not reach .Tensor_Scalar")


def _grade_pow(answer: Any) -> str:
    if not isinstance(answer, dict) or set(answer) != set(POW_ENTRIES):
        raise ExerciseFailed(f"give a dict with one key per entry, {list(POW_ENTRIES)}, each mapped to the set "
                             f"of node labels it splits (labels: {list(POW_TARGETS)}); got {answer!r}")
    truth = _pow_truth()
    problems = []
    for entry in POW_ENTRIES:
        said = answer[entry]
        if isinstance(said, str) or not isinstance(said, (set, frozenset, list, tuple)):
            raise ExerciseFailed(f"answer[{entry!r}] must be a set of labels such as {{'packet'}} (or set() for "
                                 f"none), got {said!r}")
        said = set(said)
        unknown = said - set(POW_TARGETS)
        if unknown:
            raise ExerciseFailed(f"answer[{entry!r}] has labels {sorted(unknown)}; the nodes are labelled "
                                 f"{list(POW_TARGETS)}")
        for label in sorted(said ^ truth[entry]):
            verb = "splits" if label in truth[entry] else "does not split"
            problems.append(f"{entry!r} {verb} the {label} node: {_pow_reason(entry, label)}")
    if problems:
        raise ExerciseFailed("should_split decides otherwise (partition_rules.split_names; notebook 06 §3):\n  - "
                             + "\n  - ".join(problems))
    return ("Each entry splits exactly one kind of node or none: the bare name reaches the packet only "
            "(aten::pow has no .default), the overload-qualified name its overload only, 'aten::pow.default' "
            "names nothing, and torch.pow, a torch function, is never a splitting op.")


@exercise("06.1", "which entry splits which node",
          hint="compare each entry with what the node answers to: a packet its bare name 'ns::op', an "
               "OpOverload its name(), which carries the overload unless it is .default "
               "(torch.ops.aten.pow.overloads() lists what exists)",
          solution=lambda: {"aten::pow": {"packet"}, "aten::pow.Tensor_Scalar": {"Tensor_Scalar"},
                            "aten::pow.default": set()},
          wrong=lambda: {"aten::pow": {"packet", "Tensor_Scalar", "torch.pow"},  # the seed's reading
                         "aten::pow.Tensor_Scalar": {"Tensor_Scalar"}, "aten::pow.default": {"packet"}},
          wrong_says="only a .default overload also answers to the bare name")
def grade_which_entry_splits(answer: Any) -> str:
    return _grade_pow(answer)


# ---------------------------------------------------------------------------------------------
# 06.2: add fused_add_rms_norm to splitting_ops and predict the pieces

EXTRA_OP = "minivllm::fused_add_rms_norm"
L = 2


def _split_with(splitting_ops: list[str]):
    from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter
    from minivllm_compile.models import build_model

    from minivllm_compile.kernel_config import IrOpPriorityConfig, KernelConfig

    # the norms as notebook 06 traces them: the IR priority vllm_c (the torch wrap is off without
    # Inductor), so Dynamo records the custom op fused_add_rms_norm, which can split the graph
    kernels = KernelConfig(IrOpPriorityConfig.with_default(["vllm_c", "native"]))
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="eager", compile_sizes=[4],
                           compile_ranges_endpoints=[8], max_num_batched_tokens=32, splitting_ops=splitting_ops,
                           kernel_config=kernels)
    with env(VLLM_DISABLE_COMPILE_CACHE="1"):
        lm = build_model("llama", num_layers=L, compilation_config=cc)
        before = compilation_counter.clone()
        n = 10
        lm(torch.arange(n) % 200 + 1, torch.arange(n))
    pieces = compilation_counter.num_piecewise_graphs_seen - before.num_piecewise_graphs_seen
    compiled = compilation_counter.num_piecewise_capturable_graphs_seen - before.num_piecewise_capturable_graphs_seen
    return lm.model.backend, pieces, compiled


def _grade_pieces(answer: Any) -> str:
    from minivllm_compile.partition_rules import should_split

    if not isinstance(answer, dict) or set(answer) != {"pieces", "compiled"} \
            or not all(isinstance(v, int) for v in answer.values()):
        raise ExerciseFailed(f"give {{'pieces': int, 'compiled': int}} (what num_piecewise_graphs_seen and "
                             f"num_piecewise_capturable_graphs_seen count); got {answer!r}")
    ops = [ATTENTION, EXTRA_OP]
    backend, pieces, compiled = _split_with(ops)
    items = backend.piecewise_graphs
    calls = Counter(str(n.target).split(".")[-1] for n in backend.graphs[0].graph.nodes if should_split(n, ops))
    if (answer["pieces"], answer["compiled"]) == (pieces, compiled):
        assert items[-1].is_splitting_graph and pieces - compiled == sum(calls.values())  # what is said here
        return (f"{sum(calls.values())} splitting-op calls ({calls['unified_attention_with_output']} attentions, "
                f"{calls['fused_add_rms_norm']} fused_add_rms_norm), none consecutive, so {pieces - compiled} "
                f"splitting pieces; a compiled piece before each one but none after the last (the final norm "
                f"ends the graph): {compiled}.")
    last = items[-1]
    together = ("none of them is next to another, so each gets a splitting piece of its own"
                if pieces - compiled == sum(calls.values()) else "consecutive ones share a splitting piece")
    listing = " ".join(it.submod_name + ("*" if it.is_splitting_graph else "") for it in items)
    why = [(f"you predicted {answer['pieces']} pieces, {answer['compiled']} compiled; split_graph made "
            f"{pieces} pieces, {compiled} compiled ({listing}, * splitting)"),
           (f"the Dynamo graph calls a splitting op {sum(calls.values())} times "
            f"({', '.join(f'{k} x{v}' for k, v in sorted(calls.items()))}); "
            f"{together}: {pieces - compiled} splitting pieces (count the fused_add_rms_norm calls in notebook 06 "
            "§1's table: layer 0 starts with rms_norm, every later norm is fused)")]
    if last.is_splitting_graph:
        op = next(n for n in last.graph.graph.nodes if n.op == "call_function")
        why.append(f"a compiled piece sits before every splitting piece, but none after the last: the graph "
                   f"ends with {op.target} (the final norm), and nothing follows it, so there are as many "
                   f"compiled pieces as splitting ones, {compiled}, not one more")
    raise ExerciseFailed("\n  - ".join(why))


@exercise("06.2", "add fused_add_rms_norm to splitting_ops: how many pieces",
          hint="count the calls of each splitting op in the 2-layer graph (notebook 06 §1 lists every piece's "
               "ops), then ask what sits before, between and after them",
          solution=lambda: {"pieces": 12, "compiled": 6},
          wrong=lambda: {"pieces": 13, "compiled": 7},
          wrong_says="none after the last")
def grade_pieces_with_fused_norm(answer: Any) -> str:
    return _grade_pieces(answer)
