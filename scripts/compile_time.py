"""Cold compile time under VLLM_COMPILE, each measurement a fresh subprocess with an empty
Inductor cache (so nothing is reused from an earlier run).

    python scripts/compile_time.py [--model llama|tiny-llama] [--layers 2] [--sizes 4 8]
                                   [--endpoints 16] [--max 64] [--rounds 1] [--compare DIR]

Prints one JSON line per measurement: wall seconds of the first call (Dynamo trace + split +
every Inductor compile), the Dynamo part, the Inductor part, the rest (the backend's own work:
the split, the interpreter, the keys, the cache writes), and the counters. `--model
tiny-llama` compiles the trained checkpoint instead of a seeded `build_model("llama")`.
`--compare DIR` measures a second copy of the package too (DIR holds its `minivllm_compile/`,
e.g. a `git worktree` of an earlier commit), alternating the two round by round, and prints the
ratios of their median cold compiles and of their backends' own seconds: two versions measured
in one run. A measurement, never a
test: machines are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, time, torch
import minivllm_compile
from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter
from minivllm_compile.models import build_model, load_model
a = json.loads(sys.argv[1])
cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, compile_sizes=a["sizes"],
                       compile_ranges_endpoints=a["endpoints"], max_num_batched_tokens=a["max"])
lm = (load_model(a["model"], compilation_config=cc) if a["model"] != "llama"
      else build_model("llama", num_layers=a["layers"], compilation_config=cc))
t0 = time.perf_counter()
lm.warmup()
wall = time.perf_counter() - t0
b = lm.model.backend
inductor = sum(e.seconds for e in b.compiler_manager.entries)
print(json.dumps({"package": minivllm_compile.__file__, "model": a["model"],
                  "layers": lm.config.num_hidden_layers, "sizes": a["sizes"],
                  "ranges": [str(r) for r in cc.get_compile_ranges()],
                  "cold_compile_s": round(wall, 2), "dynamo_s": round(b.dynamo_time_s, 2),
                  "inductor_s": round(inductor, 2),
                  # the rest: the split, the interpreter, the keys, writing the cache, the first run
                  "backend_own_s": round(wall - b.dynamo_time_s - inductor, 2),
                  "num_backend_compilations": compilation_counter.num_backend_compilations,
                  "num_inductor_compiles": compilation_counter.num_inductor_compiles,
                  "torch": torch.__version__, "threads": torch.get_num_threads()}))
"""


def cold_compile(spec: dict, package_dir: str | None) -> dict:
    """One cold compile in a fresh process; `package_dir` first on its path, if given."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "VLLM_CACHE_ROOT": cache,
               "VLLM_DISABLE_COMPILE_CACHE": "1"}
        if package_dir:
            env["PYTHONPATH"] = os.pathsep.join([package_dir, env.get("PYTHONPATH", "")])
        # started in the empty folder: `python -c` puts its working folder first on sys.path
        out = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env, check=True,
                             capture_output=True, text=True, timeout=1800, cwd=cache)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama", help="llama (seeded, --layers) or a checkpoint")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--sizes", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--endpoints", type=int, nargs="*", default=[16])
    ap.add_argument("--max", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--compare", metavar="DIR", help="a second copy of the package to measure")
    args = ap.parse_args()
    spec = {"model": args.model, "layers": args.layers, "sizes": args.sizes,
            "endpoints": args.endpoints, "max": args.max}
    versions = {"this": None, **({"compare": args.compare} if args.compare else {})}
    walls: dict[str, list[float]] = {v: [] for v in versions}
    own: dict[str, list[float]] = {v: [] for v in versions}
    for r in range(args.rounds):
        order = list(versions) if r % 2 == 0 else list(versions)[::-1]
        for v in order:
            res = cold_compile(spec, versions[v])
            walls[v].append(res["cold_compile_s"])
            own[v].append(res["backend_own_s"])
            print(json.dumps({"version": v, **res}), flush=True)
    if args.compare:
        med = {v: statistics.median(w) for v, w in walls.items()}
        med_own = {v: statistics.median(w) for v, w in own.items()}
        print(json.dumps({"median_cold_compile_s": med,
                          "ratio_compare_vs_this": round(med["compare"] / med["this"], 3),
                          "median_backend_own_s": med_own,
                          "ratio_backend_own_compare_vs_this":
                              round(med_own["compare"] / med_own["this"], 3)
                              if med_own["this"] > 0 else None}))


if __name__ == "__main__":
    main()
