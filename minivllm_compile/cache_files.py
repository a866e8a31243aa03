"""The compile cache's files: where they live, how they are hashed, and how they are written.

The bottom of the cache: it imports nothing of the compiler, so the ISA record (cpu_isa.py), the
keys and artifacts (caching.py) and the backend above them can all use it without a circle.

Every write goes to a temporary file renamed into place, under a lock, so a reader or a second
writer never sees half a file. Files get the permissions an ordinary `open()` would give them
(0666 less the umask), as torch's and vLLM's own cache writes do: another user who shares the
cache can read them (with umask 002, also replace them), where a private 0600 file would make
every start of theirs recompile.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path
from typing import Iterator

from minivllm_compile import envs


def cache_root() -> Path:
    return Path(envs.VLLM_CACHE_ROOT) / "torch_compile_cache"


def sha(text: str, n: int = 10) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


# What is not the compiler, by the first part of its path in the package: the notebooks' views and
# exercises, the models (what a trace reads of them, Dynamo's traced files key by content), and the
# measuring tools. An edit there keeps every user's compile cache; an edit anywhere else is a new
# compiler and compiles afresh. A display-only helper belongs in one of these, never in a module of
# the compiler.
NOT_COMPILER = frozenset({"viz", "exercises", "models", "bench.py", "bench_cudagraph.py",
                          "bench_plots.py", "startup.py", "tour.py"})


def compiler_files(package: Path) -> list[Path]:
    """The package's modules that make up the compiler: every .py file but NOT_COMPILER's."""
    return [p for p in sorted(package.rglob("*.py"))
            if p.relative_to(package).parts[0] not in NOT_COMPILER]


def source_hash(files: list[Path], root: Path) -> str:
    return sha("".join(f"{p.relative_to(root)}\n{p.read_text()}" for p in files), 16)


@functools.cache
def compiler_source_hash() -> str:
    """The source of every module of this package that takes part in compiling (vLLM keys on its
    release for this): an edited pass, backend or adaptor must not load what the old one built."""
    package = Path(__file__).resolve().parent
    # shipped as minivllm_compile.kernels from the repository's kernels/ (an editable install keeps
    # it there): find it without importing it
    kernels = Path(importlib.util.find_spec("minivllm_compile.kernels").submodule_search_locations[0]).resolve()
    h = source_hash(compiler_files(package), package)
    if kernels != package / "kernels":
        h = sha(h + source_hash(sorted(kernels.glob("*.py")), kernels), 16)
    return h


def file_hash(path: str) -> str:
    """The file's path and content (a missing file hashes by its path alone)."""
    h = hashlib.sha256(path.encode())
    with contextlib.suppress(OSError), open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()[:16]


@functools.cache
def _umask() -> int:
    mask = os.umask(0)  # the only way to read it is to set it: put it straight back
    os.umask(mask)
    return mask


def file_mode() -> int:
    """What open() gives a new file in this process."""
    return 0o666 & ~_umask()


@contextlib.contextmanager
def locked(directory: Path) -> Iterator[None]:
    """An exclusive lock on `directory` (two processes compiling the same model save one at a time).
    The lock file is opened read-only: flock needs no write access, so a user who may only read a
    shared cache can still take it."""
    directory.mkdir(parents=True, exist_ok=True)
    fd = os.open(directory / ".lock", os.O_RDONLY | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def atomic_write(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fchmod(f.fileno(), file_mode())  # mkstemp makes it 0600
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def portable_path(path: str | Path) -> str:
    """How an artifact's location is saved: relative to the cache root when it lies inside it, so
    a cache moved or copied elsewhere (VLLM_CACHE_ROOT pointing at the new place) still loads."""
    with contextlib.suppress(ValueError):
        return str(Path(path).resolve().relative_to(cache_root().resolve()))
    return str(path)  # a CompilationConfig.cache_dir outside the root: kept absolute


def resolve_path(saved: str) -> Path:
    path = Path(saved)
    return path if path.is_absolute() else cache_root() / path
