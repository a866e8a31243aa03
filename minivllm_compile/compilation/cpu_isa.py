"""Remember Inductor's CPU vector-ISA probe across processes.

Before Inductor builds or loads its first C++ kernel in a process it asks which vector ISAs
(avx512, avx2, amx, ...) it may use: for every ISA the CPU claims, it compiles a test program and
dlopens it in a child Python (torch/_inductor/cpu_vec_isa.py, `valid_vec_isa_list`). That costs
1.7 s on a 2-core x86 machine, every process, and it was most of an AOT load's time (2.8 s).
(Torch 2.14 mends this itself: it leaves a `.load_ok` marker beside each probe program in
Inductor's cache and skips the child Python after that; there the probe took 0.13-0.16 s.)

The probe's answer depends only on the CPU, the C++ compiler, torch and the Python that runs it, so
this module stores it in VLLM_CACHE_ROOT/cpu_vec_isa.json under a key of exactly those, and a
later process with the same key skips the probe. It never runs a probe itself: `remembered_probe()`
wraps a compile or a load, uses a stored answer before it and stores Inductor's answer after it.
Only a "every claimed ISA works" answer can be replayed (through Inductor's own switch,
`config.cpp.vec_isa_ok`, for just the one computation of the list); any other answer, a missing
or unreadable file, or VLLM_DISABLE_COMPILE_CACHE=1 leaves Inductor to probe as usual.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Iterator

import torch

from minivllm_compile import envs
from minivllm_compile.compilation.cache_files import atomic_write, sha

logger = logging.getLogger("minivllm_compile")

RECORD_NAME = "cpu_vec_isa.json"


def record_path() -> Path:
    return Path(envs.VLLM_CACHE_ROOT) / RECORD_NAME


def _probed() -> bool:
    """Has Inductor already settled the ISA list in this process? (it is computed once)"""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    return valid_vec_isa_list.cache_info().currsize > 0


def _claimed() -> list[str] | None:
    """The ISAs Inductor would probe on this CPU, best first; None where it does not probe."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    from torch._inductor.cpu_vec_isa import supported_vec_isa_list, x86_isa_checker

    flags = x86_isa_checker()
    return [str(isa) for isa in supported_vec_isa_list if all(f in flags for f in str(isa).split())]


def probe_key() -> str:
    """Everything the probe's answer depends on."""
    from torch._inductor.cpp_builder import get_cpp_compiler

    compiler = get_cpp_compiler()
    resolved = shutil.which(compiler) or compiler
    with contextlib.suppress(OSError):
        resolved = os.path.realpath(resolved) + f"@{os.stat(resolved).st_mtime_ns}"
    factors = {"torch": torch.__version__, "torch_git": getattr(torch.version, "git_version", ""),
               "python": sys.executable, "compiler": resolved, "claimed": _claimed(),
               "cpu": platform.processor() or platform.machine()}
    return sha(json.dumps(factors, sort_keys=True), 16)


def _read(warn: bool = True) -> dict:
    path = record_path()
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise ValueError("not a JSON object")
        return data
    except (OSError, ValueError) as e:
        if warn:
            logger.warning("%s is unreadable (%s); Inductor probes the CPU "
                           "again and it is rewritten",
                           path, e)
        return {}


def replay() -> bool:
    """Settle Inductor's ISA list from the stored answer; True if that happened."""
    claimed = _claimed()
    if envs.VLLM_DISABLE_COMPILE_CACHE or claimed is None or _probed():
        return False
    from torch._inductor import config as inductor_config

    if inductor_config.cpp.vec_isa_ok is not None:  # the user decided already
        return False
    if _read().get(probe_key()) != claimed:  # not stored, or some ISA failed there: probe
        return False
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    with inductor_config.patch({"cpp.vec_isa_ok": True}):
        valid_vec_isa_list()  # cached for the process: the list the probe found before
    return True


def remember() -> None:
    """Store Inductor's answer once it has probed (no-op before, or when it is stored already)."""
    if envs.VLLM_DISABLE_COMPILE_CACHE or _claimed() is None or not _probed():
        return
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    key, answer = probe_key(), [str(isa) for isa in valid_vec_isa_list()]
    data = _read(warn=False)  # replay() has reported a bad file already
    if data.get(key) == answer:
        return
    data[key] = answer
    try:
        atomic_write(record_path(), json.dumps(data, indent=1, sort_keys=True))
    except OSError as e:  # an unwritable cache root costs the probe next time, nothing more
        logger.debug("cannot store the ISA probe's answer at %s: %s", record_path(), e)


@contextlib.contextmanager
def remembered_probe() -> Iterator[None]:
    """Around a compile or an artifact load: skip the probe if it was stored, store it if it ran.
    Only a shortcut: whatever goes wrong in it (no C++ compiler to name, a torch without these
    internals) leaves Inductor to probe as it always does, and never fails the compile."""
    _quietly(replay)
    try:
        yield
    finally:
        _quietly(remember)


def _quietly(step) -> None:
    try:
        step()
    except Exception as e:  # noqa: BLE001 - see remembered_probe
        logger.debug("cpu_isa.%s skipped: %s: %s", step.__name__, type(e).__name__, e)
