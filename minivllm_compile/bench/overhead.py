"""Per-call overhead: each mode's call against its own compiled callable called directly, in fresh
processes (`python -m minivllm_compile.bench --only overhead`).

Models whose calls go through Dynamo (STOCK_TORCH_COMPILE, and VLLM_USE_BYTECODE_HOOK=0) share
Dynamo's cache entries for LlamaModel.forward with every other instance of the class, and a
guard-free entry matches any of them. So no two such models share a process: the benchmark runs
each group in its own child process, and within one the cache is cleared before the one
Dynamo-dispatched model compiles (the hook-on models never enter Dynamo again).
"""

from __future__ import annotations

import statistics
import time

import torch

from minivllm_compile.bench import common
from minivllm_compile.bench.common import DEVICE, M, build, clear_dynamo_cache, stats, sync
from minivllm_compile.bench.startup import run_in_fresh_process
from minivllm_compile.envs import override as env
from minivllm_compile.forward_context import set_forward_context


def _record_whole_graph_calls() -> None:
    """Child-process only: make WholeGraphBackend's compiled callables record their arguments on
    request, so the Inductor callable under STOCK and DYNAMO_TRACE_ONCE can be timed directly."""
    from minivllm_compile.compilation.wrapper import WholeGraphBackend

    orig = WholeGraphBackend.__call__

    def compile_and_record(self, gm, example_inputs):
        fn = orig(self, gm, example_inputs)
        def call(*a):  # Inductor's callable clears a list argument after unpacking it: keep copies
            if getattr(self, "capture", False):
                self.last = (fn, tuple(list(x) if isinstance(x, list) else x for x in a))
            return fn(*a)

        if hasattr(fn, "_boxed_call"):
            call._boxed_call = fn._boxed_call
        return call

    WholeGraphBackend.__call__ = compile_and_record


def _direct(lm, name: str, ids, pos, md):
    """The compiled callable of `name`'s model at this shape, with the arguments it received."""
    with env(VLLM_USE_BYTECODE_HOOK="1"), torch.inference_mode(), \
            set_forward_context(md, lm.model.static_forward_context):
        if name == "vllm_direct":  # the stitching function VllmBackend returned (codegen.py)
            record, captured = lm.model.backend.record, []
            stitched = record.execution_fn
            record.execution_fn = lambda *a: captured.append(a) or stitched(*a)
            try:
                lm.model(ids, pos)
            finally:
                record.execution_fn = stitched
            return lambda *_, a=captured[0]: stitched(*a)
        backend = lm._run_model.backend if name == "stock_direct" else lm.model.backend
        backend.capture = True
        (lm._run_model if name == "stock_direct" else lm.model)(ids, pos)
        backend.capture = False
        fn, args = backend.last
        return lambda *_: fn(*[list(x) if isinstance(x, list) else x for x in args])


VARIANTS = {"eager": (M.NONE, None), "stock": (M.STOCK_TORCH_COMPILE, None),
            "bytecode_hook": (M.DYNAMO_TRACE_ONCE, "1"),
            "dynamo_no_guards": (M.DYNAMO_TRACE_ONCE, "0"),
            "vllm_bytecode_hook": (M.VLLM_COMPILE, "1")}

DIRECT_OF = {"vllm_direct": "vllm_bytecode_hook", "bytecode_hook_direct": "bytecode_hook",
             "stock_direct": "stock"}


def overhead_child(spec: dict) -> dict:
    """In a fresh process: build spec["variants"], time calls at each size, rounds interleaved."""
    torch.set_num_threads(1)  # (the parent records it: see bench_overhead)
    _record_whole_graph_calls()
    layers, be, sizes = spec["layers"], spec["backend"], spec["sizes"]
    # name -> (lm, VLLM_USE_BYTECODE_HOOK at call time or None, runner or None for direct)
    calls = {}
    for name in spec["variants"]:
        if name in DIRECT_OF:  # the compiled callable without wrapper, guards or hook
            calls[name] = (calls[DIRECT_OF[name]][0], None, None)
            continue
        mode, hook = VARIANTS[name]
        if name in ("stock", "dynamo_no_guards"):
            clear_dynamo_cache()  # this model is the only one in the process that enters Dynamo
        lm = build(mode, layers, hook != "0", be)
        calls[name] = (lm, hook, lm._run_model if mode in (M.NONE, M.STOCK_TORCH_COMPILE)
                       else lm.model)
    setups = {}
    models = {id(lm): lm for lm, _, _ in calls.values()}  # a *_direct variant shares its model
    tables = {key: lm.allocate_caches([16]) for key, lm in models.items()}
    for n in sizes:
        for name, (lm, hook, run) in calls.items():
            ids, pos = torch.zeros(n, dtype=torch.long,
                                   device=DEVICE), torch.arange(n, device=DEVICE)
            md = lm.metadata([n], [n], [0], tables[id(lm)])
            # warm this shape (stock recompiles here), then capture the direct call
            if run is not None:
                with env(VLLM_USE_BYTECODE_HOOK=hook or "1"), torch.inference_mode(), \
                        set_forward_context(md, lm.model.static_forward_context):
                    for _ in range(3):
                        run(ids, pos)
            setups[(name, n)] = (run or _direct(lm, name, ids, pos, md), ids, pos, md, lm, hook)
    per_call: dict = {name: {n: [] for n in sizes} for name in calls}
    names = list(calls)
    for r in range(spec["rounds"] + 1):  # round 0 is a warm-up
        order = names[r % len(names):] + names[:r % len(names)]
        for n in sizes:
            for name in order:
                fn, ids, pos, md, lm, hook = setups[(name, n)]
                with env(VLLM_USE_BYTECODE_HOOK=hook or "1"), torch.inference_mode(), \
                        set_forward_context(md, lm.model.static_forward_context):
                    k = spec["calls"] if r else 3
                    sync()
                    t0 = time.perf_counter()
                    for _ in range(k):
                        fn(ids, pos)
                    sync()
                    if r:
                        per_call[name][n].append((time.perf_counter() - t0) / k * 1e6)
    return per_call


def bench_overhead(q: bool) -> dict:
    base = {"layers": 2, "backend": "eager" if q else "inductor", "sizes": [1, 2] if q
            else [1, 2, 3, 4],
            "rounds": 3 if q else 15, "calls": 10 if q else 40}
    groups = [["eager", "bytecode_hook", "bytecode_hook_direct", "vllm_bytecode_hook",
               "vllm_direct", "stock",
               "stock_direct"], ["eager", "bytecode_hook", "bytecode_hook_direct",
                                 "dynamo_no_guards"]]
    runs = [run_in_fresh_process(overhead_child, {**base, "variants": g}) for g in groups]
    common._threads_used.add(1)  # what overhead_child runs on
    sizes = [str(n) for n in base["sizes"]]

    def over(src: dict, a: str, b: str) -> dict:  # a minus its direct callable b, paired by round
        return {n: stats([x - y for x, y in zip(src[a][n], src[b][n])]) for n in sizes}

    total = [{k: {n: stats(v) for n, v in d.items()} for k, d in run.items()} for run in runs]
    extra = {"bytecode_hook": over(runs[0], "bytecode_hook", "bytecode_hook_direct"),
             "stock": over(runs[0], "stock", "stock_direct"),
             "vllm_bytecode_hook": over(runs[0], "vllm_bytecode_hook", "vllm_direct"),
             "dynamo_no_guards": over(runs[1], "dynamo_no_guards", "bytecode_hook_direct")}

    # median over sizes of the ratio of medians
    def ratio(src: dict, a: str, b: str) -> float | None:
        # an overhead can measure at or below zero on a busy machine (it is a difference of two
        # timings): then there is no ratio to report, and a target made of it fails
        if any(src[x][n]["median"] <= 0 for x in (a, b) for n in sizes):
            return None
        return statistics.median(src[a][n]["median"] / src[b][n]["median"] for n in sizes)

    return {"config": base, "groups": groups, "per_call_us": total[0],
            "per_call_us_second_process": total[1],
            "overhead_above_direct_us": extra,
            "ratios": {"bytecode_hook_vs_stock_overhead": ratio(extra, "bytecode_hook", "stock"),
                       "bytecode_hook_vs_stock_call": ratio(total[0], "bytecode_hook", "stock"),
                       "vllm_hook_vs_direct_call": ratio(total[0], "vllm_bytecode_hook",
                                                         "vllm_direct"),
                       "dynamo_no_guards_vs_bytecode_hook_call": ratio(total[1], "dynamo_no_guards",
                                                                       "bytecode_hook"),
                       "stock_vs_eager_call": ratio(total[0], "stock", "eager")}}
