"""What Inductor generated, read from its source (`CompiledEntry.code`, or any source captured
with `compiler_interface.capture_output_code`): the kernels, their signatures, and what the
wrapper's `call()` runs (notebooks 07, 08).
"""

from __future__ import annotations

import re
from collections import Counter

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
