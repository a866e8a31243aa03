"""The vLLM IR benchmark: one model compiled under each IR priority this machine supports (native,
vllm_c, and triton where Triton runs for real), its compile time and its decode step, as ratios to
native measured in the same run (`python -m minivllm_compile.bench --only ir_priority`)."""

from __future__ import annotations

import time

from minivllm_compile.bench.common import DEVICE, stats, step_times


def supported_priorities() -> list[str]:
    """The providers every IR op has here, in the order they are compared (triton needs a GPU)."""
    import minivllm_compile.ir.kernels  # noqa: F401  (registers the providers)
    from minivllm_compile import ir
    from minivllm_compile.kernels._compat import triton_interpret_enabled

    names = ["native", "vllm_c", "triton"]
    # the interpreter (a test switch) would make triton "supported" on a CPU and take minutes
    ops = (ir.ops.rms_norm, ir.ops.fused_add_rms_norm)
    return [
        p
        for p in names
        if all(p in op.supported_providers() for op in ops)
        and not (p == "triton" and triton_interpret_enabled())
    ]


def bench_ir_priority(q: bool) -> dict:
    from minivllm_compile import CompilationConfig, CompilationMode
    from minivllm_compile.config.kernel import IrOpPriorityConfig, KernelConfig
    from minivllm_compile.models import build_model, load_model

    device = DEVICE
    n, rounds, k = (4, 2, 3) if q else (4, 15, 30)  # 4 sequences, one new token each: a decode step
    backend = "eager" if q else "inductor"
    lms, res = {}, {"num_tokens": n, "backend": backend, "priorities": supported_priorities()}
    # a throwaway compile first: the first model of a process pays for importing and warming up
    # Inductor, which is no cost of its priority
    build_model(
        "llama",
        num_layers=1,
        device=device,
        compilation_config=CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, backend=backend, max_num_batched_tokens=16
        ),
    ).warmup()
    for priority in res["priorities"]:
        kernels = KernelConfig(
            IrOpPriorityConfig.with_default(
                [priority, "native"] if priority != "native" else ["native"]
            )
        )
        cc = CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE,
            backend=backend,
            compile_sizes=[n],
            max_num_batched_tokens=64,
            kernel_config=kernels,
            inductor_compile_config={"fx_graph_cache": False},
        )  # a hit skips the lowering
        t0 = time.perf_counter()
        lm = (
            build_model("llama", num_layers=1, compilation_config=cc, device=device)
            if q
            else load_model("tiny-llama", compilation_config=cc, device=device)
        )
        lm.warmup()
        compile_s = time.perf_counter() - t0
        lowering = getattr(lm.model.backend.post_grad_pass_manager, "ir_lowering", None)
        res[priority] = {
            "compile_s": compile_s,
            "lowered": {f"{op}={p}": c for (op, p), c in lowering.lowered.items()}
            if lowering
            else {},
        }
        lms[priority] = lm
    times = step_times(lms, n, rounds, k)
    for priority in lms:
        res[priority]["step_us"] = stats(times[priority])
    base = res["native"]
    res["ratios_vs_native"] = {
        p: {
            "step": res[p]["step_us"]["median"] / base["step_us"]["median"],
            "compile": res[p]["compile_s"] / base["compile_s"],
        }
        for p in lms
        if p != "native"
    }
    return res
