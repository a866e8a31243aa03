"""The CUDA-graph benchmark (`python -m minivllm_compile.bench --only cuda_graphs`): one decode step
of a batch, and what it launches, for eager, VLLM_COMPILE without graphs, and each graph mode.

On CUDA, "launches" are the CUDA runtime's launch calls in the profile (cudaLaunchKernel and the
driver's cuLaunchKernel per kernel, one cudaGraphLaunch per replayed graph): what a graph saves.
On a CPU nothing is launched; the figure there is the operator calls the profiler sees at the top
level of the step (every aten op or custom op the dispatcher runs outside a compiled kernel), and
a graph mode runs the StaticBufferReplay stand-in, which re-runs the same code from static buffers:
its cost is the copies, its payoff none. Both are printed as what they are.
"""

from __future__ import annotations

import os
import time

import torch

from minivllm_compile import CompilationConfig, CompilationMode, CUDAGraphMode
from minivllm_compile.bench.common import DEVICE, set_threads, stats, sync

# CUDA runtime / driver calls that put work on the GPU (the profiler's cuda_runtime events)
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                "cudaGraphLaunch")

MODES = {"eager": None, "vllm_compile_no_graphs": CUDAGraphMode.NONE,
         "piecewise": CUDAGraphMode.PIECEWISE,
         "full": CUDAGraphMode.FULL, "full_and_piecewise": CUDAGraphMode.FULL_AND_PIECEWISE}


def launches_per_step(step, device: str) -> dict:
    """Profile one call of `step`: on CUDA the launch calls by name; on a CPU the operator calls at
    the top of the profile (no parent operator), by name."""
    # Kineto reads this at its first profile: above its info level, no "profiler_start" lines
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
        if device == "cuda":
            torch.cuda.synchronize()
    counts: dict[str, int] = {}
    for e in prof.events():
        if device == "cuda":
            hit = e.name in LAUNCH_CALLS
        else:
            hit = e.cpu_parent is None and not e.name.startswith(("ProfilerStep", "[memory]"))
        if hit:
            counts[e.name] = counts.get(e.name, 0) + 1
    return {"what": "CUDA launch calls" if device == "cuda"
            else "top-level operator calls (a CPU launches nothing)",
            "total": sum(counts.values()),
            "by_name": dict(sorted(counts.items(), key=lambda kv: -kv[1])[:12])}


def build_variant(mode: CUDAGraphMode | None, device: str, backend: str, batch: int,
                  max_tokens: int):
    """tiny-llama (2 layers, seeded) under `mode`, compiled and its graphs
    captured, as vLLM starts."""
    from minivllm_compile.models import build_model

    if mode is None:
        return build_model("llama", num_layers=2, device=device)
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend=backend,
                           max_num_batched_tokens=max_tokens,
                           compile_sizes=[batch], cudagraph_mode=mode,
                           cudagraph_capture_sizes=[1, 2, 4, 8],
                           custom_ops=["none"])
    lm = build_model("llama", num_layers=2, compilation_config=cc, device=device)
    lm.warmup()
    return lm


def bench_cuda_graphs(q: bool) -> dict:
    """Per mode: µs per decode step of `batch` sequences (medians over rounds run in alternating
    order, one thread), the launches (or operator calls) in one step, and
    the mode it resolved to."""
    device = DEVICE
    batch, ctx, rounds, k = (4, 8, 2, 3) if q else (4, 24, 15, 20)
    backend = "eager" if q else "inductor"
    lms, res = {}, {"config": {"batch": batch, "context": ctx, "backend": backend, "device": device,
                               "capture_sizes": [1, 2, 4, 8], "custom_ops": ["none"]}, "modes": {}}
    for name, mode in MODES.items():
        try:
            lms[name] = build_variant(mode, device, backend, batch, 64)
        # a mode the attention op cannot be captured in: vLLM refuses it too
        except ValueError as e:
            res["modes"][name] = {"refused": str(e)}
            continue
        cc = lms[name].model.compilation_config if mode is not None else None
        res["modes"][name] = {"requested": "eager" if mode is None else mode.name,
                              "resolved": "eager" if cc is None else cc.cudagraph_mode.name}
    steps, outs = {}, {}
    for name, lm in lms.items():
        table = lm.allocate_caches([ctx + 1] * batch)
        # a decode step: one new token per sequence after `ctx` cached ones (uniform decode)
        md = lm.metadata([1] * batch, [ctx + 1] * batch, list(range(batch)), table)
        ids = torch.zeros(batch, dtype=torch.long, device=device)
        pos = torch.full((batch,), ctx, dtype=torch.long, device=device)
        steps[name] = (lambda lm=lm, ids=ids, pos=pos, md=md: lm.forward_step(ids, pos, md))
        # .cpu() copies: a static output is overwritten later
        outs[name] = steps[name]().float().cpu()
    for name in lms:
        res["modes"][name]["max_abs_diff_vs_eager"] = float(
            (outs[name] - outs["eager"]).abs().max())
        res["modes"][name]["launches_per_step"] = launches_per_step(steps[name], device)
    times = {name: [] for name in lms}
    order = list(lms)
    set_threads(1)
    try:
        for r in range(rounds + 1):
            for name in (order if r % 2 else order[::-1]):
                sync()
                t0 = time.perf_counter()
                for _ in range(k):
                    steps[name]()
                sync()
                if r:  # the first round warms up
                    times[name].append((time.perf_counter() - t0) / k * 1e6)
    finally:
        torch.set_num_threads(os.cpu_count() or 1)
    for name in lms:
        res["modes"][name]["step_us"] = stats(times[name])
    med = {name: res["modes"][name]["step_us"]["median"] for name in lms}
    base = med.get("vllm_compile_no_graphs")
    res["ratio_step_vs_no_graphs"] = {name: med[name] / base for name in lms} if base else {}
    for name, row in res["modes"].items():
        if "refused" in row:
            print(f"[bench] cuda_graphs {name:>20}: refused: {row['refused']}")
            continue
        print(f"[bench] cuda_graphs {name:>20} ({row['resolved']}): "
              f"{row['step_us']['median']:8.0f} µs/step, {row['launches_per_step']['total']:4d} "
              f"{row['launches_per_step']['what']}, max |diff| vs eager "
              f"{row['max_abs_diff_vs_eager']:.1e}")
    return res
