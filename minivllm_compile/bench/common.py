"""What the benchmarks share: the device, torch's thread count (recorded per benchmark), medians
with their spread, a device sync, a model built in a given mode, and step timings in alternating
order."""

from __future__ import annotations

import os
import statistics
import time

import torch

from minivllm_compile import CompilationConfig, CompilationMode
from minivllm_compile.envs import default_device
from minivllm_compile.envs import override as env
from minivllm_compile.forward_context import set_forward_context

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


def code_stats(codes: list[str], n: int) -> dict[str, int]:
    """The generated code of several compiled entries at n tokens, counted as the notebooks count
    it (`viz.call_stats`) and added up."""
    from minivllm_compile.viz.kernels import call_stats

    return call_stats("\n".join(codes), num_tokens=n)
