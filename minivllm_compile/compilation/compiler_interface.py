"""The compilers a piece can go to (vLLM's compilation/compiler_interface.py).

InductorStandaloneAdaptor uses torch._inductor.standalone_compile: a size entry specialises on its
concrete example inputs ("from_example_inputs": a static kernel), a range entry keeps the graph's
symbols ("from_graph": a kernel taking num_tokens as a runtime argument). What it keeps depends on
the AOT switches, as in vLLM 0.34 (InductorStandaloneAdaptor.compile and initialize_cache):

    AOT on, mega artifact     compiled with aot=True: the artifact's bytes go into the AOT file
                              (caching.py); nothing is saved here, no handle. (Inductor's own
                              cache stays where it was, where vLLM's decorators.py points it into
                              torch_aot_compile/<hash>/inductor_cache: a row of the differences
                              table in notebooks/README.md)
    AOT on, no mega artifact  each artifact saved as
                              <cache dir>/artifact_compile_range_<s>_<e>_subgraph_<i>; its handle
                              goes into the CompilerManager's index, and `load` reads it back
    AOT off                   nothing saved, no handle: Inductor's and Triton's own caches are moved
                              into the compile cache (initialize_inductor_cache), so a second
                              process traces again and every compile is a hit there

InductorAdaptor goes
through compile_fx; outside Dynamo there is no ShapeEnv to check the FX graph cache's guards
against, so it answers them with AlwaysHitShapeEnv, as vLLM does; what it compiles lives in
Inductor's own FX graph cache, which initialize_cache moves into the compile cache's directory.
EagerAdaptor runs the graph.

Each adaptor says what of its own goes into the compile cache's key (`compile_factors(config)`, the
key's `compiler`, vLLM 0.34's): the Inductor adaptors `{"inductor": get_inductor_factors()}`, the
eager one nothing. A subclass that still defines the older `compute_hash` is refused when the class
is created, as vLLM's `CompilerInterface.__init_subclass__` refuses it: nothing would call it, and
its factors would silently be left out of the key.
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable
from unittest.mock import patch

import torch
import torch.fx as fx

from minivllm_compile.compilation import cpu_isa
from minivllm_compile.compilation.cache_files import locked, portable_path
from minivllm_compile.compilation.counter import compilation_counter
from minivllm_compile.config import CompilationConfig, CompileFactors, Range, normalize_value

logger = logging.getLogger("minivllm_compile")


@dataclass
class CompiledEntry:
    """What one compilation produced, kept for inspection."""

    runnable: Callable
    compile_range: Range
    graph_index: int
    seconds: float = 0.0
    code: list[str] = field(default_factory=list)  # Inductor's generated source (wrapper + kernels)
    reused_from: int | None = None  # set when an identical earlier piece's artifact was reused
    artifact_path: str | None = None  # where the artifact was saved (None: cache off, or eager)
    handle: tuple[str, str] | None = None  # the adaptor's (key, path), what the index keeps
    loaded: bool = False  # read back from the cache (CompilerManager.load), not compiled


@contextmanager
def capture_output_code(sink: list[str]):
    """Collect the source Inductor generates (also on an FX-graph-cache hit)."""
    from torch._inductor.graph import GraphLowering

    with patch.object(GraphLowering, "save_output_code", staticmethod(sink.append)):
        yield


# the Triton cache folder the last call below chose itself: a later model's own default, where any
# other TRITON_CACHE_DIR is the caller's and stays (vLLM's _last_inductor_triton_cache_dir)
_last_inductor_triton_cache_dir: str | None = None


def initialize_inductor_cache(base_cache_dir: str) -> None:
    """Point Inductor's FX graph / AOTAutograd cache and Triton's kernel cache (both under /tmp by
    default) into the rank's cache directory, beside the prefix folders and shared by them: copying
    the compile cache to another machine then carries the kernels. A TRITON_CACHE_DIR the caller
    set is kept, as vLLM 0.34 keeps it. Process-wide, as in vLLM: these are environment variables
    Inductor and Triton read on every lookup."""
    global _last_inductor_triton_cache_dir
    if any(c.isspace() for c in base_cache_dir):
        _warn_cache_dir_with_space(base_cache_dir)
        return
    inductor_cache = os.path.join(base_cache_dir, "inductor_cache")
    os.makedirs(inductor_cache, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache
    triton_cache = os.environ.get("TRITON_CACHE_DIR")
    if triton_cache is None or triton_cache == _last_inductor_triton_cache_dir:
        triton_cache = _last_inductor_triton_cache_dir = os.path.join(base_cache_dir,
                                                                      "triton_cache")
    os.makedirs(triton_cache, exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = triton_cache


@functools.cache  # once per folder and process
def _warn_cache_dir_with_space(base_cache_dir: str) -> None:
    """Inductor builds its C++ compile command by joining paths with spaces, unquoted: a kernel
    under a path with a space fails to compile (CppCompileError). vLLM moves the caches anyway."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    logger.warning("the compile cache's folder %r has a space in its path, which Inductor's "
                   "C++ compile command cannot take: Inductor's own cache stays in %s (and "
                   "Triton's where it is). Choose a VLLM_CACHE_ROOT without spaces to keep "
                   "them in the compile cache.",
                   base_cache_dir, cache_dir())


def _base_cache_dir(cache_dir: str, prefix: str) -> str:
    """`<root>/<hash>/rank_{r}_{dp}/<prefix>` -> `<root>/<hash>/rank_{r}_{dp}`."""
    return cache_dir[: -len(prefix)] if prefix and cache_dir.endswith(prefix) else cache_dir


# the functorch settings torch's own aot_compile patches around the backend it calls
# (torch/_dynamo/aot_compile.py): they read one way when the key is computed inside it (the backend
# key of an AOT compile) and another outside it (the AOT key; a non-mega load's backend run), and
# govern AOTAutograd's cache, not the code. vLLM pins bundled_autograd_cache instead
# (_get_vllm_functorch_config); here the five are left out.
_AOT_COMPILE_FUNCTORCH_PATCHES = frozenset({
    "strict_autograd_cache", "bypass_autograd_cache_key", "bundled_autograd_cache",
    "force_non_lazy_backward_lowering", "force_autograd_cache"})


def get_inductor_factors() -> CompileFactors:
    """What of Inductor's own state changes the code it generates (vLLM's get_inductor_factors),
    each by name where vLLM lists them in order: `torch_key`, the hash of torch's source
    (torch._inductor.codecache.torch_key; `torch_version` beside it, the release to read),
    `inductor_config` and `functorch_config`, every portable setting of this process
    (torch._inductor.config and torch._functorch.config: the settings themselves, so that two keys
    diff setting by setting; not the functorch settings torch's aot_compile patches while it
    runs, _AOT_COMPILE_FUNCTORCH_PATCHES), and `system` (CacheBase.get_system(): the GPU and the
    CUDA and Triton versions) where torch sees a GPU. On a CPU, get_system() names no device and
    returns a constant, after hashing Triton's source for about half a second, a fifth of a warm
    start here: it is left out there."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.codecache import CacheBase, torch_key

    def portable(config: Any) -> dict[str, Any]:
        if hasattr(config, "save_config_portable"):
            return config.save_config_portable()
        return {k: v for k, v in config.get_config_copy().items() if not callable(v)}

    functorch = {k: v for k, v in portable(functorch_config).items()
                 if k not in _AOT_COMPILE_FUNCTORCH_PATCHES}
    factors: dict[str, Any] = {"torch_version": torch.__version__, "torch_key": torch_key(),
                               "inductor_config": portable(inductor_config),
                               "functorch_config": functorch}
    if torch.cuda.is_available():
        factors["system"] = CacheBase.get_system()
    return normalize_value(factors)


class CompilerInterface:
    name = "base"
    cache_dir: str | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "compute_hash" in cls.__dict__:  # vLLM's check and message
            raise TypeError(f"{cls.__qualname__} defines `compute_hash`, which is no longer "
                            "called. Implement `compile_factors` instead.")

    def compile_factors(self, config: CompilationConfig) -> CompileFactors:
        """What of this compiler's own goes into the compile cache's key (the key's `compiler`;
        cache_keys.py has the rest). None here."""
        return {}

    def initialize_cache(self, cache_dir: str, disable_cache: bool = False,
                         prefix: str = "") -> None:
        """Told where this model's compile cache is (`<root>/<hash>/rank_{r}_{dp}/<prefix>`) before
        the first compile; a compiler with a cache of its own may move it there."""
        self.cache_dir = cache_dir

    def compile(self, graph: fx.GraphModule, example_inputs: list, config: dict,
                compile_range: Range,
                key: str | None = None) -> tuple[Callable, tuple[str, str] | None]:
        """The compiled graph, and a handle to find it again in a later
        process (None: no handle)."""
        raise NotImplementedError

    def load(self, handle: tuple[str, str], graph: fx.GraphModule, example_inputs: list,
             graph_index: int, compile_range: Range) -> Callable:
        raise NotImplementedError(f"the {self.name} adaptor keeps nothing to load")


class EagerAdaptor(CompilerInterface):
    name = "eager"

    def compile(self, graph, example_inputs, config, compile_range, key=None):
        compilation_counter.num_eager_compiles += 1
        return graph, None


class InductorStandaloneAdaptor(CompilerInterface):
    name = "inductor_standalone"

    def __init__(self, save_format: str = "binary", *, use_aot_compile: bool = False):
        self.save_format = save_format
        self.use_aot_compile = use_aot_compile
        self.disable_cache = True

    def compile_factors(self, config: CompilationConfig) -> CompileFactors:
        return {"inductor": get_inductor_factors()}

    def initialize_cache(self, cache_dir: str, disable_cache: bool = False,
                         prefix: str = "") -> None:
        """As vLLM's: with AOT compile off no artifact of ours is kept, so Inductor's own caches are
        what a later process finds: they move into the rank's directory."""
        super().initialize_cache(cache_dir, disable_cache, prefix)
        self.disable_cache = disable_cache
        if not self.use_aot_compile and not disable_cache:
            initialize_inductor_cache(_base_cache_dir(cache_dir, prefix))

    def use_mega_artifact(self) -> bool:
        from minivllm_compile import envs

        return self.use_aot_compile and envs.VLLM_USE_MEGA_AOT_ARTIFACT

    def compile(self, graph, example_inputs, config, compile_range, key=None):
        compilation_counter.num_inductor_compiles += 1
        dynamic = "from_example_inputs" if compile_range.is_single_size() else "from_graph"
        mega = self.use_mega_artifact()
        # aot=True: one bundled, self-contained callable whose bytes the AOT file can hold
        artifact = torch._inductor.standalone_compile(
            graph, example_inputs, dynamic_shapes=dynamic, options={"config_patches": config},
            aot=mega)
        if not self.use_aot_compile or mega or self.disable_cache or key is None:
            return artifact, None
        return artifact, self._save(artifact, key)

    def _save(self, artifact: Any, key: str) -> tuple[str, str] | None:
        """Saved under `key` in this prefix's folder; the handle keeps the key (how `load` finds it,
        relative to the cache dir, so a moved cache still loads) and where it went."""
        from pathlib import Path

        path = Path(self.cache_dir) / key
        try:
            with locked(path.parent):  # two processes compiling the same model: one at a time
                save_artifact(artifact, path, self.save_format)
        except OSError as e:  # read-only or full disk: keep going in memory
            logger.warning("cannot save compiled artifacts to %s (%s); continuing in memory",
                           self.cache_dir, e)
            self.disable_cache = True
            return None
        compilation_counter.num_compiled_artifacts_saved += 1
        return key, portable_path(path)

    def load(self, handle, graph, example_inputs, graph_index, compile_range):
        from pathlib import Path

        key, _ = handle
        runnable = load_artifact(Path(self.cache_dir) / key, self.save_format)
        compilation_counter.num_compiled_artifacts_loaded += 1
        # a loaded artifact returns a list even for a graph returning one value
        return first_output(runnable) if returns_single_value(graph) else runnable


def save_artifact(artifact: Any, path, fmt: str) -> None:
    """CompiledArtifact.save into a temporary name, then renamed: never a half-written artifact."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    artifact.save(path=str(tmp), format=fmt)
    if path.is_dir():
        import shutil

        shutil.rmtree(path)
    os.replace(tmp, path)


def load_artifact(path, fmt: str) -> Any:
    from torch._inductor import CompiledArtifact

    return CompiledArtifact.load(path=str(path), format=fmt)


class AlwaysHitShapeEnv:
    """Stands in for Dynamo's ShapeEnv when the FX graph cache checks a cached entry's guards:
    vLLM dropped every guard already, so every entry with the right key is a hit."""

    def __init__(self) -> None:
        self.guards: list[Any] = []
        # torch 2.13's FX graph cache key reads this (hint overrides of unbacked symbols): none here
        self.var_to_hint_override: dict[Any, int] = {}

    def evaluate_guards_expression(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def get_pruned_guards(self, *args: Any, **kwargs: Any) -> list[Any]:
        return []

    def produce_guards_expression(self, *args: Any, **kwargs: Any) -> str:
        return ""


class InductorAdaptor(CompilerInterface):
    name = "inductor"

    def compile_factors(self, config: CompilationConfig) -> CompileFactors:
        return {"inductor": get_inductor_factors()}

    def initialize_cache(self, cache_dir: str, disable_cache: bool = False,
                         prefix: str = "") -> None:
        """As vLLM's InductorAdaptor: compile_fx keeps its graphs in Inductor's FX graph cache and
        Triton its kernels in Triton's: both move into the rank's cache directory, AOT or not."""
        super().initialize_cache(cache_dir, disable_cache, prefix)
        if not disable_cache:
            initialize_inductor_cache(_base_cache_dir(cache_dir, prefix))

    def compile(self, graph, example_inputs, config, compile_range, key=None):
        from torch._inductor.codecache import FxGraphCache
        from torch._inductor.compile_fx import compile_fx

        compilation_counter.num_inductor_compiles += 1
        single = returns_single_value(graph)
        # compile_fx rewrites the graph it is given (its output becomes a list): give it a copy,
        # the piece is compiled again for the next entry
        graph = fx.GraphModule(graph, copy.deepcopy(graph.graph))
        with patch.object(FxGraphCache, "_get_shape_env",
                          staticmethod(lambda: AlwaysHitShapeEnv())):
            compiled = compile_fx(graph, example_inputs, config_patches=config)
        # no handle: what it compiled is found again by hash in Inductor's FX graph cache
        return (first_output(compiled) if single else compiled), None


def returns_single_value(graph: fx.GraphModule) -> bool:
    return not isinstance(next(iter(graph.graph.find_nodes(op="output"))).args[0], (tuple, list))


def first_output(fn: Callable) -> Callable:
    """Inductor's compiled callables return a list; a piece that returns one value needs it back."""
    def call(*args: Any) -> Any:
        out = fn(*args)
        return out[0] if isinstance(out, (list, tuple)) else out

    return call


def timed_compile(compiler: CompilerInterface, graph, example_inputs, config, compile_range,
                  graph_index: int, key: str | None = None) -> CompiledEntry:
    t0 = time.perf_counter()
    code: list[str] = []
    with cpu_isa.remembered_probe(), capture_output_code(code):
        runnable, handle = compiler.compile(graph, example_inputs, config, compile_range, key)
    return CompiledEntry(runnable, compile_range, graph_index, time.perf_counter() - t0, code,
                         artifact_path=handle[1] if handle else None, handle=handle)
