"""The tour (`python3 run.py tour`): the trained tiny models generate text, then every Triton kernel
is checked against its reference. Later stages add the compile pipeline here."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from minivllm_compile import CompilationConfig, CompilationMode, cache_files, compilation_counter
from minivllm_compile.envs import default_device
from minivllm_compile.models import load_model

PROMPTS = ["def fibonacci(n):\n", "for line in lines:\n", "class Stack:\n    def push(self, "]


def main() -> int:
    device = default_device()
    for name in ("tiny-llama", "tiny-hybrid"):
        lm = load_model(name, device=device)
        t0 = time.perf_counter()
        outs = lm.generate(PROMPTS, max_new_tokens=96)
        dt = time.perf_counter() - t0
        print(f"=== {name}: {sum(p.numel() for p in lm.model.parameters()) / 1e6:.2f}M parameters, "
              f"{len(PROMPTS)} prompts x 96 new tokens in {dt:.1f} s (eager, greedy)")
        for p, o in zip(PROMPTS, outs):
            print(f"--- prompt {p!r}\n{p}{o}")
    compiled_tour(device)
    print(f"=== every Triton kernel against its reference ({device}"
          f"{', Triton interpreter' if device == 'cpu' else ''})", flush=True)
    # a fresh process: Triton reads TRITON_INTERPRET when torch first imports it, long before now
    env = {**os.environ, "TRITON_INTERPRET": "1"} if device == "cpu" else dict(os.environ)
    return subprocess.run([sys.executable, "-m", "minivllm_compile.kernels.selfcheck"], env=env).returncode


def compiled_tour(device: str) -> None:
    """The same model under VLLM_COMPILE: one trace, split at attention, every piece compiled for
    every size and range; saved, so the next tour loads it instead (seed §10)."""
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, compile_sizes=[1, 4],
                           compile_ranges_endpoints=[16], max_num_batched_tokens=128)
    eager, lm = load_model("tiny-llama", device=device), load_model("tiny-llama", compilation_config=cc, device=device)
    before = compilation_counter.clone()
    t0 = time.perf_counter()
    lm.warmup()
    dt = time.perf_counter() - t0
    loaded = compilation_counter.num_aot_artifacts_loaded - before.num_aot_artifacts_loaded
    pieces = compilation_counter.num_piecewise_graphs_seen - before.num_piecewise_graphs_seen
    compiles = compilation_counter.num_unique_compiles - before.num_unique_compiles  # identical layers share
    print("=== tiny-llama under VLLM_COMPILE: "
          + (f"loaded the saved AOT artifact in {dt:.1f} s (no trace, no compile)" if loaded else
             f"traced once, split into {pieces} pieces, {compiles} Inductor compiles in {dt:.1f} s"))
    same = lm.generate(PROMPTS, max_new_tokens=48) == eager.generate(PROMPTS, max_new_tokens=48)
    print(f"greedy text identical to eager: {same}; compile cache: {cache_files.cache_root()}")
    if not same:
        raise SystemExit("compiled and eager text differ")


if __name__ == "__main__":
    raise SystemExit(main())
