"""The environment switches, read under vLLM's names so the seed's instructions work verbatim.

Like vLLM's envs.py, a switch is read from os.environ each time it is asked for (a test or a
notebook can change it between models), always through one parser per switch, and a value that
does not parse is an error naming the variable and what it accepts.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _bool(name: str, default: bool) -> Callable[[], bool]:
    def read() -> bool:
        raw = os.environ.get(name)
        if raw is None:
            return default
        value = raw.strip().lower()
        if value in _TRUE:
            return True
        if value in _FALSE:
            return False
        raise ValueError(f"{name}={raw!r} is not a boolean: set it to 1 or 0 (or unset it for "
                         f"the default, {int(default)})")

    return read


def _seconds(name: str, default: float) -> Callable[[], float]:
    def read() -> float:
        raw = os.environ.get(name)
        if raw is None or not raw.strip():
            return default
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not value >= 0:  # also NaN
            raise ValueError(f"{name}={raw!r} is not a number of seconds: set it to 0 or more "
                             f"(inf waits for ever), or unset it for the default, {default:g}")
        return value

    return read


@functools.cache
def _aot_supported() -> bool:
    """Probed once: torch.compiler.load_compiled_function, and the Dynamo flag that gives
    torch.compile(...) its .aot_compile (the wrapper turns it on)."""
    import torch

    return hasattr(torch.compiler, "load_compiled_function") and hasattr(torch._dynamo.config,
                                                                         "enable_aot_compile")


@functools.cache
def _torch_at_least(major: int, minor: int) -> bool:
    """torch's release is at least major.minor (a 2.12 nightly counts, as vLLM's "2.12.0.dev")."""
    import torch

    return tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (major, minor)


def _device() -> str:
    raw = os.environ.get("MINIVLLM_DEVICE", "").strip().lower()
    if raw not in ("", "cpu", "cuda"):
        raise ValueError(f"MINIVLLM_DEVICE={os.environ['MINIVLLM_DEVICE']!r} is not a "
                         "device: set it to cpu or cuda (or unset it: the GPU when "
                         "torch sees one, else the CPU)")
    return raw


def _cache_root() -> str:
    raw = os.environ.get("VLLM_CACHE_ROOT")
    if raw is not None and not raw.strip():
        # vLLM would take "" as the current directory and fill it with cache folders
        raise ValueError("VLLM_CACHE_ROOT is set but empty: give it a folder, or unset it for the "
                         "default (~/.cache/minivllm_compile)")
    return os.path.expanduser(raw or str(Path("~/.cache/minivllm_compile")))


def _logging_level() -> str:
    raw = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").strip().upper()
    if raw not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise ValueError(f"VLLM_LOGGING_LEVEL={os.environ['VLLM_LOGGING_LEVEL']!r} is not a level: "
                         "set it to DEBUG, INFO, WARNING, ERROR or CRITICAL (or unset it for INFO)")
    return raw


environment_variables: dict[str, Callable[[], Any]] = {
    # dispatch to Dynamo's transformed bytecode directly, skipping Dynamo after the first call
    "VLLM_USE_BYTECODE_HOOK": _bool("VLLM_USE_BYTECODE_HOOK", True),
    # AOT-compile the whole forward, save it, and load it in later processes. Default as vLLM's
    # use_aot_compile(): on where torch has it, unless VLLM_DISABLE_COMPILE_CACHE is set (then the
    # model runs the JIT path: Dynamo's code, called through the bytecode hook)
    "VLLM_USE_AOT_COMPILE": lambda: _bool("VLLM_USE_AOT_COMPILE", _aot_supported()
                                          and not _bool("VLLM_DISABLE_COMPILE_CACHE", False)())(),
    "VLLM_FORCE_AOT_LOAD": _bool("VLLM_FORCE_AOT_LOAD", False),
    # the pieces' compiled artifacts inside the AOT file itself, loaded without running the backend.
    # Default as vLLM's use_mega_aot_artifact(): on for torch >= 2.12 when AOT compile is on
    "VLLM_USE_MEGA_AOT_ARTIFACT": lambda: _bool(
        "VLLM_USE_MEGA_AOT_ARTIFACT",
        _torch_at_least(2, 12) and environment_variables["VLLM_USE_AOT_COMPILE"]())(),
    "VLLM_DISABLE_COMPILE_CACHE": _bool("VLLM_DISABLE_COMPILE_CACHE", False),
    # pieces through torch._inductor.standalone_compile (1) or compile_fx (0), as in vLLM
    "VLLM_USE_STANDALONE_COMPILE": _bool("VLLM_USE_STANDALONE_COMPILE", True),
    # never vLLM's own cache: ~/.cache/minivllm_compile unless set
    "VLLM_CACHE_ROOT": _cache_root,
    # this project's own switch (vLLM picks its platform instead): where the tour, the benchmark
    # and the notebooks put their models; "" means the GPU when torch sees one, else the CPU
    "MINIVLLM_DEVICE": _device,
    # vLLM's logging switches: the package's logger gets its own handlers at this level (logger.py)
    "VLLM_CONFIGURE_LOGGING": _bool("VLLM_CONFIGURE_LOGGING", True),
    "VLLM_LOGGING_LEVEL": _logging_level,
    # this project's own switch (vLLM has no compile-cache lock): how long a compile waits for the
    # cache lock another process holds before giving up (cache_files.locked); torch's default
    # for its own file locks (TORCHINDUCTOR_FILE_LOCK_TIMEOUT)
    "MINIVLLM_CACHE_LOCK_TIMEOUT_S": _seconds("MINIVLLM_CACHE_LOCK_TIMEOUT_S", 600.0),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)


@contextlib.contextmanager
def override(**values: str | None) -> Iterator[None]:
    """Set (a str) or unset (None) environment switches for a block, and put every one back after
    it. Enough for any switch here, since each is read at every access (the benchmark and the
    exercises' graders use it; a grader must leave a notebook's process as it found it)."""
    def put(switches: dict[str, str | None]) -> None:
        for k, v in switches.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    saved = {k: os.environ.get(k) for k in values}
    try:
        put(values)
        yield
    finally:
        put(saved)


def default_device() -> str:
    """Where the tour, the benchmark and the notebooks put their models: MINIVLLM_DEVICE when set
    (cpu or cuda), else the GPU when torch sees one, else the CPU. (`load_model`/`build_model`
    keep torch's own default, the CPU, unless given `device=`.) It imports no kernel module, so a
    notebook can call it before choosing TRITON_INTERPRET."""
    import torch

    wanted = _device()
    if wanted == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("MINIVLLM_DEVICE=cuda but torch sees no GPU (torch.cuda.is_available() "
                           "is False): unset it, or set it to cpu")
    return wanted or ("cuda" if torch.cuda.is_available() else "cpu")


# the switches left out of the compile cache's key: each changes where things go or what is
# logged, never the compiled code (compile_factors hashes every other switch above)
IGNORED_FACTORS = frozenset({
    "VLLM_CACHE_ROOT",  # where the cache is (vLLM ignores it too)
    "VLLM_FORCE_AOT_LOAD",  # whether a missing artifact is an error (vLLM ignores it too)
    "VLLM_LOGGING_LEVEL",  # what is logged (vLLM ignores it too)
    # where log lines go: vLLM's list leaves it out (it hashes it), but it changes nothing compiled
    # either, as its other logging switches, which vLLM does ignore
    "VLLM_CONFIGURE_LOGGING",
    "MINIVLLM_CACHE_LOCK_TIMEOUT_S",  # how long a compile waits for another process's lock
})


def compile_factors() -> dict[str, Any]:
    """The switches in the compile cache's key, as vLLM 0.34's envs.compile_factors(): every known
    switch (environment_variables) but IGNORED_FACTORS, by its parsed value (its default when
    unset): a bool, a str or a number, plain JSON (vLLM passes each through normalize_value).
    vLLM logs and skips a switch whose value does not parse; here that is the switch's own error,
    as at every other read of it."""
    unknown = IGNORED_FACTORS - environment_variables.keys()
    assert not unknown, f"IGNORED_FACTORS names no switch: {sorted(unknown)}"
    return {name: read() for name, read in environment_variables.items()
            if name not in IGNORED_FACTORS}
