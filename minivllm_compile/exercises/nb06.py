"""Notebook 06's exercises: which `splitting_ops` entries split which node (partition_rules), and
what adding an op to `splitting_ops` does to the pieces (split_graph)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import fx

from minivllm_compile.exercises import ExerciseFailed, env, exercise, measured_once

ATTENTION = "minivllm::unified_attention_with_output"


# ---------------------------------------------------------------------------------------------
# 06.1: which entry splits which node

POW_ENTRIES = ("aten::pow", "aten::pow.Tensor_Scalar", "aten::pow.default")
POW_TARGETS = {  # label -> the node's target
    "packet": lambda: torch.ops.aten.pow,  # what Dynamo records for torch.ops.aten.pow(x, 2)
    "Tensor_Scalar": lambda: torch.ops.aten.pow.Tensor_Scalar,  # what AOTAutograd's graphs hold
    # what Dynamo records for torch.pow(x, 2) (or x ** 2: operator.pow)
    "torch.pow": lambda: torch.pow,
}


def _pow_truth() -> dict[str, set[str]]:
    from minivllm_compile.compilation.partition_rules import should_split

    g = fx.Graph()
    x = g.placeholder("x")
    nodes = {label: g.call_function(target(), (x, 2)) for label, target in POW_TARGETS.items()}
    return {e: {label for label, n in nodes.items() if should_split(n, [e])} for e in POW_ENTRIES}


def _pow_question(entry: str, label: str) -> str:
    """What a wrong (entry, node) decision misses: a question, not the decision."""
    if label == "torch.pow":
        return ("torch.pow is a torch function: is it an OpOverloadPacket or an OpOverload, the "
                "two kinds of target should_split compares an entry with?")
    if entry == "aten::pow.default":
        return "does aten::pow have a .default overload? (torch.ops.aten.pow.overloads())"
    if label == "packet":
        return ("what name does a packet answer to (target._qualified_op_name), "
                "and is this entry that name?")
    return ("what does torch.ops.aten.pow.Tensor_Scalar.name() return, and which overload alone "
            "also answers to the bare name 'ns::op'?")


def _pow_fact(entry: str, label: str, splits: bool) -> str:
    from minivllm_compile.compilation.partition_rules import op_exists

    overload = torch.ops.aten.pow.Tensor_Scalar
    if label == "torch.pow":
        why = "a torch function, neither an OpOverloadPacket nor an OpOverload"
    elif not op_exists(entry):
        why = (f"aten::pow has no .default overload, so {entry!r} names no op "
               "(warn_unknown_splitting_ops warns)")
    elif label == "packet":
        why = f"a packet answers to its bare name, {torch.ops.aten.pow._qualified_op_name!r}, only"
    else:
        why = (f"aten.pow.Tensor_Scalar.name() is {overload.name()!r}; only a .default overload "
               "also answers to the bare name")
    return f"{entry!r} {'splits' if splits else 'does not split'} the {label} node: {why}"


def _grade_pow(answer: Any) -> str:
    if not isinstance(answer, dict) or set(answer) != set(POW_ENTRIES):
        raise ExerciseFailed(f"give a dict with one key per entry, {list(POW_ENTRIES)}, each "
                             "mapped to the set of node labels it splits (labels: "
                             f"{list(POW_TARGETS)}); got {answer!r}")
    truth = _pow_truth()
    problems, facts = [], []
    for entry in POW_ENTRIES:
        said = answer[entry]
        if isinstance(said, str) or not isinstance(said, (set, frozenset, list, tuple)):
            raise ExerciseFailed(f"answer[{entry!r}] must be a set of labels such as {{'packet'}} "
                                 f"(or set() for none), got {said!r}")
        said = set(said)
        unknown = said - set(POW_TARGETS)
        if unknown:
            raise ExerciseFailed(f"answer[{entry!r}] has labels {sorted(unknown)}; the nodes are "
                                 f"labelled {list(POW_TARGETS)}")
        for label in sorted(said ^ truth[entry]):
            problems.append(f"{entry!r} and the {label} node: {_pow_question(entry, label)}")
            facts.append(_pow_fact(entry, label, label in truth[entry]))
    if problems:
        raise ExerciseFailed("should_split decides otherwise "
                             "(partition_rules.split_names; notebook 06 §3):\n  - "
                             + "\n  - ".join(problems), measured="; ".join(
                                 f"{e!r} splits {sorted(truth[e])}" for e in POW_ENTRIES) + ". "
                             + "; ".join(facts))
    return ("Each entry splits exactly one kind of node or none: the bare name reaches the "
            "packet only (aten::pow has no .default), the overload-qualified name its "
            "overload only, 'aten::pow.default' names nothing, and torch.pow, a torch "
            "function, is never a splitting op.")


@exercise("06.1", "which entry splits which node", section="notebook 06 §3 (the splitting_ops "
                                                           "format)",
          hint="compare each entry with the name each node's target answers to (a packet, an "
               "overload, a torch function are three kinds of target); "
               "torch.ops.aten.pow.overloads() lists what exists",
          deeper_hint="should_split (partition_rules.py) turns each target into the names it "
                      "answers to: read split_names. Then, in a cell: print "
                      "torch.ops.aten.pow._qualified_op_name, "
                      "torch.ops.aten.pow.Tensor_Scalar.name() and torch.ops.aten.pow.overloads(), "
                      "and compare each of the three entries with them, string for string.",
          solution=lambda: {"aten::pow": {"packet"}, "aten::pow.Tensor_Scalar": {"Tensor_Scalar"},
                            "aten::pow.default": set()},
          # the seed's reading
          wrong=lambda: {"aten::pow": {"packet", "Tensor_Scalar", "torch.pow"},
                         "aten::pow.Tensor_Scalar": {"Tensor_Scalar"},
                         "aten::pow.default": {"packet"}},
          wrong_says="which overload alone also answers to the bare name",
          gives_away="'aten::pow' splits ['packet']")
def grade_which_entry_splits(answer: Any) -> str:
    return _grade_pow(answer)


# ---------------------------------------------------------------------------------------------
# 06.2: add fused_add_rms_norm to splitting_ops and predict the pieces

EXTRA_OP = "minivllm::fused_add_rms_norm"
L = 2


@measured_once
def _split_with(splitting_ops: tuple[str, ...]) -> tuple[list[tuple[str, bool]], str,
                                                         Counter, int, int]:
    """split_graph on the 2-layer Llama with these splitting ops: the pieces (name, is splitting),
    the target of the last piece's first op, the splitting-op calls by op, the counters' deltas."""
    from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter
    from minivllm_compile.compilation.partition_rules import should_split
    from minivllm_compile.config.kernel import IrOpPriorityConfig, KernelConfig
    from minivllm_compile.models import build_model

    # the norms as notebook 06 traces them: the IR priority vllm_c (the torch wrap is off without
    # Inductor), so Dynamo records the custom op fused_add_rms_norm, which can split the graph
    kernels = KernelConfig(IrOpPriorityConfig.with_default(["vllm_c", "native"]))
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="eager", compile_sizes=[4],
                           compile_ranges_endpoints=[8], max_num_batched_tokens=32,
                           splitting_ops=list(splitting_ops), kernel_config=kernels)
    with env(VLLM_DISABLE_COMPILE_CACHE="1"):
        lm = build_model("llama", num_layers=L, compilation_config=cc)
        before = compilation_counter.clone()
        n = 10
        lm(torch.arange(n) % 200 + 1, torch.arange(n))
    pieces = compilation_counter.num_piecewise_graphs_seen - before.num_piecewise_graphs_seen
    compiled = (compilation_counter.num_piecewise_capturable_graphs_seen
                - before.num_piecewise_capturable_graphs_seen)
    backend = lm.model.backend
    items = [(it.submod_name, it.is_splitting_graph) for it in backend.piecewise_graphs]
    last = backend.piecewise_graphs[-1]
    last_op = str(next(n.target for n in last.graph.graph.nodes if n.op == "call_function"))
    calls = Counter(str(n.target).split(".")[-1] for n in backend.graphs[0].graph.nodes
                    if should_split(n, list(splitting_ops)))
    return items, last_op, calls, pieces, compiled


def _grade_pieces(answer: Any) -> str:
    if not isinstance(answer, dict) or set(answer) != {"pieces", "compiled"} \
            or not all(isinstance(v, int) for v in answer.values()):
        raise ExerciseFailed("give {'pieces': int, 'compiled': int} (what "
                             "num_piecewise_graphs_seen and "
                             f"num_piecewise_capturable_graphs_seen count); got {answer!r}")
    items, last_op, calls, pieces, compiled = _split_with((ATTENTION, EXTRA_OP))
    splitting = pieces - compiled
    if (answer["pieces"], answer["compiled"]) == (pieces, compiled):
        assert items[-1][1] and splitting == sum(calls.values())  # what is said here
        return (f"{sum(calls.values())} splitting-op calls "
                f"({calls['unified_attention_with_output']} attentions, "
                f"{calls['fused_add_rms_norm']} fused_add_rms_norm), none consecutive, so "
                f"{splitting} splitting pieces; a compiled piece before each one but none after "
                f"the last (the final norm ends the graph): {compiled}.")
    said_splitting = answer["pieces"] - answer["compiled"]
    why = []
    if said_splitting != splitting:
        why.append("your counts make a different number of splitting pieces (pieces - compiled) "
                   "than the graph has: count the calls of each splitting op in the 2-layer graph "
                   "again (notebook 06 §1's table: which norms are fused_add_rms_norm, and how "
                   "does layer 0 start?), and ask whether any two of them are next to each other")
    if answer["compiled"] != compiled:
        why.append("a compiled piece sits before every splitting piece: is there also one after "
                   "the last? Look at what ends the graph, and whether it is a splitting op")
    listing = " ".join(name + ("*" if is_splitting else "") for name, is_splitting in items)
    raise ExerciseFailed("\n".join(why) or "count again", measured=(
        f"split_graph made {pieces} pieces, {compiled} compiled ({listing}, * splitting); the "
        f"splitting-op calls: {', '.join(f'{k} x{v}' for k, v in sorted(calls.items()))}; the "
        f"last piece runs {last_op}"))


@exercise("06.2", "add fused_add_rms_norm to splitting_ops: how many pieces", section="notebook 06 "
          "§1 and §2 (how split_graph cuts)",
          hint="count the calls of each splitting op in the 2-layer graph (notebook 06 §1 lists "
               "every piece's ops), then ask what sits before, between and after them",
          deeper_hint="Write the 2-layer graph's custom-op calls in order (§1's table, piece by "
                      "piece, without the cuts) and circle every call of a splitting op. §2's "
                      "rules: each circled call (or run of adjacent ones) becomes one splitting "
                      "piece, and the ops between two of them, before the first and after the "
                      "last, become compiled pieces, if there are any ops there.",
          solution=lambda: {"pieces": 12, "compiled": 6},
          wrong=lambda: {"pieces": 13, "compiled": 7},
          wrong_says="is there also one after the last",
          gives_away="made 12 pieces, 6 compiled")
def grade_pieces_with_fused_norm(answer: Any) -> str:
    return _grade_pieces(answer)
