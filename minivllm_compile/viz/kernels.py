"""What Inductor generated, read from its source (CompiledEntry.code): the kernels and their
signatures, what the wrapper's `call()` runs, and Inductor's source for a graph generated only,
e.g. Triton for a CPU graph on a machine without a GPU (notebooks 07, 08).
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from contextlib import ExitStack
from typing import Any
from unittest.mock import patch

import torch
import torch._functorch.config
import torch.fx as fx

# `name = async_compile.cpp_pybinding([...], r'''<C++>''')` or `async_compile.triton('name', '''<py>''')`
_KERNEL = re.compile(r"^(\w+) = async_compile\.(cpp_pybinding|triton)\(.*?'{3}(.*?)'{3}", re.MULTILINE | re.DOTALL)


def kernel_sources(code: str) -> dict[str, str]:
    """Each kernel Inductor generated, by name: the C++ function of a `cpp_fused_*` kernel, or the
    `@triton.jit` function of a `triton_*` one (imports and autotuning decorator left out)."""
    out = {}
    for name, kind, src in _KERNEL.findall(code):
        start = src.find("@triton.jit" if kind == "triton" else 'extern "C"')
        out[name] = src[max(start, 0):].strip()
    return out


def kernel_signatures(code: str) -> list[str]:
    """One line per generated kernel: `cpp_fused_x_0(const float* in_ptr0, ..., const int64_t ks0)`
    for a C++ kernel, `triton_poi_fused_x_0(in_ptr0, ..., xnumel, XBLOCK : tl.constexpr)` for Triton."""
    sigs = []
    for name, src in kernel_sources(code).items():
        params = re.search(r"(?:void\s+kernel|def \w+)\((.*?)\)", src, re.DOTALL)
        sigs.append(f"{name}({' '.join(params[1].split())})" if params else name)
    return sigs


def calls_in(code: str) -> dict[str, Counter]:
    """What the wrapper's `call()` runs, by kind: `fused` (kernels Inductor generated: called
    directly, never through the torch dispatcher), `extern` (`extern_kernels.mm(..., out=buf)`:
    ATen's own kernel, reached through the dispatcher as aten.mm.out) and `ops`
    (`torch.ops.ns.op.overload(...)`: ops Inductor could not lower, through the dispatcher)."""
    start = code.find("def call(self, args):")
    body = code[start:] if start >= 0 else code
    end = body.find("\nrunner = Runner")
    body = body[:end] if end >= 0 else body
    return {
        "fused": Counter(re.findall(r"^\s+((?:cpp|triton)_\w+?)(?:\.run)?\(", body, re.MULTILINE)),
        "extern": Counter(f"extern_kernels.{m}" for m in re.findall(r"\bextern_kernels\.(\w+)\(", body)),
        "ops": Counter(re.findall(r"\b(torch\.ops\.\w+\.\w+\.\w+|aten\.\w+\.\w+)\(", body)),
    }


def triton_codegen_available() -> bool:
    """Triton is installed, so Inductor can write Triton for a CPU graph (cpu_backend='triton')."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


class _SourceWritten(Exception):
    pass


def _driver_missing() -> bool:
    from triton.runtime import driver

    try:
        driver.active.get_current_target()
    except RuntimeError:  # "0 active drivers": no GPU (and no Triton CPU backend)
        return True
    return False


def inductor_source(gm: fx.GraphModule, example_inputs: list[Any], *, cpu_backend: str = "triton",
                    config_patches: dict[str, Any] | None = None) -> str:
    """Inductor's source for `gm`, generated only: the compile stops the moment the source is
    written, so no kernel is compiled or launched. With cpu_backend="triton" a CPU graph gets
    Triton kernels. Without a GPU, Triton has no active driver to ask for the backend hash that
    Inductor writes into each kernel's metadata; a placeholder answers, which is safe only
    because nothing generated here ever runs."""
    import torch.utils._triton as torch_triton
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.graph import GraphLowering

    if cpu_backend == "triton" and not triton_codegen_available():
        raise RuntimeError("cpu_backend='triton' needs the triton package")
    sink: list[str] = []

    def save(code: str) -> None:
        sink.append(code)
        raise _SourceWritten

    # no cache (a hit would skip codegen); no compile-time autotuning (it would run the kernels)
    config = {**(config_patches or {}), "cpu_backend": cpu_backend, "fx_graph_cache": False,
              "triton.autotune_at_compile_time": False}
    with ExitStack() as stack, warnings.catch_warnings(), torch.no_grad():
        warnings.filterwarnings("ignore", message="Could not find an active CPU backend")
        stack.enter_context(torch._functorch.config.patch(enable_autograd_cache=False))
        stack.enter_context(patch.object(GraphLowering, "save_output_code", staticmethod(save)))
        if cpu_backend == "triton" and _driver_missing():
            answer = patch.object(torch_triton, "triton_hash_with_backend", lambda: "codegen-only")
            stack.enter_context(answer)
        try:
            compile_fx(gm, example_inputs, config_patches=config)
        except Exception:
            if not sink:
                raise
    if not sink:
        raise RuntimeError("Inductor finished without writing its source")
    return sink[0]
