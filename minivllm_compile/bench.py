"""The benchmark suite: what each compilation mode costs and buys, measured on the tiny Llama.

    python -m minivllm_compile.bench [--out DIR] [--quick] [--only NAME ...]

Writes DIR/bench.json and one PNG per benchmark (bench_plots.py), then prints PASS/FAIL per target.
Every figure is a median over repeats with its spread; every comparison is a ratio of figures
measured in the same run. A measurement, never a test: these machines are shared and noisy.

Models whose calls go through Dynamo (STOCK_TORCH_COMPILE, and VLLM_USE_BYTECODE_HOOK=0) share
Dynamo's cache entries for LlamaModel.forward with every other instance of the class, and a
guard-free entry matches any of them. So no two such models share a process: the overhead
benchmark runs each group in its own child process, and within one the cache is cleared before
the one Dynamo-dispatched model compiles (the hook-on models never enter Dynamo again).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from minivllm_compile import CompilationConfig, CompilationMode, PassConfig, compilation_counter
from minivllm_compile.envs import default_device
from minivllm_compile.envs import override as env
from minivllm_compile.forward_context import set_forward_context
from minivllm_compile.startup import run_in_fresh_process

M = CompilationMode
DEVICE = default_device()
SKIP = "--quick: Inductor compiles in fresh processes take minutes; run without --quick"
# torch's thread count in a fresh process (OMP_NUM_THREADS, else one per core): what the benchmarks
# run with unless they set their own, and what every child process starts with
DEFAULT_THREADS = torch.get_num_threads()
_threads_used: set[int] = set()  # the thread counts the running benchmark's timings used


def set_threads(n: int) -> None:
    """torch.set_num_threads for a benchmark's timed work, recorded: bench.json and the summary say
    which thread counts each benchmark ran with. (Putting the count back
    afterwards is not recorded.)"""
    torch.set_num_threads(n)
    _threads_used.add(torch.get_num_threads())


def stats(xs: list[float]) -> dict:
    xs = sorted(xs)
    q = statistics.quantiles(xs, n=4) if len(xs) > 1 else [xs[0]] * 3
    return {"median": statistics.median(xs), "min": xs[0], "max": xs[-1], "q1": q[0],
            "q3": q[2], "n": len(xs)}


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def clear_dynamo_cache() -> None:
    from minivllm_compile.models.llama import LlamaModel

    torch._dynamo.eval_frame.remove_from_cache(LlamaModel.forward.__code__)


def build(mode: M, layers: int, hook: bool = True, backend: str = "inductor",
          max_tokens: int = 64, **kw):
    from minivllm_compile.models import build_model

    with env(VLLM_USE_BYTECODE_HOOK=str(int(hook))):
        cc = CompilationConfig(mode=mode, backend=backend, max_num_batched_tokens=max_tokens, **kw)
        lm = build_model("llama", num_layers=layers, compilation_config=cc, device=DEVICE)
        if mode in (M.DYNAMO_TRACE_ONCE, M.VLLM_COMPILE):
            lm.warmup()  # compile now, at max_tokens, as vLLM does
    return lm


# --- 1. per-call overhead -------------------------------------------------------------------------

def _record_whole_graph_calls() -> None:
    """Child-process only: make WholeGraphBackend's compiled callables record their arguments on
    request, so the Inductor callable under STOCK and DYNAMO_TRACE_ONCE can be timed directly."""
    from minivllm_compile.wrapper import WholeGraphBackend

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
        if name == "vllm_direct":  # the stitched callable VllmBackend returned
            g, captured = lm.model.backend.split_gm, []
            h = g.register_forward_pre_hook(lambda m, a: captured.append(a))
            lm.model(ids, pos)
            h.remove()
            return lambda *_, a=captured[0]: g(*a)
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
    _threads_used.add(1)  # what overhead_child runs on
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


# --- 2. start-up ----------------------------------------------------------------------------------

def bench_startup(q: bool) -> dict:
    from minivllm_compile.startup import startup_times

    if q:
        return {"skipped": SKIP}
    with env(VLLM_USE_AOT_COMPILE=None, VLLM_USE_BYTECODE_HOOK=None):  # AOT on, as by default
        return startup_times(layers=2, sizes=[4, 8], endpoints=[16], max_tokens=64, repeats=2)


# --- 3. FixFunctionalization on vs off ------------------------------------------------------------

def code_stats(codes: list[str], n: int) -> dict[str, int]:
    """The generated code of several compiled entries at n tokens, counted as the notebooks count
    it (`viz.call_stats`) and added up."""
    from minivllm_compile.viz.kernels import call_stats

    return call_stats("\n".join(codes), num_tokens=n)


def bench_fix_functionalization(q: bool) -> dict:
    layers, n, rounds, k = (1, 8, 3, 5) if q else (2, 16, 15, 30)
    lms, res = {}, {"backend": "eager" if q else "inductor"}  # eager: no generated code to count
    for on in (True, False):
        lm = build(M.VLLM_COMPILE, layers, backend=res["backend"], compile_sizes=[n],
                   pass_config=PassConfig(enable_fix_functionalization=on))
        entries = lm.model.backend.compiler_manager.entries
        lms[on] = lm
        res["on" if on else "off"] = {"code": code_stats([c for e in entries
                                                          if e.compile_range.is_single_size()
                                                           for c in e.code], n),
                                      "compile_s": sum(e.seconds for e in entries)}
    times = step_times(lms, n, rounds, k)
    res["on"]["step_us"], res["off"]["step_us"] = stats(times[True]), stats(times[False])
    res["num_tokens"], res["layers"] = n, layers
    res["ratio_off_vs_on_step"] = res["off"]["step_us"]["median"] / res["on"]["step_us"]["median"]
    return res


def step_times(lms: dict, n: int, rounds: int, k: int) -> dict:
    """µs per forward of n tokens (one sequence's step) for each model, measured in alternating
    order, round after round (the first round warms up and is dropped), on one thread."""
    setups = {}
    for key, lm in lms.items():
        md = lm.metadata([n], [n], [0], lm.allocate_caches([n]))
        setups[key] = (lm, torch.zeros(n, dtype=torch.long, device=DEVICE),
                       torch.arange(n, device=DEVICE), md)
    times = {key: [] for key in lms}
    order = list(lms)
    set_threads(1)
    for r in range(rounds + 1):
        for key in (order if r % 2 else order[::-1]):
            lm, ids, pos, md = setups[key]
            with torch.inference_mode(), set_forward_context(md, lm.model.static_forward_context):
                sync()
                t0 = time.perf_counter()
                for _ in range(k):
                    lm.model(ids, pos)
                sync()
            if r:
                times[key].append((time.perf_counter() - t0) / k * 1e6)
    torch.set_num_threads(os.cpu_count() or 1)
    return times


# --- 3b. fusion passes on vs off ------------------------------------------------------------------

def bench_fusion(q: bool) -> dict:
    """Each fusion pass on its model, fused vs not: the calls and kernels in the generated code of
    the decode-sized entry, and the step time. --quick: the QK-norm + RoPE
    fusion on a 1-layer hybrid."""
    from minivllm_compile.kernel_config import IrOpPriorityConfig, KernelConfig
    from minivllm_compile.models import build_model, load_model

    n, rounds, k = (4, 2, 3) if q else (4, 15, 30)
    # with the FX graph cache off, standalone_compile warns that it has
    # nothing to save: expected here
    logging.getLogger("torch._inductor.standalone_compile").setLevel(logging.ERROR)
    cases = {"qk_norm_rope": (lambda cc: build_model("hybrid", num_layers=2,
                                                     compilation_config=cc, device=DEVICE)
                              if q else load_model("tiny-hybrid", compilation_config=cc,
                                                   device=DEVICE),
                              {"enable_qk_norm_rope_fusion": True})}
    if not q:
        cases["fp8_norm_act_quant"] = (lambda cc: load_model("tiny-llama-fp8",
                                                             compilation_config=cc, device=DEVICE),
                                       {"fuse_norm_quant": True, "fuse_act_quant": True})
    res = {"num_tokens": n}
    for name, (make, flags) in cases.items():
        lms, row = {}, {}
        for fused in (True, False):
            # the norms the fusion leaves lowered to vllm_c: custom-op calls, counted like the
            # fused op (native ones would become Inductor's kernels, another column)
            kernels = KernelConfig(IrOpPriorityConfig.with_default(["vllm_c", "native"]))
            cc = CompilationConfig(mode=M.VLLM_COMPILE, compile_sizes=[n],
                                   max_num_batched_tokens=64,
                                   pass_config=PassConfig(**(flags if fused else {})),
                                   kernel_config=kernels,
                                   # a hit would skip the passes
                                   inductor_compile_config={"fx_graph_cache": False})
            lm = lms[fused] = make(cc)
            lm.warmup()
            codes = [c for e in lm.model.backend.compiler_manager.entries
                     if e.compile_range.is_single_size()
                     for c in e.code]
            row["fused" if fused else "unfused"] = {"code": code_stats(codes, n)}
        times = step_times(lms, n, rounds, k)
        row["fused"]["step_us"], row["unfused"]["step_us"] = stats(times[True]), stats(times[False])
        row["ratio_unfused_vs_fused_step"] = (row["unfused"]["step_us"]["median"]
                                              / row["fused"]["step_us"]["median"])
        res[name] = row
    return res


# --- 4. compile cost vs layers and vs sizes/ranges ------------------------------------------------

def bench_compile_scaling(q: bool) -> dict:
    from minivllm_compile.startup import run_start

    if q:
        return {"skipped": SKIP}
    def cold(layers: int, sizes: list[int], endpoints: list[int]) -> dict:
        # fresh process, empty Inductor and compile caches
        with tempfile.TemporaryDirectory() as tmp:
            r = run_start(f"{tmp}/vllm", f"{tmp}/inductor", {"layers": layers, "sizes": sizes,
                          "endpoints": endpoints, "max": 64}, {"VLLM_USE_AOT_COMPILE": "0"})
        c = r["counters"]
        # num_unique_compiles: the compiles that ran (num_inductor_compiles
        # counts each piece, as vLLM)
        return {"first_call_s": r["first_call_s"], "num_unique_compiles": c["num_unique_compiles"],
                "num_inductor_compiles": c["num_inductor_compiles"],
                "num_backend_compilations": c["num_backend_compilations"]}

    layer_pts = [1, 2, 4, 8]
    size_pts = [([4, 8], []), ([4, 8], [16]), ([4, 8], [16, 32])]
    by_layers = []
    for L in layer_pts:  # the two ends (the target's ratio) twice, the middle once
        runs = [cold(L, [], []) for _ in range(2 if L in (layer_pts[0], layer_pts[-1]) else 1)]
        by_layers.append({"layers": L, "wall_s": stats([x["first_call_s"] for x in runs]),
                          **runs[0]})
    by_sizes = [{"sizes": [], "endpoints": [], **by_layers[1]}]
    for sizes, endpoints in size_pts:
        x = cold(2, sizes, endpoints)
        by_sizes.append({"sizes": sizes, "endpoints": endpoints,
                         "wall_s": stats([x["first_call_s"]]), **x})
    w = {p["layers"]: p["wall_s"]["median"] for p in by_layers}
    return {"note": "cold: each point a fresh process with empty Inductor and compile caches; wall "
                    "= first call (Dynamo trace + split + Inductor); max_num_batched_tokens=64",
            "by_layers": by_layers, "by_sizes_2_layers": by_sizes,
            "ratio_max_vs_1_layer": w[max(w)] / w[1]}


# --- 5. generate() tokens/s -----------------------------------------------------------------------

def bench_generate(q: bool) -> dict:
    from minivllm_compile.models.tokenizer import ByteTokenizer

    set_threads(os.cpu_count() or 1)
    nprompt, plen, steps, reps = (2, 8, 4, 2) if q else (4, 32, 32, 5)
    base = "The quick brown fox jumps over the lazy dog. " * 4
    prompts = [(str(i) + base)[:plen] for i in range(nprompt)]
    plen = len(ByteTokenizer().encode(prompts[0]))
    be = "eager" if q else "inductor"
    # compiled modes with custom_ops=["none"], vLLM's default with Inductor: Inductor gets the
    # plain-torch layers to fuse; "vllm_compile_custom_ops" keeps the opaque ops, for comparison
    native = {"custom_ops": ["none"]}
    variants = {"eager": build(M.NONE, 2, max_tokens=256),
                "dynamo_trace_once": build(M.DYNAMO_TRACE_ONCE, 2, backend=be,
                                           max_tokens=256, **native),
                "vllm_compile": build(M.VLLM_COMPILE, 2, backend=be, max_tokens=256,
                                      compile_sizes=[nprompt],
                                      **native),
                "vllm_compile_custom_ops": build(M.VLLM_COMPILE, 2, backend=be, max_tokens=256,
                                                 compile_sizes=[nprompt])}
    clear_dynamo_cache()  # stock is then the only model entering Dynamo (the others use the hook)
    variants["stock"] = build(M.STOCK_TORCH_COMPILE, 2, backend=be, max_tokens=256, **native)
    steps_log: dict = {}
    for name, lm in variants.items():
        inner = lm.forward_step

        def timed(ids, pos, md, inner=inner, name=name):
            sync()
            t0 = time.perf_counter()
            out = inner(ids, pos, md)
            sync()
            steps_log[name].append((ids.numel(), time.perf_counter() - t0))
            return out

        lm.forward_step = timed  # the step itself, inside the real generate() loop
        for _ in range(2):  # warm up: stock compiles its prefill and decode shapes here
            steps_log[name] = []
            lm.generate(prompts, steps)
    samples = {k: {"prefill": [], "decode": [], "e2e": [], "new_tokens": []} for k in variants}
    for r in range(reps):
        k = r % len(variants)
        for name in list(variants)[k:] + list(variants)[:k]:
            steps_log[name] = []
            t0 = time.perf_counter()
            variants[name].generate(prompts, steps)
            wall = time.perf_counter() - t0
            log = steps_log[name]
            s = samples[name]
            s["prefill"].append(log[0][0] / log[0][1])
            dec = log[1:]
            s["decode"].append(sum(t for t, _ in dec) / sum(x for _, x in dec) if dec
                               else float("nan"))
            new = sum(t for t, _ in dec) + nprompt  # the prefill samples one token per sequence
            s["e2e"].append(new / wall)
            s["new_tokens"].append(new)
    res = {k: {"prefill_tok_s": stats(v["prefill"]), "decode_tok_s": stats(v["decode"]),
               "generate_new_tok_s": stats(v["e2e"]), "new_tokens": v["new_tokens"][0]}
           for k, v in samples.items()}
    d = {k: v["decode_tok_s"]["median"] for k, v in res.items()}
    return {"config": {"prompts": nprompt, "prompt_tokens": plen, "max_new_tokens": steps,
                       "repeats": reps,
                       "backend": be, "vllm_compile_sizes": [nprompt],
                       "threads": torch.get_num_threads()},
            "custom_ops": {"compiled modes": ["none"],
                           "eager and vllm_compile_custom_ops": ["all"]},
            "modes": res, "decode_ratio_vllm_vs_eager": d["vllm_compile"] / d["eager"],
            "decode_ratio_vllm_vs_stock": d["vllm_compile"] / d["stock"],
            # the same ratios round by round (the modes run back to back in each round): their
            # spread says whether a ratio near 1 is a difference or a tie
            "decode_ratio_per_round": {
                other: stats([v / o for v, o in zip(samples["vllm_compile"]["decode"],
                                                    samples[other]["decode"])])
                for other in ("eager", "stock")}}


# --- 6. CUDA-graph modes (bench_cudagraph.py) ---------------------------------------------------

def bench_cuda_graphs(q: bool) -> dict:
    from minivllm_compile.bench_cudagraph import bench_cuda_graphs as run

    return run(q, DEVICE, sync, stats)


# --- 7. vLLM IR priorities (bench_ir.py) --------------------------------------------------------

def bench_ir_priority(q: bool) -> dict:
    from minivllm_compile.bench_ir import bench_ir_priority as run

    return run(q, DEVICE, step_times, stats)


# --- targets and main -----------------------------------------------------------------------------

def targets(r: dict) -> list[dict]:
    out = []

    def check(name: str, value: float | None, op: str, limit: float, why: str) -> None:
        if value is None:  # a median overhead <= 0: nothing measured to compare
            ok, why = (False, why + "; not measured: a median overhead came out <= "
                                    "0 (a busy machine?), rerun")
        else:
            ok = value <= limit if op == "<=" else value >= limit
        out.append({"target": name, "value": value, "op": op, "limit": limit, "pass": ok,
                    "measured": why})

    if "ratios" in r.get("overhead", {}):
        o = r["overhead"]["ratios"]
        check("bytecode-hook overhead / stock torch.compile overhead",
              o["bytecode_hook_vs_stock_overhead"], "<=",
              0.7, "each call minus its own compiled callable called directly; "
                   "TRACE_ONCE hook on vs STOCK")
        check("vLLM bytecode-hook call / direct stitched callable", o["vllm_hook_vs_direct_call"],
              "<=", 1.1,
              "VLLM_COMPILE through the wrapper vs backend.split_gm(*args)")
    if "aot_speedup_vs_cold" in r.get("startup", {}):
        check("cold compile / AOT load", r["startup"]["aot_speedup_vs_cold"], ">=", 10.0,
              "first-call s, fresh processes")
    if "process_speedup_vs_cold" in r.get("startup", {}):
        check("cold process / warm (AOT-loading) process", r["startup"]["process_speedup_vs_cold"],
              ">=", 8.0,
              "whole process, s from its spawn to the first logits: imports, build, "
              "load or compile, first call")
    if "by_layers" in r.get("compile_scaling", {}):
        c = r["compile_scaling"]
        check(f"compile wall {max(p['layers'] for p in c['by_layers'])} layers / 1 layer",
              c["ratio_max_vs_1_layer"], "<=", 1.5, "cold, fresh process each")
    if "modes" in r.get("generate", {}):
        g = r["generate"]
        # "no slower": decode tokens/s of VLLM_COMPILE at least that of the other mode
        for other, key in (("eager", "decode_ratio_vllm_vs_eager"),
                           ("STOCK", "decode_ratio_vllm_vs_stock")):
            spread = g.get("decode_ratio_per_round", {}).get(other.lower())
            rounds = f", per round {spread['min']:.2f}-{spread['max']:.2f}" if spread else ""
            check(f"VLLM_COMPILE decode tok/s / {other}", g[key], ">=", 1.0,
                  f"generate() decode steps{rounds}")
    return out


BENCHES = {"overhead": bench_overhead, "startup": bench_startup,
           "fix_functionalization": bench_fix_functionalization,
           "fusion": bench_fusion, "compile_scaling": bench_compile_scaling,
           "generate": bench_generate,
           "cuda_graphs": bench_cuda_graphs, "ir_priority": bench_ir_priority}
NAMES = list(BENCHES)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m minivllm_compile.bench",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench_out", help="folder for bench.json and the plots")
    ap.add_argument("--quick", action="store_true", help="tiny configuration (seconds; numbers "
                                                         "meaningless)")
    ap.add_argument("--only", nargs="+", choices=NAMES, help="run only these benchmarks")
    ap.add_argument("--no-plots", action="store_true")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="minivllm_bench_")
    # in-process models: no AOT (the bytecode hook is what is measured), nothing read from or saved
    # to a compile cache, a fresh Inductor cache (children of startup/compile_scaling set their own)
    os.environ.update(VLLM_USE_AOT_COMPILE="0", VLLM_DISABLE_COMPILE_CACHE="1",
                      VLLM_CACHE_ROOT=f"{tmp}/vllm",
                      TORCHINDUCTOR_CACHE_DIR=f"{tmp}/inductor")
    res: dict = {"meta": {"torch": torch.__version__, "device": DEVICE, "quick": a.quick,
                          "cpus": os.cpu_count(),
                          "python": sys.version.split()[0],
                          "torch_default_threads": DEFAULT_THREADS,
                          "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")},
                 "seconds": {}, "torch_threads": {}}
    print(f"[bench] torch threads: {DEFAULT_THREADS} by default here "
          f"(OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}); a benchmark "
          "that times steps sets its own", flush=True)
    for name in a.only or NAMES:
        t0 = time.perf_counter()
        _threads_used.clear()
        print(f"[bench] {name} ...", flush=True)
        try:
            res[name] = BENCHES[name](a.quick)
        except Exception as e:  # noqa: BLE001  one broken benchmark must not lose the others' figures
            traceback.print_exc()
            res[name] = {"error": f"{type(e).__name__}: {e}"}
        res["seconds"][name] = round(time.perf_counter() - t0, 1)
        res["torch_threads"][name] = sorted(_threads_used) or [DEFAULT_THREADS]
        print(f"[bench] {name} done in {res['seconds'][name]} s (torch threads: "
              f"{', '.join(map(str, res['torch_threads'][name]))})", flush=True)
        (out / "bench.json").write_text(json.dumps(res, indent=1, default=str))
    res["targets"] = targets(res)
    res["counters"] = vars(compilation_counter)
    (out / "bench.json").write_text(json.dumps(res, indent=1, default=str))
    if not a.no_plots:
        from minivllm_compile.bench_plots import plot_all

        res["plots"] = plot_all(res, out)
        (out / "bench.json").write_text(json.dumps(res, indent=1, default=str))
    for t in res["targets"]:
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        print(f"{'PASS' if t['pass'] else 'FAIL'}  {t['target']}: {value} (target {t['op']} "
              f"{t['limit']}; {t['measured']})")
    print(f"wrote {out / 'bench.json'}")
    return res


def exit_code(res: dict) -> int:
    """1 when a target failed in a full run; --quick figures are meaningless, so never there."""
    failed = [t for t in res.get("targets", []) if not t["pass"]]
    return 1 if failed and not res.get("meta", {}).get("quick") else 0


if __name__ == "__main__":
    sys.exit(exit_code(main()))
