"""Cold compile time of the tiny Llama under VLLM_COMPILE, measured in a fresh subprocess with an
empty Inductor cache (so nothing is reused from an earlier run).

    python scripts/compile_time.py [--layers 2] [--sizes 4 8] [--endpoints 16] [--max 64]

Prints one JSON line: wall seconds of the first call (Dynamo trace + split + every Inductor
compile), the Dynamo part alone, and the counters. A measurement, never a test: machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time, torch
from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter
from minivllm_compile.models import build_model
a = json.loads(sys.argv[1])
cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, compile_sizes=a["sizes"],
                       compile_ranges_endpoints=a["endpoints"], max_num_batched_tokens=a["max"])
lm = build_model("llama", num_layers=a["layers"], compilation_config=cc)
t0 = time.perf_counter()
lm.warmup()
wall = time.perf_counter() - t0
b = lm.model.backend
print(json.dumps({"layers": a["layers"], "sizes": a["sizes"],
                  "ranges": [str(r) for r in cc.get_compile_ranges()],
                  "cold_compile_s": round(wall, 2), "dynamo_s": round(b.dynamo_time_s, 2),
                  "inductor_s": round(sum(e.seconds for e in b.compiler_manager.entries), 2),
                  "num_backend_compilations": compilation_counter.num_backend_compilations,
                  "num_inductor_compiles": compilation_counter.num_inductor_compiles,
                  "torch": torch.__version__, "threads": torch.get_num_threads()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--endpoints", type=int, nargs="*", default=[16])
    ap.add_argument("--max", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "VLLM_CACHE_ROOT": cache}
        spec = json.dumps({"layers": args.layers, "sizes": args.sizes, "endpoints": args.endpoints,
                           "max": args.max})
        out = subprocess.run([sys.executable, "-c", CHILD, spec], env=env, check=True,
                             capture_output=True, text=True)
    print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
