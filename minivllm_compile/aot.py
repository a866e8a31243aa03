"""The AOT branch of the first call (vLLM's decorators.py; seed §10, §11): load the whole compiled
forward from the cache if it is there and still valid, else compile it ahead of time and save it.

VLLM_USE_AOT_COMPILE (default on where torch has aot_compile and the cache is on, as in vLLM)
applies to VLLM_COMPILE with Inductor through standalone_compile: its backend returns a serializable
function (caching.VllmSerializableFunction). With VLLM_USE_MEGA_AOT_ARTIFACT (default on for
torch >= 2.12, as in vLLM) the saved file holds the pieces' artifacts and a load rebuilds them
without the backend; without it the file holds the Dynamo graph, and a load runs the backend on it
again, each piece found in the CompilerManager's index instead of compiled (finalize_loading).
VLLM_FORCE_AOT_LOAD=1 turns a missing or unloadable artifact into an error;
VLLM_DISABLE_COMPILE_CACHE=1 neither loads nor saves.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from pathlib import Path

import torch

from minivllm_compile import caching, envs
from minivllm_compile.backends import VllmBackend
from minivllm_compile.cache_files import file_mode
from minivllm_compile.counter import compilation_counter

logger = logging.getLogger("minivllm_compile")

# whether a config compiles ahead of time: decided below the backend (its CompilerManager asks too)
use_aot_compile = caching.use_aot_compile


def aot_path(model: torch.nn.Module) -> Path:
    key, _ = caching.aot_cache_key(model, model.compilation_config, model.model_factors)
    return caching.cache_root() / "torch_aot_compile" / key / "rank_0_0" / "model"


def try_load(model) -> bool:
    """Load the saved compiled forward into model.aot_compiled_fn; False means: compile."""
    force = envs.VLLM_FORCE_AOT_LOAD
    if envs.VLLM_DISABLE_COMPILE_CACHE:
        if force:
            raise RuntimeError("VLLM_FORCE_AOT_LOAD=1 with VLLM_DISABLE_COMPILE_CACHE=1: nothing can be "
                               "loaded; unset one of them")
        return False
    path = model.aot_path = aot_path(model)
    if not path.exists():
        if force:
            raise FileNotFoundError(f"VLLM_FORCE_AOT_LOAD=1 but there is no AOT artifact at {path}: run "
                                    "once without VLLM_FORCE_AOT_LOAD to compile and save it")
        return False
    try:
        with open(path, "rb") as f, caching.loading_for(model.compilation_config):
            fn = torch.compiler.load_compiled_function(f, f_globals=model.forward.__globals__)
        source_info = fn.source_info()
        changed = caching.changed_sources(source_info)
        if changed:
            raise RuntimeError(f"traced source changed since it was saved: {', '.join(changed[:3])}")
        if not model.compilation_config.dynamic_shapes_config.evaluate_guards:
            fn.disable_guard_check()
        for src in source_info.inlined_sources:
            module = sys.modules.get(src.module)
            if module is not None and getattr(module, "__file__", None):
                model.compilation_config.traced_files.add(module.__file__)
        # without the mega artifact the backend runs again now, on the saved Dynamo graph (the
        # traced files just added key its cache dir), and loads each piece from its index
        fn._artifacts.compiled_fn.finalize_loading(model.compilation_config, model.model_factors,
                                                   functools.partial(VllmBackend, from_saved_graph=True))
    except Exception as e:  # corrupt, truncated, stale, or from another torch: compile again
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        if force:
            raise RuntimeError(f"VLLM_FORCE_AOT_LOAD=1 and the AOT artifact at {path} cannot be used: {reason}") from e
        logger.warning("AOT artifact %s is unusable (%s); compiling afresh", path, reason)
        return False
    model.aot_compiled_fn = fn
    model.compiled = True
    compilation_counter.num_aot_artifacts_loaded += 1
    return True


def save(model) -> None:
    if envs.VLLM_DISABLE_COMPILE_CACHE:
        return
    path = model.aot_path  # try_load computed it before this compile
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with caching.locked(path.parent):
            model.aot_compiled_fn.save_compiled_function(str(tmp))
            # torch writes it through a NamedTemporaryFile, mode 0600 (vLLM's AOT files are private
            # to their owner that way): give it what open() gives, so a shared cache can read it
            os.chmod(tmp, file_mode())
            os.replace(tmp, path)
    except Exception as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        logger.warning("cannot save the AOT artifact to %s (%s); it stays in memory", path, e)
        return
    compilation_counter.num_aot_artifacts_saved += 1
