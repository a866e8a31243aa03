"""Notebook 07's exercises: the compile ranges a config builds and the entry that serves each
num_tokens (get_compile_ranges, PiecewiseBackend._find_range_for_shape), and how many Inductor
compiles a config costs, at start-up and after it."""

from __future__ import annotations

from typing import Any

import torch

from minivllm_compile.exercises import ExerciseFailed, env, exercise, measured_once

L = 1  # one layer: two compiled pieces, cheap to compile


def _tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(n) % 200 + 1, torch.arange(n)


def _config(backend: str, **kw):
    from minivllm_compile import CompilationConfig, CompilationMode

    return CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend=backend, **kw)


def _as_pair(value: Any, where: str) -> tuple[int, int] | None:
    """A Range, a (start, end) pair, or None, as (start, end) or None."""
    from minivllm_compile import Range

    if value is None:
        return None
    if isinstance(value, Range):
        return (value.start, value.end)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(
        isinstance(v, int) for v in value):
        return (value[0], value[1])
    raise ExerciseFailed(f"{where}: write an entry as Range(start, end) or (start, end), or None "
                         f"for no entry; got {value!r}")


def _show(pair: tuple[int, int] | None) -> str:
    return "None" if pair is None else f"Range({pair[0]}, {pair[1]})"


# ---------------------------------------------------------------------------------------------
# 07.1: the ranges, and which entry serves num_tokens = n

SIZES, ENDPOINTS, MAX_TOKENS = [2, 16], [1, 16, 48, 100], 64
QUERIES = (1, 2, 16, 17, 50, 64, 65)


@measured_once
def _dispatch_truth() -> tuple[list[tuple[int, int]], list[int], dict[int, tuple[int, int] | None]]:
    """The ranges get_compile_ranges() gives, the compile sizes, and the
    entry each of QUERIES runs."""
    from minivllm_compile.models import build_model

    cc = _config("eager", compile_sizes=SIZES, compile_ranges_endpoints=ENDPOINTS,
                 max_num_batched_tokens=MAX_TOKENS)
    ranges = [(r.start, r.end) for r in cc.get_compile_ranges()]
    with env(VLLM_DISABLE_COMPILE_CACHE="1"):
        lm = build_model("llama", num_layers=L, compilation_config=cc)
        lm(*_tokens(10))  # the first call compiles every piece for every entry
    truth = {}
    for n in QUERIES:
        found = {(e.compile_range.start, e.compile_range.end) if e else None
                 for e in (p._find_range_for_shape(n) for p in lm.model.backend.piecewise_backends)}
        assert len(found) == 1, found  # every piece has the same entries
        truth[n] = found.pop()
    return ranges, list(cc.compile_sizes), truth


def _grade_dispatch(answer: Any) -> str:
    if not isinstance(answer, dict) or set(answer) != {"ranges", "serves"}:
        raise ExerciseFailed("give {'ranges': [...], 'serves': {n: "
                             f"entry, ...}}}}; got {answer!r}")
    if not isinstance(answer["ranges"], (list, tuple)):
        raise ExerciseFailed("answer['ranges'] must be the list get_compile_ranges() "
                             f"returns; got {answer['ranges']!r}")
    said_ranges = [_as_pair(r, "answer['ranges']") for r in answer["ranges"]]
    serves = answer["serves"]
    if not isinstance(serves, dict) or set(serves) != set(QUERIES):
        raise ExerciseFailed(f"answer['serves'] must map each num_tokens in {list(QUERIES)} to the "
                             f"entry that runs it; got {serves!r}")
    said = {n: _as_pair(serves[n], f"answer['serves'][{n}]") for n in QUERIES}
    ranges, sizes, truth = _dispatch_truth()
    measured = ("get_compile_ranges() gives "
                f"{', '.join(map(_show, ranges))}; _find_range_for_shape: "
                + ", ".join(f"{n} -> {_show(truth[n])}" for n in QUERIES))
    if said_ranges != ranges:
        raise ExerciseFailed(
            f"your ranges {', '.join(map(_show, said_ranges))} are not what get_compile_ranges() "
            "builds. vLLM keeps only the endpoints e with 1 < e < max_num_batched_tokens (dropping "
            "the others without a word), appends max_num_batched_tokens and cuts [1, max] after "
            "each endpoint; the compile sizes are not ranges (notebook 07 §1)", measured=measured)
    problems = []
    for n in QUERIES:
        if said[n] == truth[n]:
            continue
        if truth[n] is None:
            why = (f"is {n} inside any entry? Read what PiecewiseBackend.__call__ does for a "
                   "num_tokens outside them all (notebook 07 §6)")
        elif said[n] is None:
            why = f"is {n} really outside every entry? Check it against the sizes and the ranges"
        elif said[n][0] == said[n][1] and n not in sizes:
            why = f"is {n} a compile size? (compile_sizes={sizes})"
        else:
            why = ("which entry does _find_range_for_shape try first, a compile size "
                   "or the range containing it?")
        problems.append(f"num_tokens={n}: not {_show(said[n])}: {why}")
    if problems:
        raise ExerciseFailed("the ranges are right, but not every lookup (notebook 07 §2):\n  - "
                             + "\n  - ".join(problems), measured=measured)
    return ("Endpoints 1 and 100 are dropped, so the ranges are "
            f"{', '.join(map(_show, ranges))}; the sizes 2 and 16 win over Range(1, 16), 1 has "
            "no size of its own, and 65 has no entry at all.")


@exercise("07.1", "the compile ranges, and which entry serves num_tokens = n",
          section="notebook 07 §1 (sizes and "
          "ranges) and §2 (dispatch by num_tokens)",
          hint="read how get_compile_ranges() builds the ranges from the endpoints (which "
               "endpoints does it keep?); then, for each n, which entry "
               "_find_range_for_shape tries first",
          deeper_hint="In a cell, build the config and print cc.compile_ranges_endpoints after "
                      "construction: compare it with what you passed, and read "
                      "VllmConfig._set_compile_ranges in vLLM (or config/compilation.py here) for "
                      "the rule. The ranges cover [1, max_num_batched_tokens] without gaps. For "
                      "the lookups read PiecewiseBackend._find_range_for_shape: what it checks "
                      "first, what second, and what it returns when nothing matches.",
          solution=lambda: {"ranges": [(1, 16), (17, 48), (49, 64)],
                            "serves": {1: (1, 16), 2: (2, 2), 16: (16, 16),
                                       17: (17, 48), 50: (49, 64),
                                       64: (49, 64), 65: None}},
          wrong=lambda: {"ranges": [(1, 1), (2, 16), (17, 48), (49, 64)],
                         "serves": {1: (1, 1), 2: (2, 2), 16: (16, 16), 17: (17, 48), 50: (49, 64),
                                    64: (49, 64), 65: None}},
          wrong_says="1 < e < max_num_batched_tokens",
          gives_away="gives Range(1, 16), Range(17, 48), Range(49, 64)")
def grade_dispatch(answer: Any) -> str:
    return _grade_dispatch(answer)


# ---------------------------------------------------------------------------------------------
# 07.2: how many Inductor compiles

COUNT_SIZES, COUNT_ENDPOINTS, COUNT_MAX = [4, 8], [1, 7, 8, 16], 16


@measured_once
def _compiles_truth() -> dict[str, Any]:
    """Compile the 1-layer Llama with Inductor: the compiles of its first call and of the calls
    at every num_tokens after it, and the pieces and entries behind them."""
    from minivllm_compile import Range, compilation_counter
    from minivllm_compile.models import build_model

    cc = _config("inductor", compile_sizes=COUNT_SIZES, compile_ranges_endpoints=COUNT_ENDPOINTS,
                 max_num_batched_tokens=COUNT_MAX)
    with env(VLLM_DISABLE_COMPILE_CACHE="1"):
        lm = build_model("llama", num_layers=L, compilation_config=cc)
        before = compilation_counter.clone()
        lm(*_tokens(10))
        first = compilation_counter.num_inductor_compiles - before.num_inductor_compiles
        middle = compilation_counter.clone()
        for n in range(1, COUNT_MAX + 1):
            lm(*_tokens(n))
        later = compilation_counter.num_inductor_compiles - middle.num_inductor_compiles
    backend = lm.model.backend
    ranges = cc.get_compile_ranges()
    return {"first": first, "later": later, "compiled": len(backend.piecewise_backends),
            "all_pieces": len(backend.piecewise_graphs),
            "entries": list(backend.piecewise_backends[0].range_entries),
            "ranges": ranges, "sizes": list(cc.compile_sizes),
            "endpoints": list(cc.compile_ranges_endpoints),
            "both": [s for s in cc.compile_sizes if Range(s, s) in ranges]}


def _grade_compiles(answer: Any) -> str:
    if not isinstance(answer, dict) or set(answer) != {"first_call", "later_calls"} \
            or not all(isinstance(v, int) for v in answer.values()):
        raise ExerciseFailed("give {'first_call': int, 'later_calls': int}, two "
                             f"num_inductor_compiles deltas; got {answer!r}")
    t = _compiles_truth()
    first, later, compiled, entries = t["first"], t["later"], t["compiled"], t["entries"]
    assert first == compiled * len(entries), (first, compiled, entries)
    explain = (f"Endpoints {COUNT_ENDPOINTS} filtered to {t['endpoints']} give ranges "
               f"{t['ranges']}; with compile_sizes {t['sizes']} each compiled piece has "
               f"{len(entries)} entries ({entries}), and the {compiled} compiled pieces (of "
               f"{t['all_pieces']}: the splitting pieces run eagerly, uncompiled) make {compiled} "
               f"x {len(entries)} = {first}")
    problems = []
    said = answer["first_call"]
    if said != first:
        if said == compiled * (len(t["sizes"]) + len(t["ranges"])) and t["both"]:
            problems.append(f"first call: you said {said}, the seed's count: you counted a "
                            "compile size that is also a range twice; vLLM compiles it once (`if "
                            "range not in self.compile_ranges`)")
        elif said == t["all_pieces"] * len(entries):
            problems.append(f"first call: you said {said}, counting every piece: which pieces does "
                            "Inductor compile, and which run eagerly?")
        else:
            problems.append(f"first call: you said {said}. Count the entries of one compiled "
                            "piece (filter the endpoints first, then one entry per size and "
                            "one per range, a size that is already a range once) and "
                            "multiply by the compiled pieces")
    if answer["later_calls"] != later:
        problems.append(f"calls for num_tokens 1..{COUNT_MAX} after it: not "
                        f"{answer['later_calls']}. What does PiecewiseBackend do at run time for a "
                        "num_tokens that is not a compile size? (notebook 07 §2 and §6; seed §5)")
    if problems:
        raise ExerciseFailed("num_inductor_compiles says otherwise (notebook 07 §5):\n  "
                             "- " + "\n  - ".join(problems),
                             measured=explain + f"; later calls: {later}")
    return explain + f"; then {later} for every num_tokens 1..{COUNT_MAX}: all compiled up front."


@exercise("07.2", "how many Inductor compiles", section="notebook 07 §5 (how many compilations)",
          hint="count the entries of one compiled piece (sizes and ranges, after the endpoints are "
               "filtered) and the pieces that are compiled; then ask whether a later call at a "
               "num_tokens between the entries compiles anything",
          deeper_hint="First the entries: filter the endpoints as in 07.1, list the ranges, add "
                      "one entry per compile size unless that size is already a range (vLLM: `if "
                      "range not in self.compile_ranges`). Then the pieces of a 1-layer Llama "
                      "(notebook 06 §1: 2L+1 pieces, L+1 of them compiled). first_call = "
                      "compiled pieces x entries. For later_calls, reread §2: at run time "
                      "PiecewiseBackend only looks an entry up.",
          solution=lambda: {"first_call": 8, "later_calls": 0},
          wrong=lambda: {"first_call": 10, "later_calls": 0},
          wrong_says="twice",
          gives_away="2 x 4 = 8")
def grade_compiles(answer: Any) -> str:
    return _grade_compiles(answer)
