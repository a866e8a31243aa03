"""Notebook 07's exercises: the compile ranges a config builds and the entry that serves each
num_tokens (get_compile_ranges, PiecewiseBackend._find_range_for_shape), and how many Inductor
compiles a config costs, at start-up and after it."""

from __future__ import annotations

from typing import Any

import torch

from minivllm_compile.exercises import ExerciseFailed, env, exercise

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
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return (value[0], value[1])
    raise ExerciseFailed(f"{where}: write an entry as Range(start, end) or (start, end), or None for no entry; "
                         f"got {value!r}")


def _show(pair: tuple[int, int] | None) -> str:
    return "None" if pair is None else f"Range({pair[0]}, {pair[1]})"


# ---------------------------------------------------------------------------------------------
# 07.1: the ranges, and which entry serves num_tokens = n

SIZES, ENDPOINTS, MAX_TOKENS = [2, 16], [1, 16, 48, 100], 64
QUERIES = (1, 2, 16, 17, 50, 64, 65)


def _grade_dispatch(answer: Any) -> str:
    if not isinstance(answer, dict) or set(answer) != {"ranges", "serves"}:
        raise ExerciseFailed(f"give {{'ranges': [...], 'serves': {{n: entry, ...}}}}; got {answer!r}")
    if not isinstance(answer["ranges"], (list, tuple)):
        raise ExerciseFailed(f"answer['ranges'] must be the list get_compile_ranges() returns; got {answer['ranges']!r}")
    said_ranges = [_as_pair(r, "answer['ranges']") for r in answer["ranges"]]
    serves = answer["serves"]
    if not isinstance(serves, dict) or set(serves) != set(QUERIES):
        raise ExerciseFailed(f"answer['serves'] must map each num_tokens in {list(QUERIES)} to the entry that runs "
                             f"it; got {serves!r}")
    said = {n: _as_pair(serves[n], f"answer['serves'][{n}]") for n in QUERIES}

    cc = _config("eager", compile_sizes=SIZES, compile_ranges_endpoints=ENDPOINTS, max_num_batched_tokens=MAX_TOKENS)
    ranges = [(r.start, r.end) for r in cc.get_compile_ranges()]
    if said_ranges != ranges:
        kept = cc.compile_ranges_endpoints
        dropped = [e for e in ENDPOINTS if e not in kept]
        raise ExerciseFailed(
            f"you predicted ranges {', '.join(map(_show, said_ranges))}; get_compile_ranges() gives "
            f"{', '.join(map(_show, ranges))}. vLLM keeps only the endpoints e with 1 < e < max_num_batched_tokens "
            f"(kept {kept}, dropped {dropped} without a word), appends max_num_batched_tokens={MAX_TOKENS} and cuts "
            "[1, max] after each endpoint; the compile sizes are not ranges (notebook 07 §1)")

    from minivllm_compile.models import build_model

    with env(VLLM_DISABLE_COMPILE_CACHE="1"):
        lm = build_model("llama", num_layers=L, compilation_config=cc)
        lm(*_tokens(10))  # the first call compiles every piece for every entry
    pieces = lm.model.backend.piecewise_backends
    truth = {}
    for n in QUERIES:
        found = {(e.compile_range.start, e.compile_range.end) if e else None
                 for e in (p._find_range_for_shape(n) for p in pieces)}
        assert len(found) == 1, found  # every piece has the same entries
        truth[n] = found.pop()
    problems = []
    for n in QUERIES:
        if said[n] == truth[n]:
            continue
        if truth[n] is None:
            why = (f"{n} is past max_num_batched_tokens={MAX_TOKENS}, outside every entry: __call__ raises "
                   "ValueError (nothing is compiled at run time)")
        elif truth[n][0] == truth[n][1]:
            container = next(r for r in ranges if r[0] <= n <= r[1])
            why = f"{n} is a compile size, so Range({n}, {n}) wins over the range containing it, {_show(container)}"
        else:
            why = (f"{n} is not a compile size (compile_sizes={cc.compile_sizes}), so the range containing it "
                   f"serves it")
        problems.append(f"num_tokens={n}: you said {_show(said[n])}, _find_range_for_shape gives "
                        f"{_show(truth[n])}: {why}")
    if problems:
        raise ExerciseFailed("the ranges are right, but not every lookup (notebook 07 §2):\n  - "
                             + "\n  - ".join(problems))
    return (f"Endpoints 1 and 100 are dropped, so the ranges are {', '.join(map(_show, ranges))}; the sizes 2 and "
            "16 win over Range(1, 16), 1 has no size of its own, and 65 has no entry at all.")


@exercise("07.1", "the compile ranges, and which entry serves num_tokens = n",
          hint="filter the endpoints as VllmConfig._set_compile_ranges does (1 < e < max_num_batched_tokens), "
               "append max_num_batched_tokens, cut [1, max]; then a compile size wins over its range",
          solution=lambda: {"ranges": [(1, 16), (17, 48), (49, 64)],
                            "serves": {1: (1, 16), 2: (2, 2), 16: (16, 16), 17: (17, 48), 50: (49, 64),
                                       64: (49, 64), 65: None}},
          wrong=lambda: {"ranges": [(1, 1), (2, 16), (17, 48), (49, 64)],
                         "serves": {1: (1, 1), 2: (2, 2), 16: (16, 16), 17: (17, 48), 50: (49, 64),
                                    64: (49, 64), 65: None}},
          wrong_says="1 < e < max_num_batched_tokens")
def grade_dispatch(answer: Any) -> str:
    return _grade_dispatch(answer)


# ---------------------------------------------------------------------------------------------
# 07.2: how many Inductor compiles

COUNT_SIZES, COUNT_ENDPOINTS, COUNT_MAX = [4, 8], [1, 7, 8, 16], 16


def _grade_compiles(answer: Any) -> str:
    from minivllm_compile import Range, compilation_counter
    from minivllm_compile.models import build_model

    if not isinstance(answer, dict) or set(answer) != {"first_call", "later_calls"} \
            or not all(isinstance(v, int) for v in answer.values()):
        raise ExerciseFailed(f"give {{'first_call': int, 'later_calls': int}}, two num_inductor_compiles deltas; "
                             f"got {answer!r}")
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
    pieces = backend.piecewise_backends
    compiled, all_pieces = len(pieces), len(backend.piecewise_graphs)
    entries = list(pieces[0].range_entries)
    ranges = cc.get_compile_ranges()
    both = [s for s in cc.compile_sizes if Range(s, s) in ranges]
    assert first == compiled * len(entries), (first, compiled, entries)
    explain = (f"Endpoints {COUNT_ENDPOINTS} filtered to {cc.compile_ranges_endpoints} give ranges {ranges}; with "
               f"compile_sizes {cc.compile_sizes} each compiled piece has {len(entries)} entries ({entries}), and "
               f"the {compiled} compiled pieces (of {all_pieces}: the splitting pieces run eagerly, uncompiled) "
               f"make {compiled} x {len(entries)} = {first}")
    problems = []
    if answer["first_call"] != first:
        said = answer["first_call"]
        if said == compiled * (len(cc.compile_sizes) + len(ranges)) and both:
            problems.append(f"first call: you said {said}, the seed's count; {first} ran: a compile size that is "
                            f"already a range ({', '.join(f'Range({s}, {s})' for s in both)}) is compiled once, "
                            "not twice (vLLM: `if range not in self.compile_ranges`)")
        elif said == all_pieces * len(entries):
            problems.append(f"first call: you said {said}, counting every piece; {first} ran: only the "
                            f"{compiled} compiled pieces are compiled")
        else:
            problems.append(f"first call: you said {said}; {first} ran")
        problems.append(explain)
    if answer["later_calls"] != later:
        problems.append(f"calls for num_tokens 1..{COUNT_MAX} after it: you said {answer['later_calls']}; {later} "
                        "ran: every entry was compiled at start-up, and a num_tokens between them runs the range "
                        "containing it; compile_sizes are warm-up, not recompile triggers (seed §5)")
    if problems:
        raise ExerciseFailed("num_inductor_compiles says otherwise (notebook 07 §5):\n  - " + "\n  - ".join(problems))
    return explain + f"; then {later} for every num_tokens 1..{COUNT_MAX}: all compiled up front."


@exercise("07.2", "how many Inductor compiles",
          hint="filter the endpoints first, count one entry per size and per range (a size that is already a "
               "range once), and multiply by the pieces that are compiled, not the splitting ones",
          solution=lambda: {"first_call": 8, "later_calls": 0},
          wrong=lambda: {"first_call": 10, "later_calls": 0},
          wrong_says="compiled once")
def grade_compiles(answer: Any) -> str:
    return _grade_compiles(answer)
