"""The benchmark suite: what each compilation mode costs and buys, measured on the tiny Llama.

    python -m minivllm_compile.bench [--out DIR] [--quick] [--only NAME ...]

Writes DIR/bench.json and one PNG per benchmark (plots.py), then prints PASS/FAIL per target.
Every figure is a median over repeats with its spread; every comparison is a ratio of figures
measured in the same run. A measurement, never a test: a shared machine's timings are noisy.
Each benchmark is a module of this package (common.py: what they share).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

from minivllm_compile import compilation_counter
from minivllm_compile.bench import common
from minivllm_compile.bench.common import DEFAULT_THREADS, DEVICE
from minivllm_compile.bench.compile_scaling import bench_compile_scaling
from minivllm_compile.bench.cuda_graphs import bench_cuda_graphs
from minivllm_compile.bench.fix_functionalization import bench_fix_functionalization
from minivllm_compile.bench.fusion import bench_fusion
from minivllm_compile.bench.generate import bench_generate
from minivllm_compile.bench.ir_priority import bench_ir_priority
from minivllm_compile.bench.overhead import bench_overhead
from minivllm_compile.bench.startup import bench_startup
from minivllm_compile.bench.stitching import bench_stitching


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
              "VLLM_COMPILE through the wrapper vs its stitching function called directly")
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
           "cuda_graphs": bench_cuda_graphs, "ir_priority": bench_ir_priority,
           "stitching": bench_stitching}

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
        common._threads_used.clear()
        print(f"[bench] {name} ...", flush=True)
        try:
            res[name] = BENCHES[name](a.quick)
        except Exception as e:  # noqa: BLE001  one broken benchmark must not lose the others' figures
            traceback.print_exc()
            res[name] = {"error": f"{type(e).__name__}: {e}"}
        res["seconds"][name] = round(time.perf_counter() - t0, 1)
        res["torch_threads"][name] = sorted(common._threads_used) or [DEFAULT_THREADS]
        print(f"[bench] {name} done in {res['seconds'][name]} s (torch threads: "
              f"{', '.join(map(str, res['torch_threads'][name]))})", flush=True)
        (out / "bench.json").write_text(json.dumps(res, indent=1, default=str))
    res["targets"] = targets(res)
    res["counters"] = vars(compilation_counter)
    (out / "bench.json").write_text(json.dumps(res, indent=1, default=str))
    if not a.no_plots:
        from minivllm_compile.bench.plots import plot_all

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
