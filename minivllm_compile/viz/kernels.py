"""What Inductor generated, read from its source (`CompiledEntry.code`, or any source captured
with `compiler_interface.capture_output_code`): the kernels, their signatures, what the wrapper's
`call()` runs and allocates (notebooks 05, 07, 08, 13 and the benchmark all count with
`calls_in`, `buffers_in` and `call_stats`); and the Triton Inductor would write for a graph, on a
machine without a GPU (notebook 07).
"""

from __future__ import annotations

import ast
import logging
import re
import warnings
from collections import Counter
from typing import NamedTuple
from unittest.mock import patch

import torch
import torch.fx as fx

from minivllm_compile.compilation.compiler_interface import capture_output_code

# `name = async_compile.cpp_pybinding([...], r'''<C++>''')` or
# `async_compile.triton('name', '''<py>''')`
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
    for a C++ kernel, `triton_poi_fused_x_0(in_ptr0, ..., xnumel, XBLOCK :
    tl.constexpr)` for Triton."""
    sigs = []
    for name, src in kernel_sources(code).items():
        params = re.search(r"(?:void\s+kernel|def \w+)\((.*?)\)", src, re.DOTALL)
        sigs.append(f"{name}({' '.join(params[1].split())})" if params else name)
    return sigs


def _call_bodies(code: str) -> str:
    """The body of every `call()` in `code` (several sources joined count as one), or all of
    `code` when it has none. A body ends at the first line indented no deeper than its `def`:
    `runner = Runner(...)` (torch 2.13: a method of Runner) or the next top-level def (older)."""
    bodies = []
    for m in re.finditer(r"^([ \t]*)def call\(", code, re.MULTILINE):
        lines = []
        for line in code[m.end():].splitlines()[1:]:
            if line.strip() and len(line) - len(line.lstrip()) <= len(m.group(1)):
                break
            lines.append(line)
        bodies.append("\n".join(lines))
    return "\n".join(bodies) if bodies else code


def calls_in(code: str) -> dict[str, Counter]:
    """What the wrapper's `call()` runs, by kind: `fused` (kernels Inductor generated: called
    directly, never through the torch dispatcher), `extern` (`extern_kernels.mm(..., out=buf)`:
    ATen's own kernel, reached through the dispatcher as aten.mm.out) and `ops`
    (`torch.ops.ns.op.overload(...)`: ops Inductor could not lower, through the dispatcher)."""
    body = _call_bodies(code)
    return {
        "fused": Counter(re.findall(r"^\s+((?:cpp|triton)_\w+?)(?:\.run)?\(", body, re.MULTILINE)),
        "extern": Counter(f"extern_kernels.{m}"
                          for m in re.findall(r"\bextern_kernels\.(\w+)\(", body)),
        "ops": Counter(re.findall(r"\b(torch\.ops\.\w+\.\w+\.\w+|aten\.\w+\.\w+)\(", body)),
    }


class Buffer(NamedTuple):
    """A fresh buffer the wrapper's `call()` allocates:
    `buf3 = empty_strided_cpu((s72, 96), (96, 1), torch.float32)`. A reused one
    (`buf4 = buf2; del buf2  # reuse`) is not a new buffer."""

    name: str
    sizes: tuple[str, ...]  # each dimension as written: "96", "s72", "2*s72"
    dtype: str  # "float32"

    def nbytes(self, num_tokens: int | None = None) -> int:
        """Its size in bytes. A symbolic dimension (s72, u0) is the number of tokens: the only
        dynamic dimension this project marks, so `num_tokens` gives its value."""
        numel = 1
        for dim in self.sizes:
            expr = ast.parse(dim, mode="eval")
            symbols = {n.id for n in ast.walk(expr) if isinstance(n, ast.Name)}
            if symbols and num_tokens is None:
                raise ValueError(f"{self.name}'s size ({', '.join(self.sizes)}) depends on the "
                                 f"number of tokens ({', '.join(sorted(symbols))}): pass "
                                 "num_tokens=")
            numel *= int(eval(compile(expr, "<size>", "eval"), {"__builtins__": {}},
                              dict.fromkeys(symbols, num_tokens)))
        return numel * getattr(torch, self.dtype).itemsize


def buffers_in(code: str) -> list[Buffer]:
    """Every fresh buffer the wrapper's `call()` allocates (`empty_strided_cpu`, `_cuda`, ...),
    in order."""
    out = []
    for line in _call_bodies(code).splitlines():
        if "= empty_strided" not in line:
            continue
        text = line.strip().split(";")[0]
        stmt = ast.parse(text).body[0]
        sizes, dtype = stmt.value.args[0], stmt.value.args[2]
        dims = tuple(ast.get_source_segment(text, d) for d in sizes.elts)
        out.append(Buffer(stmt.targets[0].id, dims, dtype.attr))
    return out


def call_stats(code: str, num_tokens: int | None = None) -> dict[str, int]:
    """What the wrapper's `call()` does, counted: the one count notebooks 05 and 13 and the
    benchmark use. `code` may hold several sources (e.g. a compiled entry's, joined): their
    counts add up. `num_tokens` sizes the symbolic buffers (needed only if there are any).

        buffers            fresh buffers allocated (`buffers_in`)
        buffer_bytes       their bytes: the proxy for the memory traffic they cost
        generated_kernels  launches of kernels Inductor generated (`cpp_fused_*`, `triton_*`)
        copy_kernels       those launches whose kernel computes a copy or clone (its name says so)
        extern_calls       `extern_kernels.*` calls (ATen's kernels, through the dispatcher)
        op_calls           `torch.ops.*` calls Inductor left to the dispatcher
        copy_calls         copies made outside a generated kernel (`.copy_(`, a copy or clone op)
    """
    calls, buffers = calls_in(code), buffers_in(code)
    copies = re.compile("copy|clone")
    copying = [n for kind in ("extern", "ops") for name, n in calls[kind].items()
               if copies.search(name)]
    return {
        "buffers": len(buffers),
        "buffer_bytes": sum(b.nbytes(num_tokens) for b in buffers),
        "generated_kernels": sum(calls["fused"].values()),
        "copy_kernels": sum(n for name, n in calls["fused"].items() if copies.search(name)),
        "extern_calls": sum(calls["extern"].values()),
        "op_calls": sum(calls["ops"].values()),
        "copy_calls": len(re.findall(r"\.copy_\(", _call_bodies(code))) + sum(copying),
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
