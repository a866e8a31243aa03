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
import json
import logging
import os
import re
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from minivllm_compile import envs

logger = logging.getLogger("minivllm_compile")
LOCK_WARN_AFTER_S = 5.0  # a wait this long is logged once, naming the holder


def cache_root() -> Path:
    return Path(envs.VLLM_CACHE_ROOT) / "torch_compile_cache"


def rank_folder() -> str:
    """`rank_{rank}_{dp_rank}`, vLLM's folder of this process below a cache hash (backends.py,
    decorators.py): the rank is the process's rank in the world (vLLM's parallel_config.rank), 0
    in a single process; the data-parallel index is always 0 (no data parallelism here)."""
    from minivllm_compile.distributed import parallel_state

    world = parallel_state._WORLD
    return f"rank_{0 if world is None else world.rank}_0"


def sha(text: str, n: int = 10) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:n]


# What is the compiler, by folder: every module under these, and the package's root modules that
# one of them imports (envs.py, ops.py, ...: found from the import statements, so a new module
# cannot be left out). Everything else (the views and exercises, the models, whose traced code
# Dynamo's traced files key by content, the benchmarks, the tour and the launcher) is the
# compiler's user: an edit there keeps every user's compile cache; an edit in the compiler is a new
# compiler and compiles afresh. A display-only helper belongs outside these folders.
PACKAGE = Path(__file__).resolve().parents[1]  # minivllm_compile/, above this compilation/
COMPILER_FOLDERS = ("config", "compilation", "ir", "distributed",
                    # the Triton kernels the custom ops and IR providers run, where an install
                    # puts them (an editable one keeps them in the repository: compiler_source_hash)
                    "kernels")
# what a module imports of the package: `from minivllm_compile[.X] import a, b` (over lines
# too, in parentheses) and `import minivllm_compile.X`
_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+minivllm_compile(?:\.(\w+))?[ \t]+import[ \t]+"
                     r"(\([^)]*\)|[^\n]*)|import[ \t]+minivllm_compile\.(\w+))", re.M)


def package_imports(source: str) -> set[str]:
    """The first part below the package of every module a source imports (`envs` for
    `from minivllm_compile.envs import x` and for `from minivllm_compile import envs`): a name
    imported from the package itself counts as a module when a file of that name exists."""
    found = set()
    for sub, names, plain in _IMPORT.findall(source):
        if sub or plain:
            found.add(sub or plain)
        else:
            found |= {n.split(" as ")[0].strip() for n in
                      re.sub(r"#[^\n]*", "", names).strip("() \n").replace("\n", ",").split(",")}
    return found - {""}


def compiler_files(package: Path) -> list[Path]:
    """The package's modules that make up the compiler: everything under COMPILER_FOLDERS, the
    package's __init__ (run by every import of it), and each root module one of those imports,
    followed through the root modules' own imports."""
    files = [p for p in sorted(package.rglob("*.py"))
             if p.relative_to(package).parts[0] in COMPILER_FOLDERS]
    root = {p.stem: p for p in package.glob("*.py")}
    todo, seen = [*files, root["__init__"]], {"__init__"}
    while todo:
        for name in package_imports(todo.pop().read_text()) & root.keys() - seen:
            seen.add(name)
            todo.append(root[name])
    return sorted(files + [root[n] for n in seen])


def source_hash(files: list[Path], root: Path) -> str:
    return sha("".join(f"{p.relative_to(root)}\n{p.read_text()}" for p in files), 16)


@functools.cache
def compiler_source_hash() -> str:
    """The source of every module of this package that takes part in compiling (vLLM keys on its
    release for this): an edited pass, backend or adaptor must not load what the old one built."""
    package = PACKAGE
    # shipped as minivllm_compile.kernels from the repository's kernels/ (an editable install keeps
    # it there): find it without importing it
    kernels = Path(importlib.util.find_spec(
        "minivllm_compile.kernels").submodule_search_locations[0]).resolve()
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


def path_sha256(path: Path) -> str | None:
    """The SHA-256 of a file, or of a folder's files (names and contents, in order); None if it
    cannot be read."""
    h = hashlib.sha256()
    try:
        if path.is_dir():
            for f in sorted(p for p in path.rglob("*") if p.is_file()):
                h.update(str(f.relative_to(path)).encode() + b"\0" + f.read_bytes())
        else:
            h.update(path.read_bytes())
    except OSError:
        return None
    return h.hexdigest()


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

    A wait is bounded: after a few seconds it is logged, naming the holder, and after
    MINIVLLM_CACHE_LOCK_TIMEOUT_S (this project's switch, vLLM has none; default 600 s, as torch's
    TORCHINDUCTOR_FILE_LOCK_TIMEOUT) it ends in a TimeoutError, an OSError: the savers then log it
    and go on without saving, as for a read-only cache. The holder writes who it is (pid,
    host, command) into the lock file. A user who may only read a shared cache cannot write that
    file, but can still take the lock: flock needs no write access, so the file is then opened
    read-only and the holder stays unnamed."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / ".lock"
    try:
        fd, writable = os.open(path, os.O_RDWR | os.O_CREAT, 0o666), True
    except PermissionError:
        fd, writable = os.open(path, os.O_RDONLY | os.O_CREAT, 0o666), False
    try:
        _acquire(fd, path)
        if writable:
            with contextlib.suppress(OSError):  # naming the holder is a courtesy, never an error
                record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(),
                          "command": " ".join(sys.argv)[:200]}
                os.ftruncate(fd, 0)
                os.pwrite(fd, json.dumps(record).encode(), 0)
        try:
            yield
        finally:
            if writable:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # closing releases the lock


def _acquire(fd: int, path: Path) -> None:
    timeout = envs.MINIVLLM_CACHE_LOCK_TIMEOUT_S
    start, delay, warned = time.monotonic(), 0.02, False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        waited = time.monotonic() - start
        if waited >= timeout:
            raise TimeoutError(
                f"gave up after {waited:.0f} s waiting for the compile cache lock {path}, held by "
                f"{lock_holder(path)}. If that process is stuck, end it; to wait longer, set "
                f"MINIVLLM_CACHE_LOCK_TIMEOUT_S (now {timeout:g}); to compile without the cache, "
                f"set VLLM_DISABLE_COMPILE_CACHE=1.")
        if not warned and waited >= min(LOCK_WARN_AFTER_S, timeout / 2):
            logger.warning("waiting for the compile cache lock %s, held by %s; giving up after "
                           "%g s (MINIVLLM_CACHE_LOCK_TIMEOUT_S)", path, lock_holder(path), timeout)
            warned = True
        time.sleep(min(delay, max(timeout - waited, 0.0)))
        delay = min(delay * 2, 0.5)


def lock_holder(path: Path) -> str:
    """Who holds the lock, as its holder recorded it in the lock file."""
    try:
        record = json.loads(path.read_text() or "null")
    except (OSError, ValueError):
        record = None
    if not isinstance(record, dict) or not isinstance(record.get("pid"), int):
        return "another process (it did not say which: the cache may be read-only to it)"
    pid, host = record["pid"], record.get("host")
    if host == socket.gethostname() and not _alive(pid):
        return f"another process (the last one recorded, pid {pid}, has exited)"
    since = record.get("since")
    when = (f" since {time.strftime('%H:%M:%S', time.localtime(since))}"
            if isinstance(since, (int, float)) else "")
    return f"pid {pid} on {host}{when} ({record.get('command') or 'no command recorded'})"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        pass
    return True


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
