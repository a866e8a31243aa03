"""FixFunctionalizationPass on against off (`--only fix_functionalization`): the generated code's
calls and copies, the compile time, and the decode step."""

from __future__ import annotations

from minivllm_compile import PassConfig
from minivllm_compile.bench.common import M, build, code_stats, stats, step_times


def bench_fix_functionalization(q: bool) -> dict:
    layers, n, rounds, k = (1, 8, 3, 5) if q else (2, 16, 15, 30)
    lms, res = {}, {"backend": "eager" if q else "inductor"}  # eager: no generated code to count
    for on in (True, False):
        lm = build(M.VLLM_COMPILE, layers, backend=res["backend"], compile_sizes=[n],
                   pass_config=PassConfig(enable_fix_functionalization=on))
        entries = lm.model.backend.compiler_manager.entries
        lms[on] = lm
        res["on" if on else "off"] = {"code": code_stats([c for e in entries
                                                          if e.compile_range.is_single_size()
                                                           for c in e.code], n),
                                      "compile_s": sum(e.seconds for e in entries)}
    times = step_times(lms, n, rounds, k)
    res["on"]["step_us"], res["off"]["step_us"] = stats(times[True]), stats(times[False])
    res["num_tokens"], res["layers"] = n, layers
    res["ratio_off_vs_on_step"] = res["off"]["step_us"]["median"] / res["on"]["step_us"]["median"]
    return res
