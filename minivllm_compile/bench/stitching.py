"""The stitching's own cost per decode step (`--only stitching`): the stitching graph run as an FX
GraphModule against the stitching function vLLM writes from it (compilation/codegen.py).

One decode step of a batch is captured as the stitching function receives it; then, in
alternating rounds, the same step runs three ways: the GraphModule (`split_gm(*args)`, what this
project ran before), the stitching function (`execution_fn(*args)`, what runs now), and the pieces
alone (every submodule the step calls, called directly with the arguments it got, in order: a
compiled piece as installed, a splitting piece as the plain function the stitching function
inlines, so that its ops count as the piece's and only the calling counts as stitching). The
stitching's cost is a way's step time minus the pieces' time, each taken at its fastest round (the
least disturbed, as timeit reports; a shared machine's noise only ever adds); the ratio is the
GraphModule's cost over the function's, measured in the same run. The medians of the per-round
differences are reported beside them. The model
is a Llama of many layers and tiny sizes: the stitching's cost grows with the number of pieces,
not with their size, and small pieces keep the noise of their own time small beside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from minivllm_compile import CompilationConfig
from minivllm_compile.bench.common import DEVICE, M, set_threads, stats, sync
from minivllm_compile.compilation.codegen import generate_execution_code_with_name
from minivllm_compile.forward_context import set_forward_context


def _capture(record, step: Callable[[], object]) -> tuple[tuple, list[tuple[Callable, tuple]]]:
    """The stitching function's arguments in one real step, and each submodule call of that step
    (the callable and its arguments, in order), recorded by running the step once more through
    the GraphModule with a recorder in each submodule's place."""
    stitched, args = record.execution_fn, []
    record.execution_fn = lambda *a: args.append(a) or stitched(*a)
    try:
        step()
    finally:
        record.execution_fn = stitched
    called: list[tuple[Callable, tuple]] = []
    installed = {}
    for name, module in record.split_gm.named_children():
        target = record.called_for(name)
        if target is module:  # a splitting piece: its ops, as the stitching function inlines them
            target = _as_function(module)
        installed[name] = record.split_gm.__dict__.get(name)
        record.split_gm.__dict__[name] = lambda *a, t=target: called.append((t, a)) or t(*a)
    try:
        record.split_gm(*args[0])
    finally:
        for name, before in installed.items():
            if before is None:
                del record.split_gm.__dict__[name]
            else:
                record.split_gm.__dict__[name] = before
    return args[0], called


def _as_function(piece) -> Callable:
    """A splitting piece's graph as the plain function the stitching function inlines."""
    code, _, consts = generate_execution_code_with_name(piece, "piece", with_submod=False)
    namespace = {"__vllm_consts__": consts}
    exec(compile("import torch\nimport operator\n" + code, "<piece>", "exec"), namespace)  # noqa: S102
    return namespace["piece"]


def bench_stitching(q: bool) -> dict:
    from minivllm_compile.models import build_model

    layers, batch, rounds, k = (1, 1, 3, 20) if q else (8, 1, 41, 200)
    backend = "eager" if q else "inductor"
    cc = CompilationConfig(mode=M.VLLM_COMPILE, backend=backend, compile_sizes=[batch],
                           max_num_batched_tokens=64)
    lm = build_model("llama", num_layers=layers, compilation_config=cc, device=DEVICE,
                     hidden_size=16, intermediate_size=32, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=8)
    lm.warmup()
    ctx = 8
    table = lm.allocate_caches([ctx + 1] * batch)
    md = lm.metadata([1] * batch, [ctx + 1] * batch, list(range(batch)), table)
    ids = torch.zeros(batch, dtype=torch.long, device=DEVICE)
    pos = torch.full((batch,), ctx, dtype=torch.long, device=DEVICE)
    record = lm.model.backend.record
    set_threads(1)
    with torch.inference_mode(), set_forward_context(md, lm.model.static_forward_context):
        args, calls = _capture(record, lambda: lm.model(ids, pos))
        ways = {"graph_module": lambda: record.split_gm(*args),
                "stitching_function": lambda: record.execution_fn(*args),
                "pieces_only": lambda: [fn(*a) for fn, a in calls]}
        times: dict[str, list[float]] = {w: [] for w in ways}
        order = list(ways)
        for r in range(rounds + 1):  # round 0 warms up
            for w in (order if r % 2 else order[::-1]):
                sync()
                t0 = time.perf_counter()
                for _ in range(k):
                    ways[w]()
                sync()
                if r:
                    times[w].append((time.perf_counter() - t0) / k * 1e6)
    per_round = {w: [t - p for t, p in zip(times[w], times["pieces_only"])]
                 for w in ("graph_module", "stitching_function")}
    own = {w: min(times[w]) - min(times["pieces_only"]) for w in per_round}
    # a difference of two timings can come out at or below zero on a busy machine: no ratio then
    ratio = own["graph_module"] / own["stitching_function"] if min(own.values()) > 0 else None
    print(f"[bench] stitching: per decode step of {batch} sequences, {len(calls)} submodule calls: "
          f"GraphModule {own['graph_module']:.1f} µs of its own, stitching function "
          f"{own['stitching_function']:.1f} µs (fastest rounds); ratio "
          f"{'-' if ratio is None else f'{ratio:.2f}'}")
    return {"config": {"layers": layers, "batch": batch, "backend": backend, "rounds": rounds,
                       "calls_per_round": k, "submodule_calls": len(calls)},
            "step_us": {w: stats(v) for w, v in times.items()},
            "stitching_us": own,
            "stitching_us_per_round": {w: stats(v) for w, v in per_round.items()},
            "ratio_graph_module_vs_function": ratio}
