"""The tour (`python3 run.py tour`): the trained tiny models generate text, tiny-llama is compiled
under VLLM_COMPILE and writes the same text, then every Triton kernel is checked against its
reference."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter
from minivllm_compile.compilation import cache_files
from minivllm_compile.envs import default_device
from minivllm_compile.models import load_model

PROMPTS = ["def fibonacci(n):\n", "for line in lines:\n", "class Stack:\n    def push(self, "]
# How each model decodes. Greedy decoding of tiny-hybrid loops: after two of these prompts the most
# likely next byte stays a space (it prints nothing but indentation), after the third it repeats a
# phrase. Sampling at temperature 0.8 breaks the loop; seeded, it writes the same text every run.
DECODING = {"tiny-llama": {"temperature": 0.0}, "tiny-hybrid": {"temperature": 0.8, "seed": 0}}


def choose_threads(device: str) -> str:
    """One torch thread on a CPU unless OMP_NUM_THREADS says otherwise: these tiny models gain
    nothing from a second thread, and on a small machine a step stalls (tens of times slower)
    whenever another program takes one of the cores its threads wait on (README, "Threads")."""
    default = torch.get_num_threads()
    if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
        return f"1 (torch's default here: {default}; set OMP_NUM_THREADS to choose)"
    return (f"{default} (torch's "
            f"default{', from OMP_NUM_THREADS' if 'OMP_NUM_THREADS' in os.environ else ''})")


def main() -> int:
    device = default_device()
    print(f"=== device {device}, torch threads: {choose_threads(device)}")
    for name, decoding in DECODING.items():
        lm = load_model(name, device=device)
        t0 = time.perf_counter()
        outs = lm.generate(PROMPTS, max_new_tokens=96, **decoding)
        dt = time.perf_counter() - t0
        how = ("greedy" if not decoding["temperature"] else
               f"sampled at temperature {decoding['temperature']}, seed {decoding['seed']}: greedy "
               "decoding of this model loops on indentation")
        print(f"=== {name}: {sum(p.numel() for p in lm.model.parameters()) / 1e6:.2f}M parameters, "
              f"{len(PROMPTS)} prompts x 96 new tokens in {dt:.1f} s (eager, {how})")
        for p, o in zip(PROMPTS, outs):
            print(f"--- prompt {p!r}\n{p}{o}")
    compiled_tour(device)
    print(f"=== every Triton kernel against its reference ({device}"
          f"{', Triton interpreter' if device == 'cpu' else ''})", flush=True)
    # a fresh process: Triton reads TRITON_INTERPRET when torch first imports it, long before now
    env = {**os.environ, "TRITON_INTERPRET": "1"} if device == "cpu" else dict(os.environ)
    return subprocess.run([sys.executable, "-m", "minivllm_compile.kernels.selfcheck"], env=env,
                          check=False).returncode


def compiled_tour(device: str) -> None:
    """The same model under VLLM_COMPILE: one trace, split at attention, every piece compiled for
    every size and range; saved, so the next tour loads it instead (seed §10)."""
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, compile_sizes=[1, 4],
                           compile_ranges_endpoints=[16], max_num_batched_tokens=128)
    eager, lm = load_model("tiny-llama", device=device), load_model(
        "tiny-llama", compilation_config=cc, device=device)
    before = compilation_counter.clone()
    t0 = time.perf_counter()
    lm.warmup()
    dt = time.perf_counter() - t0
    moved = compilation_counter.since(before)
    loaded, pieces = moved["num_aot_artifacts_loaded"], moved["num_piecewise_graphs_seen"]
    compiles = moved["num_unique_compiles"]  # identical layers share one
    print("=== tiny-llama under VLLM_COMPILE: "
          + (f"loaded the saved AOT artifact in {dt:.1f} s (no trace, no compile)" if loaded else
             f"traced once, split into {pieces} pieces, {compiles} "
             f"Inductor compiles in {dt:.1f} s"))
    same = lm.generate(PROMPTS, max_new_tokens=48) == eager.generate(PROMPTS, max_new_tokens=48)
    print(f"greedy text identical to eager: {same}; compile cache: {cache_files.cache_root()}")
    if not same:
        raise SystemExit("compiled and eager text differ")


if __name__ == "__main__":
    raise SystemExit(main())
