"""What Inductor generated, read from its source (`CompiledEntry.code`, or any source captured
with `compiler_interface.capture_output_code`): the kernels, their signatures, and what the
wrapper's `call()` runs (notebooks 07, 08); and the Triton Inductor would write for a graph, on a
machine without a GPU (notebook 07).
"""

from __future__ import annotations

import logging
import re
import warnings
from collections import Counter
from unittest.mock import patch

import torch
import torch.fx as fx

from minivllm_compile.compiler_interface import capture_output_code

# `name = async_compile.cpp_pybinding([...], r'''<C++>''')` or `async_compile.triton('name', '''<py>''')`
_KERNEL = re.compile(r"^(\w+) = async_compile\.(cpp_pybinding|triton)\(.*?'{3}(.*?)'{3}",
                     re.MULTILINE | re.DOTALL)


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


def triton_source_codegen_only(graph: fx.GraphModule, example_inputs: list,
                               config: dict | None = None, dynamic: bool = False) -> str:
    """The Triton code Inductor writes for `graph`, on a machine with no GPU: codegen only.

    `cpu_backend="triton"` makes Inductor emit Triton for a CPU graph. Two things need a GPU
    driver: the backend hash Inductor stamps into the code (answered here with a fixed string) and
    loading the generated module, which compiles the kernels (it fails, after the source has been
    captured, and nothing is ever launched). Seen working on torch 2.13 with triton 3.7.
    """
    code: list[str] = []
    # no autotuning at compile time: it would run the kernels
    config = {**(config or {}), "cpu_backend": "triton", "fx_graph_cache": False,
              "triton.autotune_at_compile_time": False}
    # the expected load failure would log a long error, and standalone_compile that it has no
    # artifact to save (fx_graph_cache is off): both are known here
    quiet = [logging.getLogger(n) for n in ("torch._inductor.runtime.triton_heuristics",
                                            "torch._inductor.standalone_compile")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)
    try:
        with capture_output_code(code), patch("torch.utils._triton.triton_hash_with_backend",
                                              lambda: "codegen-only"), \
                warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # "Generated kernels will not be executable": we know
            torch._inductor.standalone_compile(
                graph, example_inputs,
                dynamic_shapes="from_graph" if dynamic else "from_example_inputs",
                options={"config_patches": config})
    except Exception:  # loading the module needs a driver: expected without a GPU
        pass
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    source = "\n".join(c for c in code if "@triton.jit" in c)
    if not source:
        raise RuntimeError("Inductor produced no Triton source for this graph "
                           "(is triton installed?)")
    return source
