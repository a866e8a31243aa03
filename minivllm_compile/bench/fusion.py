"""The fusion passes on against off (`--only fusion`): each pass on its model, the calls and kernels
in the generated code of the decode-sized entry, and the step time."""

from __future__ import annotations

import logging

from minivllm_compile import CompilationConfig, PassConfig
from minivllm_compile.bench.common import DEVICE, M, code_stats, stats, step_times


def bench_fusion(q: bool) -> dict:
    """Each fusion pass on its model, fused vs not: the calls and kernels in the generated code of
    the decode-sized entry, and the step time. --quick: the QK-norm + RoPE
    fusion on a 1-layer hybrid."""
    from minivllm_compile.config.kernel import IrOpPriorityConfig, KernelConfig
    from minivllm_compile.models import build_model, load_model

    n, rounds, k = (4, 2, 3) if q else (4, 15, 30)
    # with the FX graph cache off, standalone_compile warns that it has
    # nothing to save: expected here
    logging.getLogger("torch._inductor.standalone_compile").setLevel(logging.ERROR)
    cases = {"qk_norm_rope": (lambda cc: build_model("hybrid", num_layers=2,
                                                     compilation_config=cc, device=DEVICE)
                              if q else load_model("tiny-hybrid", compilation_config=cc,
                                                   device=DEVICE),
                              {"enable_qk_norm_rope_fusion": True})}
    if not q:
        cases["fp8_norm_act_quant"] = (lambda cc: load_model("tiny-llama-fp8",
                                                             compilation_config=cc, device=DEVICE),
                                       {"fuse_norm_quant": True, "fuse_act_quant": True})
    res = {"num_tokens": n}
    for name, (make, flags) in cases.items():
        lms, row = {}, {}
        for fused in (True, False):
            # the norms the fusion leaves lowered to vllm_c: custom-op calls, counted like the
            # fused op (native ones would become Inductor's kernels, another column)
            kernels = KernelConfig(IrOpPriorityConfig.with_default(["vllm_c", "native"]))
            cc = CompilationConfig(mode=M.VLLM_COMPILE, compile_sizes=[n],
                                   max_num_batched_tokens=64,
                                   pass_config=PassConfig(**(flags if fused else {})),
                                   kernel_config=kernels,
                                   # a hit would skip the passes
                                   inductor_compile_config={"fx_graph_cache": False})
            lm = lms[fused] = make(cc)
            lm.warmup()
            codes = [c for e in lm.model.backend.compiler_manager.entries
                     if e.compile_range.is_single_size()
                     for c in e.code]
            row["fused" if fused else "unfused"] = {"code": code_stats(codes, n)}
        times = step_times(lms, n, rounds, k)
        row["fused"]["step_us"], row["unfused"]["step_us"] = stats(times[True]), stats(times[False])
        row["ratio_unfused_vs_fused_step"] = (row["unfused"]["step_us"]["median"]
                                              / row["fused"]["step_us"]["median"])
        res[name] = row
    return res
