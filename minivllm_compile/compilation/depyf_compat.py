"""depyf kept usable against this torch's Inductor (vLLM 0.34's compilation/depyf_compat.py).

`depyf.prepare_debug` (what `debug_dump_path` turns on: monitor.depyf_debug) swaps three torch
functions for hooks of its own while a compile runs. Two of them take new arguments, but its
`load_by_key_path` hook has a frozen signature, `(key, path, linemap, attrs)`, and Inductor now
also passes `set_sys_modules`: `PyCodeCache.load`, through which Inductor imports generated source
(each Triton kernel on a GPU, an autotuning block), calls
`load_by_key_path(key, path, set_sys_modules=...)`, so such a load fails with

    TypeError: patched_load_by_key_path() got an unexpected keyword argument 'set_sys_modules'

(seen with depyf 0.20.0, its last release, on torch 2.13). A CPU compile with Inductor's C++
backend does not meet it: its output module is loaded through `load_by_key_path` without the new
keyword, and its kernels through the C++ code cache. As vLLM does, the hook is replaced by
one of the same behaviour that takes any keyword and passes it on: it copies the generated source
into the dump folder, then calls the function depyf displaced. The patch is made once, and only
when depyf's hook does not already take what Inductor passes (a later depyf may).

`prepare_debug` below is the one way into depyf's debugging here, so the patch is never missed.
(`wrapper.decompile` calls `depyf.decompile` directly, as vLLM's wrapper.py does: decompiling a
code object installs no hook.)
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

logger = logging.getLogger(__name__)

_patched = False


def available() -> bool:
    """Whether depyf can be imported (debug_dump_path works without it, with less in the dump)."""
    try:
        import depyf  # noqa: F401
    except ImportError:
        return False
    return True


def _hook_accepts_inductor_keywords(hook: Callable[..., Any]) -> bool:
    """Whether depyf's hook takes every parameter of this torch's `load_by_key_path` (compared
    with the live `PyCodeCache.load_by_key_path`: meaningful only while depyf is not active)."""
    import torch._inductor.codecache as codecache

    accepted = inspect.signature(hook).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return True
    expected = inspect.signature(codecache.PyCodeCache.load_by_key_path).parameters
    return expected.keys() <= accepted.keys()


def _patch_load_by_key_path() -> None:
    """depyf's `load_by_key_path` hook, taking and passing on keywords it does not know."""
    import depyf.explain.enable_debugging as enable_debugging
    from depyf.explain.global_variables import data
    from depyf.explain.utils import get_current_compiled_fn_name, write_code_to_file_template

    def load_by_key_path(key, path, linemap=None, attrs=None, **kwargs):
        with open(path) as f:
            src = f.read()
        # the source beside the rest of the dump, named after the compiled function, as depyf's
        name = get_current_compiled_fn_name() + ".kernel_%s.py"
        dumped_path = write_code_to_file_template(src, os.path.join(data["dump_src_dir"], name))
        return data["unpatched_load_by_key_path"](key, dumped_path, linemap, attrs, **kwargs)

    # prepare_debug reads this module global each time it installs its hooks
    enable_debugging.patched_load_by_key_path = load_by_key_path


def prepare_debug(dump_src_dir: str) -> AbstractContextManager[None]:
    """`depyf.prepare_debug(dump_src_dir)`, with the hook patched first if it needs it."""
    global _patched
    import depyf
    import depyf.explain.enable_debugging as enable_debugging

    if not _patched and not _hook_accepts_inductor_keywords(
        enable_debugging.patched_load_by_key_path
    ):
        logger.debug("Patching depyf's load_by_key_path hook for this Inductor")
        _patch_load_by_key_path()
        _patched = True
    return depyf.prepare_debug(dump_src_dir)
