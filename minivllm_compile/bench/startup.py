"""Start-up measured the only honest way: each start in a fresh Python process.

    cold               empty compile cache and empty Inductor cache: Dynamo, split, every Inductor
                       compile, then the AOT file saved (the mega artifact: the default)
    aot_load           the saved AOT file, with the pieces inside it: no trace, no backend, no
                       compile
    aot_load_probing   the same, with Inductor's CPU vector-ISA probe run again (its stored answer
                       removed, see cpu_isa.py): what the AOT load cost before that answer was kept
    aot_load_non_mega  VLLM_USE_MEGA_AOT_ARTIFACT=0 (after its own cold start, cold_non_mega):
                       the AOT file holds the Dynamo graph; the backend runs again and loads every
                       piece through its index
    warm_no_aot        VLLM_USE_AOT_COMPILE=0 (after its own cold start, cold_no_aot): Dynamo traces
                       again, and Inductor's cache, moved into the compile cache, serves every
                       kernel

Each child puts the model where `envs.default_device()` says (the GPU when there is one).
Used by the benchmark (python -m minivllm_compile.bench) and notebook 09. A measurement, never a
test: a shared machine's timings are noisy.

`run_in_fresh_process` is the package's one way to run something in a fresh Python process (these
start-ups, notebook 12's modes in compare_modes.py, the benchmark's overhead children).
"""

from __future__ import annotations

import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from minivllm_compile.compilation.cpu_isa import RECORD_NAME

# what a fresh process runs: the clock read before any import (STARTED_AT), then the child
_STUB = ("import time; t0 = time.perf_counter()\n"
         "import sys\n"
         "from minivllm_compile.bench import startup\n"
         "startup.STARTED_AT = t0\n"
         "startup._child_main(sys.argv[1], sys.argv[2])\n")
STARTED_AT: float | None = None  # in a child: time.perf_counter() before its first import
_RESULT = "RESULT "


def run_in_fresh_process(child: Callable[[dict], dict], spec: dict,
                         env: dict[str, str | None] | None = None,
                         timeout_s: float = 900.0) -> dict:
    """Call `child(spec)` in a fresh Python process and return what it returned.

    `child` is a module-level function of an importable module; `spec` and its result are JSON
    (so dict keys come back as str). The process inherits os.environ with `env` applied (a value
    of None unsets the variable). A child that fails raises RuntimeError with the end of its
    stderr; one still running after `timeout_s` is killed (subprocess.TimeoutExpired)."""
    module = child.__module__
    if module == "__main__":  # run with python -m: the child imports the module by its own name
        module = getattr(getattr(sys.modules["__main__"], "__spec__", None), "name", "__main__")
    target = f"{module}:{child.__qualname__}"
    if "<" in child.__qualname__ or module == "__main__":
        raise ValueError(f"{target} cannot be imported by a fresh process: pass a module-level "
                         "function of an importable module")
    environ = dict(os.environ)
    for k, v in (env or {}).items():
        if v is None:
            environ.pop(k, None)
        else:
            environ[k] = v
    proc = subprocess.run([sys.executable, "-c", _STUB, target, json.dumps(spec)], env=environ,
                          capture_output=True, text=True, timeout=timeout_s, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{target} failed in a fresh process (exit {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    line = next((line for line in proc.stdout.splitlines() if line.startswith(_RESULT)), None)
    if line is None:
        raise RuntimeError(f"{target} printed no result in its fresh process:\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(line[len(_RESULT):])


def _child_main(target: str, spec: str) -> None:
    module, name = target.split(":")
    result = getattr(importlib.import_module(module), name)(json.loads(spec))
    print(_RESULT + json.dumps(result), flush=True)


def start_child(spec: dict) -> dict:
    """One start-up, in its own process: build the model, first call (load or compile, then run)."""
    import torch

    from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter
    from minivllm_compile.envs import default_device
    from minivllm_compile.models import build_model

    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, compile_sizes=spec["sizes"],
                           compile_ranges_endpoints=spec["endpoints"],
                           max_num_batched_tokens=spec["max"])
    lm = build_model("llama", num_layers=spec["layers"], compilation_config=cc,
                     device=default_device())
    t1 = time.perf_counter()
    ids = torch.arange(7, device=lm.device)
    out = lm(ids, ids)  # load or compile, then run
    out = out.cpu()  # (on a GPU: waits for the kernels, so the first call is timed whole)
    t2 = time.perf_counter()
    from torch._dynamo.utils import counters

    hits = {k: counters[group][k] for group, keys in (
        ("inductor", ("fxgraph_cache_hit", "fxgraph_cache_miss")),
        ("aot_autograd", ("autograd_cache_hit", "autograd_cache_miss"))) for k in keys}
    return {"first_call_s": t2 - t1, "done_at": time.time(), "import_build_s": t1 - STARTED_AT,
            "inductor_cache": hits, "counters": vars(compilation_counter),
            "checksum": float(out.double().sum())}


def run_start(cache_root: str, inductor_cache: str, spec: dict,
              extra_env: dict | None = None) -> dict:
    """One start-up (`start_child`) in a fresh process, with these caches; timed from its spawn."""
    # Inductor keeps Triton's compiled kernels under its own cache dir unless TRITON_CACHE_DIR says
    # otherwise: without it unset, a "cold" start on a GPU would find last run's kernels
    env = {"VLLM_CACHE_ROOT": cache_root, "TORCHINDUCTOR_CACHE_DIR": inductor_cache,
           "VLLM_DISABLE_COMPILE_CACHE": "0", "TRITON_CACHE_DIR": None, **(extra_env or {})}
    spawned, t0 = time.time(), time.perf_counter()
    res = run_in_fresh_process(start_child, spec, env)
    exit_s = time.perf_counter() - t0
    # the whole process as a user waits for it: from the spawn to the first logits (interpreter,
    # imports, build, load or compile, first call), and to its exit (Python's finalization of
    # torch's modules adds about a second there, whatever the model did)
    return {**res, "process_s": res.pop("done_at") - spawned, "process_exit_s": exit_s}


# each start-up: which cache it starts from (a key of `roots` below), and the switches it runs with
STARTS = {
    "cold": ("mega", {}), "aot_load": ("mega", {}), "aot_load_probing": ("mega", {}),
    "cold_non_mega": ("non_mega", {"VLLM_USE_MEGA_AOT_ARTIFACT": "0"}),
    "aot_load_non_mega": ("non_mega", {"VLLM_USE_MEGA_AOT_ARTIFACT": "0"}),
    "cold_no_aot": ("no_aot", {"VLLM_USE_AOT_COMPILE": "0"}),
    "warm_no_aot": ("no_aot", {"VLLM_USE_AOT_COMPILE": "0"}),
}


def startup_times(layers: int = 2, sizes: list[int] | None = None,
                  endpoints: list[int] | None = None,
                  max_tokens: int = 64, repeats: int = 3) -> dict:
    """Median first-call seconds of each start in STARTS, `repeats` each, every start its own
    process, in that order (each cold start fills the cache the next starts of its group read);
    also the raw runs and whether the checksums are all equal (the same model, the same logits)."""
    spec = {"layers": layers, "sizes": sizes if sizes is not None else [4, 8],
            "endpoints": endpoints if endpoints is not None else [16], "max": max_tokens}
    runs: dict[str, list[dict]] = {k: [] for k in STARTS}
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as tmp:
            roots = {group: str(Path(tmp) / group) for group, _ in STARTS.values()}
            for name, (group, env) in STARTS.items():
                if name == "aot_load_probing":  # the ISA answer the cold start stored: gone
                    (Path(roots[group]) / RECORD_NAME).unlink(missing_ok=True)
                # Inductor's cache starts empty for each group (with AOT off it moves into the root)
                runs[name].append(run_start(roots[group], str(Path(tmp) / f"inductor_{group}"),
                                            spec, env))
    med = {k: statistics.median(r["first_call_s"] for r in v) for k, v in runs.items()}
    process = {k: statistics.median(r["process_s"] for r in v) for k, v in runs.items()}
    spread = {k: [round(min(r["first_call_s"] for r in v), 3),
                  round(max(r["first_call_s"] for r in v), 3)]
              for k, v in runs.items()}
    return {"spec": spec, "median_s": med, "min_max_s": spread, "runs": runs,
            "aot_speedup_vs_cold": med["cold"] / med["aot_load"],
            # what a user waits for: spawn to first logits (interpreter, imports, build, load or
            # compile, first call); process_exit_median_s to the process's exit
            "process_median_s": process,
            "process_exit_median_s": {k: statistics.median(r["process_exit_s"] for r in v)
                                      for k, v in runs.items()},
            "process_speedup_vs_cold": process["cold"] / process["aot_load"],
            "checksums_equal": len({r["checksum"] for v in runs.values() for r in v}) == 1}


def bench_startup(q: bool) -> dict:
    """The start-ups above, for `python -m minivllm_compile.bench --only startup`."""
    from minivllm_compile.bench.common import SKIP
    from minivllm_compile.envs import override as env

    if q:
        return {"skipped": SKIP}
    with env(VLLM_USE_AOT_COMPILE=None, VLLM_USE_BYTECODE_HOOK=None):  # AOT on, as by default
        return startup_times(layers=2, sizes=[4, 8], endpoints=[16], max_tokens=64, repeats=2)
