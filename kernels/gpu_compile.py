"""Every Triton kernel compiled for a GPU, on a machine without one: Triton's own compiler, down to
a cubin for sm_90 (Hopper: the H100 and H200), for every launch the self-check makes, the decode
kernel's other branches, and the kernels only the IR providers launch.

The interpreter (TRITON_INTERPRET=1) runs a kernel's Python on the CPU: it never meets Triton's
type rules, loop lowering or register allocation, so a kernel can pass every interpreted test and
still fail to compile on a GPU. Compiling needs no GPU (Triton ships its own ptxas), only the
kernels decorated with the interpreter off, i.e. a fresh process started with TRITON_INTERPRET=0:

    TRITON_INTERPRET=0 python -m minivllm_compile.kernels.gpu_compile [--arch 90]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from ._compat import HAS_TRITON, triton, triton_interpret_enabled


def _update_variants() -> None:
    """The decode kernel's other constexpr branches, which the self-check does not launch:
    speculative decoding (several tokens a sequence, num_accepted_tokens), batched and varlen."""
    from .causal_conv1d import causal_conv1d_update

    dim, width = 48, 4
    w, b = torch.randn(dim, width), torch.randn(dim)
    accepted, idx = torch.tensor([1, 3], dtype=torch.int32), torch.tensor([1, 0], dtype=torch.int32)
    causal_conv1d_update(torch.randn(2, dim, 3), torch.zeros(2, dim, width - 1 + 2), w, b, "silu",
                         conv_state_indices=idx, num_accepted_tokens=accepted)
    qsl = torch.tensor([0, 1, 3], dtype=torch.int32)  # varlen spec decode: 1 and 2 tokens
    causal_conv1d_update(torch.randn(3, dim), torch.zeros(2, dim, width - 1 + 1), w, b, "silu", idx,
                         accepted.clamp(max=2), qsl, 2)


def _ir_provider_kernels() -> None:
    """The kernels only an IR provider launches (not in the self-check): gelu_and_mul_sparse's,
    in fp32 and bf16, at a width that is not a power of two."""
    from .activation import gelu_and_mul_sparse_triton

    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 2 * 1000, dtype=dtype)
        gelu_and_mul_sparse_triton(torch.empty(3, 1000, dtype=dtype), x, 1.6448536269514722)


def launches() -> list[tuple]:
    """(kernel, args, kwargs) of every launch `selfcheck.check_all_kernels` makes, of the decode
    kernel's other branches and of the IR providers' own kernels; none is run."""
    from triton.runtime.jit import JITFunction

    from . import selfcheck

    seen: list[tuple] = []

    def capture(self, *args, grid, warmup, **kwargs):  # JITFunction.run's signature
        seen.append((self, args, kwargs))

    run = JITFunction.run
    JITFunction.run = capture
    # the wrappers refuse CPU tensors unless the interpreter is on (check_launchable reads the
    # switch at each call); the kernels were decorated with it off, and nothing is launched
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        selfcheck.check_all_kernels("cpu")
        _update_variants()
        _ir_provider_kernels()
    finally:
        JITFunction.run = run
        os.environ["TRITON_INTERPRET"] = "0"
    return seen


def signature(fn, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    """Triton's signature (`*bf16`, `i32`, ... by its own mangle_type) and the constexpr values."""
    from triton.runtime.jit import mangle_type

    values = dict(zip(fn.arg_names, args)) | kwargs
    sig, const = {}, {}
    for p in fn.params:
        v = values.get(p.name)
        if p.is_constexpr or v is None:
            sig[p.name], const[p.name] = "constexpr", v
        else:
            sig[p.name] = mangle_type(v)
    return sig, const


def compile_all(arch: int = 90) -> list[dict]:
    """One row per distinct (kernel, signature, constexprs): compiled for
    sm_<arch>, or the error."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: nothing to compile")
    if triton_interpret_enabled():
        raise RuntimeError("the kernels were decorated for the interpreter: start a fresh process "
                           "with TRITON_INTERPRET=0 (see this module's docstring)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    rows, done = [], set()
    for fn, args, kwargs in launches():
        sig, const = signature(fn, args, kwargs)
        key = (fn.__name__, tuple(sig.items()), tuple((k, repr(v)) for k, v in const.items()))
        if key in done:
            continue
        done.add(key)
        t0 = time.perf_counter()
        try:
            compiled = triton.compile(ASTSource(fn, sig, constexprs=const),
                                      target=GPUTarget("cuda", arch, 32))
            error, cubin = None, len(compiled.asm["cubin"])
        except Exception as e:  # a row per failure, so one bad kernel does not hide the others
            error, cubin = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}", 0
        dtypes = sorted({s.lstrip("*") for s in sig.values() if s.startswith("*")})
        rows.append({"kernel": fn.__name__, "pointers": ",".join(dtypes), "cubin_bytes": cubin,
                     "seconds": time.perf_counter() - t0, "error": error})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for "
                                                         "H100/H200")
    a = ap.parse_args()
    rows = compile_all(a.arch)
    for r in rows:
        status = f"{r['cubin_bytes']:>7} B cubin" if r["error"] is None else f"FAILED {r['error']}"
        print(f"{r['kernel']:<34} {r['pointers']:<18} {r['seconds']:5.1f} s  {status}")
    bad = [r for r in rows if r["error"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} kernel variants compiled for sm_{a.arch} "
          f"(triton {triton.__version__}, torch {torch.__version__})")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
