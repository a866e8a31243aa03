#!/usr/bin/env python3
"""The project's two commands. Each installs whatever is missing, then runs its job:

    python3 run.py tour     the tour: the trained model generates text, every kernel is checked
    python3 run.py test     the whole test suite, notebooks included (what CI runs)
    python3 run.py test --quick
                            the quick tier: every test that compiles nothing, no notebooks (an
                            install check, or a check before a workshop: about a minute or two)

Where no torch is installed: MINIVLLM_TORCH_SPEC chooses the build (default torch==2.13.0), and
MINIVLLM_TORCH_INDEX_URL the index it comes from, e.g. https://download.pytorch.org/whl/cpu for
the CPU build (PyPI's default torch on Linux is the CUDA build, several GB).

The whole suite runs on pytest-xdist, a worker per core up to 4, each with one torch thread
(MINIVLLM_TEST_WORKERS=1 runs it in one process; OMP_NUM_THREADS, if set, is kept).

Outside a virtual environment they make one in .venv (seeing the system's packages, so a torch
already installed is reused) and re-run themselves inside it. Only the standard library is used
until the environment is ready.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
# With no torch at all, take the release this project is tested on; a CPU build of it lies on the
# project's machines. Override with MINIVLLM_TORCH_SPEC (for instance to a CUDA build's pin), and
# with MINIVLLM_TORCH_INDEX_URL the index torch comes from (https://download.pytorch.org/whl/cpu:
# the CPU build, where PyPI's default on Linux is the CUDA one, several GB).
TORCH_SPEC = os.environ.get("MINIVLLM_TORCH_SPEC", "torch==2.13.0")
# Each torch build pins the triton it was built with (read from the CUDA wheels' metadata): by
# release where a patch release moved it, else by minor version.
TRITON_FOR_TORCH = {"2.11": "3.6.0", "2.12.0": "3.7.0", "2.12": "3.7.1", "2.13": "3.7.1",
                    "2.14": "3.8.0"}


def sh(*cmd: str) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)


def in_virtualenv() -> bool:
    return sys.prefix != sys.base_prefix or "CONDA_PREFIX" in os.environ


def ensure_venv() -> None:
    if in_virtualenv():
        return
    python = VENV / "bin" / "python"
    if not python.exists():
        sh(sys.executable, "-m", "venv", "--system-site-packages", str(VENV))
    os.execv(str(python), [str(python), str(Path(__file__).resolve()), *sys.argv[1:]])


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def setuptools_version() -> tuple[int, ...]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return tuple(int(p) for p in version("setuptools").split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return (0,)


def pip(*args: str) -> None:
    sh(sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *args)


def torch_pip_args() -> list[str]:
    """What `pip install` gets for torch: the spec, and the index URL when one is set. The URL
    applies to this one install (torch's own dependencies are on that index too); triton and the
    package's dependencies still come from the default index."""
    spec = os.environ.get("MINIVLLM_TORCH_SPEC", TORCH_SPEC)
    index_url = os.environ.get("MINIVLLM_TORCH_INDEX_URL", "").strip()
    return [spec, "--index-url", index_url] if index_url else [spec]


def ensure_installed() -> None:
    if not has("torch"):
        pip(*torch_pip_args())
    if platform.system() == "Linux" and not has("triton"):
        release = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.__version__.split('+')[0])"],
            check=True, capture_output=True, text=True).stdout.strip()
        pin = TRITON_FOR_TORCH.get(release) or TRITON_FOR_TORCH.get(
            ".".join(release.split(".")[:2]))
        pip(f"triton=={pin}" if pin else "triton")
    # the package itself (editable) with its test and notebook extras, once per pyproject.toml: pip
    # takes about 8 s to find it has nothing to do (setuptools 70.1+ builds wheels itself: then no
    # isolated build env, no download needed)
    stamp = install_stamp()
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if stamp.is_file() and stamp.read_text() == want and has("minivllm_compile"):
        return
    build = ["--no-build-isolation"] if setuptools_version() >= (70, 1) else []
    pip(*build, "-e", f"{ROOT}[test,notebooks]")
    stamp.write_text(want)


def install_stamp() -> Path:
    """Where this environment records which pyproject.toml of this checkout it installed."""
    checkout = hashlib.sha256(str(ROOT).encode()).hexdigest()[:12]
    return Path(sys.prefix) / f".minivllm_compile_installed_{checkout}"


def main() -> int:
    jobs = {"tour": [sys.executable, "-m", "minivllm_compile.tour"],
            "test": [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--nbval-lax",
                     "--nbval-current-env", "--nbval-sanitize-with", "notebooks/sanitize.cfg",
                     "tests", "notebooks"]}
    if len(sys.argv) < 2 or sys.argv[1] not in jobs:
        print(__doc__)
        return 2
    ensure_venv()
    ensure_installed()
    args = sys.argv[2:]
    env = dict(os.environ)
    if sys.argv[1] == "test" and "--quick" in args:  # tests/conftest.py: what the tier leaves out
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "tests", *args]
    elif sys.argv[1] == "test":
        cmd = jobs["test"] + test_workers() + args
        # one torch thread per worker: the workers already fill the cores, and torch's threads
        # waiting for each other on a busy core cost more than they gain on these tiny models
        env.setdefault("OMP_NUM_THREADS", "1")
    else:
        cmd = jobs[sys.argv[1]] + args
    print("+", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def test_workers() -> list[str]:
    """pytest-xdist's options: a worker per core, up to 4 (each compiles with gcc and holds a few
    hundred MB), every test file and notebook whole in one worker (their module-scoped compiled
    fixtures are shared by the file's tests), handed out in the order tests/conftest.py puts them
    (the costliest first; xdist's own reorder, by number of tests, is off).
    MINIVLLM_TEST_WORKERS=1 runs in this process."""
    given = os.environ.get("MINIVLLM_TEST_WORKERS", "")
    if given and not (given.isdigit() and int(given) >= 1):
        raise SystemExit(f"MINIVLLM_TEST_WORKERS must be a whole number of workers, 1 or more "
                         f"(1: no workers, the tests run in pytest's own process); got {given!r}")
    n = int(given) if given else min(4, os.cpu_count() or 1)
    return ["-n", str(n), "--dist", "loadfile", "--no-loadscope-reorder"] if n > 1 else []


if __name__ == "__main__":
    sys.exit(main())
