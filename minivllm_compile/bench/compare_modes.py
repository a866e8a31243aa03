"""One compilation mode on a trained model, measured in a fresh process (notebook 12): the first
call, per-step latency at a decode and a prefill shape, the greedy text, the logits behind it, and
what the counters did on the first call and after it.

    r = run_mode("VLLM_COMPILE", work_dir=WORK, inductor_cache="ind_vllm", logits_file="l.pt")
    r["first_call_s"], r["latency_s"]["decode"], r["texts"]
    r["counters_first_call"]["num_dynamo_traces"]  # the counters the first call moved

Each run is its own process (`startup.run_in_fresh_process`), so no run inherits another's Dynamo
or Inductor state. A measurement, never a test: a shared machine's timings are noisy.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from minivllm_compile.bench.startup import run_in_fresh_process
from minivllm_compile.compilation.counter import CounterDelta

PROMPTS = ["def fibonacci(n):\n", "class Stack:\n    def push(self, "]
# one step: (sequences, new tokens each, context length after the step)
SHAPES = {"decode": (4, 1, 40), "prefill": (1, 32, 32)}


def mode_child(spec: dict) -> dict:
    """In the fresh process: build, time the first call (`lm.warmup()`, compiling or loading, as
    vLLM does before serving), then the step latencies, then greedy generate()."""
    import torch

    from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter
    from minivllm_compile.bench import startup
    from minivllm_compile.models import load_model

    torch.set_num_threads(1)  # one thread: comparable numbers on a shared machine
    device = spec["device"]

    def sync() -> None:
        # a GPU runs the kernels after the call returns: wait for them before reading the clock
        if device == "cuda":
            torch.cuda.synchronize()

    cc = CompilationConfig(mode=CompilationMode[spec["mode"]], backend=spec["backend"],
                           max_num_batched_tokens=64)
    lm = load_model(spec["model"], compilation_config=cc, device=device)
    start = compilation_counter.clone()
    sync()
    t1 = time.perf_counter()
    lm.warmup()
    sync()
    t2 = time.perf_counter()
    first_call, after_warmup = compilation_counter.since(start), compilation_counter.clone()

    def timed_step(ids: torch.Tensor, pos: torch.Tensor, md: object) -> float:
        sync()
        t = time.perf_counter()
        lm.forward_step(ids, pos, md)
        sync()
        return time.perf_counter() - t

    latency, first_at_shape = {}, {}
    for name, (seqs, each, ctx) in SHAPES.items():
        table = lm.allocate_caches([ctx] * seqs)
        md = lm.metadata([each] * seqs, [ctx] * seqs, list(range(seqs)), table)
        ids = torch.randint(0, 256, (seqs * each,), generator=torch.Generator().manual_seed(0))
        ids = ids.to(device)
        pos = torch.cat([torch.arange(ctx - each, ctx)] * seqs).to(device)
        first_at_shape[name] = timed_step(ids, pos, md)
        for _ in range(3):
            lm.forward_step(ids, pos, md)
        latency[name] = statistics.median(timed_step(ids, pos, md) for _ in range(spec["repeats"]))

    # keep the logits every greedy step of generate() picks its token from, to compare modes by
    step_logits, compute_logits = [], lm.compute_logits

    def recording_compute_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        step_logits.append(logits.float().cpu())
        return logits

    lm.compute_logits = recording_compute_logits
    texts = lm.generate(spec["prompts"], max_new_tokens=spec["max_new_tokens"])
    torch.save(torch.cat(step_logits), spec["logits_path"])
    return {"import_build_s": t1 - startup.STARTED_AT, "first_call_s": t2 - t1,
            "first_at_shape_s": first_at_shape, "latency_s": latency, "texts": texts,
            "logits_path": spec["logits_path"],
            "counters_first_call": first_call,
            "counters_after": compilation_counter.since(after_warmup)}


def run_mode(mode: str, *, work_dir: str | Path, inductor_cache: str, logits_file: str,
             env: dict[str, str | None] | None = None, device: str | None = None,
             model: str = "tiny-llama", backend: str = "inductor", prompts: list[str] | None = None,
             max_new_tokens: int = 32, repeats: int = 20) -> dict:
    """`mode_child` in a fresh process, for `mode` (a CompilationMode name) on `model`.

    Its Inductor cache is `work_dir/inductor_cache` (runs that name the same one share it, as
    successive starts on one machine do), its compile cache `work_dir/vllm_cache`, off unless
    `env` turns it on (VLLM_DISABLE_COMPILE_CACHE="0"); `env` is applied last. The logits go to
    `work_dir/logits_file`. The counters come back as `compilation_counter.since` gives them."""
    from minivllm_compile.envs import default_device

    work = Path(work_dir)
    # without TRITON_CACHE_DIR, Triton's compiled kernels (on a GPU) live in the Inductor cache dir
    environ: dict[str, str | None] = {
        "TORCHINDUCTOR_CACHE_DIR": str(work / inductor_cache),
        "VLLM_CACHE_ROOT": str(work / "vllm_cache"), "VLLM_DISABLE_COMPILE_CACHE": "1",
        "VLLM_FORCE_AOT_LOAD": None, "VLLM_USE_MEGA_AOT_ARTIFACT": None, "TRITON_CACHE_DIR": None,
        **(env or {})}
    spec = {"mode": mode, "model": model, "backend": backend, "device": device or default_device(),
            "prompts": prompts if prompts is not None else PROMPTS,
            "max_new_tokens": max_new_tokens,
            "repeats": repeats, "logits_path": str(work / logits_file)}
    result = run_in_fresh_process(mode_child, spec, environ)
    for key in ("counters_first_call", "counters_after"):
        result[key] = CounterDelta(result[key])
    return result
