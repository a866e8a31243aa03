"""Compile cost against the number of layers and against compile sizes and ranges
(`--only compile_scaling`): each point a cold start in a fresh process."""

from __future__ import annotations

import tempfile

from minivllm_compile.bench.common import SKIP, stats


def bench_compile_scaling(q: bool) -> dict:
    from minivllm_compile.bench.startup import run_start

    if q:
        return {"skipped": SKIP}
    def cold(layers: int, sizes: list[int], endpoints: list[int]) -> dict:
        # fresh process, empty Inductor and compile caches
        with tempfile.TemporaryDirectory() as tmp:
            r = run_start(f"{tmp}/vllm", f"{tmp}/inductor", {"layers": layers, "sizes": sizes,
                          "endpoints": endpoints, "max": 64}, {"VLLM_USE_AOT_COMPILE": "0"})
        c = r["counters"]
        # num_unique_compiles: the compiles that ran (num_inductor_compiles
        # counts each piece, as vLLM)
        return {"first_call_s": r["first_call_s"], "num_unique_compiles": c["num_unique_compiles"],
                "num_inductor_compiles": c["num_inductor_compiles"],
                "num_backend_compilations": c["num_backend_compilations"]}

    layer_pts = [1, 2, 4, 8]
    size_pts = [([4, 8], []), ([4, 8], [16]), ([4, 8], [16, 32])]
    by_layers = []
    for L in layer_pts:  # the two ends (the target's ratio) twice, the middle once
        runs = [cold(L, [], []) for _ in range(2 if L in (layer_pts[0], layer_pts[-1]) else 1)]
        by_layers.append({"layers": L, "wall_s": stats([x["first_call_s"] for x in runs]),
                          **runs[0]})
    by_sizes = [{"sizes": [], "endpoints": [], **by_layers[1]}]
    for sizes, endpoints in size_pts:
        x = cold(2, sizes, endpoints)
        by_sizes.append({"sizes": sizes, "endpoints": endpoints,
                         "wall_s": stats([x["first_call_s"]]), **x})
    w = {p["layers"]: p["wall_s"]["median"] for p in by_layers}
    return {"note": "cold: each point a fresh process with empty Inductor and compile caches; wall "
                    "= first call (Dynamo trace + split + Inductor); max_num_batched_tokens=64",
            "by_layers": by_layers, "by_sizes_2_layers": by_sizes,
            "ratio_max_vs_1_layer": w[max(w)] / w[1]}
