"""The tour (`python3 run.py tour`): the trained tiny models generate text, then every Triton kernel
is checked against its reference. Later stages add the compile pipeline here."""

from __future__ import annotations

import os
import time

import torch

if not torch.cuda.is_available():
    # no GPU: run the Triton kernels through Triton's interpreter (read when kernels are defined)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from minivllm_compile.kernels.selfcheck import check_all_kernels  # noqa: E402
from minivllm_compile.models import load_model  # noqa: E402

PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def push(self, "]


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in ("tiny-llama", "tiny-hybrid"):
        lm = load_model(name, device=device)
        t0 = time.perf_counter()
        outs = lm.generate(PROMPTS, max_new_tokens=96)
        dt = time.perf_counter() - t0
        print(f"=== {name}: {sum(p.numel() for p in lm.model.parameters()) / 1e6:.2f}M parameters, "
              f"{len(PROMPTS)} prompts x 96 new tokens in {dt:.1f} s (eager, greedy)")
        for p, o in zip(PROMPTS, outs):
            print(f"--- prompt {p!r}\n{p}{o}")
    print(f"=== every Triton kernel against its reference ({device}"
          f"{', Triton interpreter' if device == 'cpu' else ''})")
    rows = check_all_kernels(device)
    for r in rows:
        print(f"{r['kernel']:<26} {r['dtype']:<9} max |triton - ref| = {r['max_abs_diff']:.2e}  "
              f"{'ok' if r['ok'] else 'MISMATCH'}")
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} kernel checks passed")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
