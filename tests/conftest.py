import os
import sys
import tempfile

# `python -m pytest` in the repository puts its root first on sys.path, where `kernels/` (installed
# as minivllm_compile.kernels) would stand in for Hugging Face's `kernels` package, which
# transformers imports from 5.25 on: the package is installed (editable), so the root goes
_ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
sys.path[:] = [p for p in sys.path if os.path.realpath(p or os.curdir) != _ROOT]

# Triton reads this when a kernel is decorated, so it must be set before any kernel module is
# imported: the Triton kernels then run on the CPU through Triton's interpreter.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Tests count compilations: a warm compile cache from an earlier run would change the counts. The
# cache tests (test_caching.py) turn it back on, each in a fresh directory.
os.environ.setdefault("VLLM_CACHE_ROOT", tempfile.mkdtemp(prefix="minivllm_test_cache_"))
os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
# Inductor's own FX-graph cache (/tmp/torchinductor_<user> by default) outlives a run too, and a hit
# skips the post-grad passes: a pass compiled by an earlier run (a notebook, say) would then never
# run here and report nothing. One fresh directory per run; the notebook kernels inherit it.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="minivllm_test_inductor_"))

# The notebooks run as a student first meets them: each exercise cell is its starter, and check()
# prints "not attempted" without grading anything. tests/teaching/test_exercises*.py grade every
# reference solution (and a wrong answer), once per run; MINIVLLM_SOLUTIONS=1 here would grade
# each a second time inside the notebooks, for nothing nbval compares.
os.environ.pop("MINIVLLM_SOLUTIONS", None)

import logging  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402  (after the environment above, which must come first)


@pytest.fixture
def compile_every_time(monkeypatch):
    """For the pass tests: nothing loaded from the compile cache, so every entry compiles and its
    post-grad passes run (their configs also turn the FX graph cache off). With that cache off,
    standalone_compile warns that it has no artifact to save: expected, so quieted here."""
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    logger = logging.getLogger("torch._inductor.standalone_compile")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """Where the Triton kernel tests run: the GPU when there is one and Triton is not in its
    interpreter (scripts/gpu_check.sh exports TRITON_INTERPRET=0), else the CPU, interpreted."""
    import torch

    from minivllm_compile.kernels._compat import triton_interpret_enabled

    return "cuda" if torch.cuda.is_available() and not triton_interpret_enabled() else "cpu"


@pytest.fixture(scope="session")
def seed_isa_record():
    """seed_isa_record(cache_root) writes this machine's ISA record
    (minivllm_compile/compilation/cpu_isa.py) into a fresh VLLM_CACHE_ROOT, as a first compile
    there would: the test's first compiling process then replays it instead of running Inductor's
    ISA probe (a C++ build and a dlopen in a child Python per ISA, 10-20 s on a busy 2-core machine
    with a fresh Inductor cache). For the tests of the cache's other factors; the probe's own tests
    (test_caching.py) leave it out. Inductor probes here once per worker; cpu_isa.remember stores
    its answer."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    from minivllm_compile import envs
    from minivllm_compile.compilation import cpu_isa

    valid_vec_isa_list()  # the probe, where Inductor runs one (remember is a no-op elsewhere)

    def seed(cache_root) -> None:
        with envs.override(VLLM_CACHE_ROOT=str(cache_root), VLLM_DISABLE_COMPILE_CACHE="0"):
            cpu_isa.remember()

    return seed


# --- the quick tier: `python3 run.py test --quick` --------------------------------------------
# Every test that compiles nothing (and no fresh process that does) runs in the quick tier; a test
# that compiles carries @pytest.mark.compiles (or its module's pytestmark) and runs in the whole
# suite only. The tier keeps itself honest: under --quick a test that makes Dynamo trace a frame or
# Inductor lower a graph fails, naming the marker it lacks.


def pytest_addoption(parser):
    parser.addoption("--quick", action="store_true",
                     help="the quick tier: only the tests that compile nothing (no notebooks)")
    parser.addoption("--record-compiles", metavar="FILE", default=None,
                     help="append the id of every test that compiles or starts a process to FILE "
                          "(for marking the tests @pytest.mark.compiles)")


def pytest_configure(config):
    config.addinivalue_line("markers", "compiles: the test compiles a model (Dynamo, Inductor, or "
                            "a fresh process that does): left out of the quick tier")


# The whole suite hands each xdist worker a file at a time (run.py), in collection order: the
# costliest files go first, so that no worker is left running a long one at the end while the
# other idles (longest first). Seconds each took in a whole run (two workers, pytest's
# --durations=0 summed by file); a file not listed took under 30 s and keeps its place. Only the
# order depends on these figures, never a result.
COST_S = {
    "tests/compilation/test_cache_keys.py": 260,
    "tests/compilation/passes/test_quant_fusion.py": 197,
    "notebooks/09_aot_and_cache.ipynb": 144, "tests/compilation/test_aot_paths.py": 124,
    "tests/teaching/test_browser_check.py": 123, "tests/compilation/test_caching.py": 119,
    "notebooks/16_tensor_parallel.ipynb": 87, "notebooks/12_capstone.ipynb": 85,
    "tests/compilation/test_cache_integrity.py": 84, "tests/teaching/test_exercises.py": 76,
    "notebooks/13_fusion_passes.ipynb": 71, "tests/compilation/test_ir_cache_keys.py": 68,
    "tests/compilation/test_cache_traced_state.py": 59, "tests/compilation/test_cuda_graph.py": 54,
    "tests/distributed/test_tp_start.py": 45, "tests/distributed/test_launch.py": 44,
    "tests/bench/test_bench.py": 41, "tests/distributed/test_tp_compile.py": 40,
    "tests/compilation/passes/test_qk_norm_rope_fusion.py": 39, "tests/teaching/test_tour.py": 35,
    "notebooks/15_vllm_ir.ipynb": 35, "tests/models/test_fp8.py": 34,
}


def _costliest_first(items: list) -> None:
    def cost(item) -> float:
        path = Path(str(item.path)).resolve()
        return COST_S.get(path.relative_to(_ROOT).as_posix() if path.is_relative_to(_ROOT) else "",
                          0.0)

    items.sort(key=lambda item: -cost(item))  # stable: a file's items keep their order


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--quick"):
        _costliest_first(items)
        return
    keep, drop = [], []
    for item in items:
        slow = item.get_closest_marker("compiles") or str(item.path).endswith(".ipynb")
        (drop if slow else keep).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


_lowered = [0]  # Inductor graphs lowered in this process (GraphLowering objects made)


def _count_lowerings() -> None:
    from torch._inductor.graph import GraphLowering

    if getattr(GraphLowering.__init__, "_counted", False):
        return
    init = GraphLowering.__init__

    def counted(self, *args, **kwargs):
        _lowered[0] += 1
        init(self, *args, **kwargs)

    counted._counted = True
    GraphLowering.__init__ = counted


def _traced() -> int:
    """Frames Dynamo traced in this process: its own count, and this package's (the decorator's
    AOT compile traces without adding to Dynamo's "frames" counter)."""
    from torch._dynamo.utils import counters

    from minivllm_compile.compilation.counter import compilation_counter

    return counters["frames"]["total"] + compilation_counter.num_dynamo_traces


_spawned = [0]  # processes started in this process (subprocess.Popen objects made)


def _count_spawns() -> None:
    import subprocess

    if getattr(subprocess.Popen.__init__, "_counted", False):
        return
    init = subprocess.Popen.__init__

    def counted(self, *args, **kwargs):
        _spawned[0] += 1
        init(self, *args, **kwargs)

    counted._counted = True
    subprocess.Popen.__init__ = counted


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Counts what a test compiles or starts across its setup, call and teardown (a module-scoped
    fixture that compiles is counted for the test that set it up)."""
    config = item.config
    record = config.getoption("--record-compiles")
    if not (config.getoption("--quick") or record):
        yield
        return
    _count_lowerings()
    _count_spawns()
    frames, lowered, spawned = _traced(), _lowered[0], _spawned[0]
    yield
    traced, lowered = _traced() - frames, _lowered[0] - lowered
    spawned = _spawned[0] - spawned
    if record and (traced or lowered or spawned):
        with open(record, "a") as f:
            f.write(f"{item.nodeid}\t{traced}\t{lowered}\t{spawned}\n")


@pytest.fixture(autouse=True)
def _quick_tier_compiles_nothing(request):
    if not request.config.getoption("--quick"):
        yield
        return
    _count_lowerings()
    frames, lowered = _traced(), _lowered[0]
    yield
    traced, lowered = _traced() - frames, _lowered[0] - lowered
    if traced or lowered:
        pytest.fail(f"{request.node.nodeid} compiled ({traced} frames traced by Dynamo, {lowered} "
                    "graphs lowered by Inductor) in the quick tier: mark it @pytest.mark.compiles",
                    pytrace=False)
