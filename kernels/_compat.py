"""Import triton once, in one place, so the references work where triton is absent (macOS)."""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only on machines without triton
    HAS_TRITON = False

    class _Missing:
        """Stands in for triton / triton.language so kernel modules still import: the references
        keep working, and launching a kernel raises a clear error (see require_triton)."""

        def __getattr__(self, name):
            return _Missing()

        def __call__(self, *args, **kwargs):
            if len(args) == 1 and callable(args[0]) and not kwargs:
                return args[0]  # bare @triton.jit: keep the function, it is never launched
            return self  # @triton.jit(...) / @triton.autotune(...)

        def __getitem__(self, item):
            return self

    triton = _Missing()
    tl = _Missing()


def triton_interpret_enabled() -> bool:
    """True when Triton kernels will run on the CPU through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def require_triton(what: str) -> None:
    if not HAS_TRITON:
        raise RuntimeError(
            f"{what} needs triton, which is not installed here; "
            "install it (pip install triton) or call the *_ref reference instead"
        )
