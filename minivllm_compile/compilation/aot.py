"""The AOT branch of the first call (vLLM's decorators.py; seed §10, §11): load the whole compiled
forward from the cache if it is there and still valid, else compile it ahead of time and save it.

VLLM_USE_AOT_COMPILE (default on where torch has aot_compile and the cache is on, as in vLLM)
applies to VLLM_COMPILE with Inductor through standalone_compile: its backend returns a serializable
function (caching.VllmSerializableFunction). With VLLM_USE_MEGA_AOT_ARTIFACT (default on for
torch >= 2.12, as in vLLM) the saved file holds the pieces' artifacts and a load rebuilds them
without the backend; without it the file holds the Dynamo graph, and a load runs the backend on it
again, each piece found in the CompilerManager's index instead of compiled (finalize_loading).
VLLM_FORCE_AOT_LOAD=1 turns a missing or unloadable artifact into an error (and a switch that turns
the load off into one too); VLLM_DISABLE_COMPILE_CACHE=1 (or Inductor's force_disable_caches)
neither loads nor saves.

A load trusts nothing it has not checked: the file's SHA-256 and each piece's (caching.py), the key
and model it was built for, the sources its trace read and the values it baked in
(traced_state.py). Any difference is one warning, and the model is compiled and saved afresh.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from minivllm_compile import envs
from minivllm_compile.compilation import cache_files, cache_keys, caching, traced_state
from minivllm_compile.compilation.backends import VllmBackend
from minivllm_compile.compilation.counter import compilation_counter
from minivllm_compile.config import CompilationMode

logger = logging.getLogger("minivllm_compile")

def aot_path(model: torch.nn.Module) -> Path:
    key, _ = cache_keys.aot_cache_key(model, model.compilation_config, model.model_factors)
    """`torch_aot_compile/<hash>/rank_{rank}_{dp_rank}/model`: each rank saves and loads its own
    compiled forward (its graph has its own slice of the vocabulary and rank-0 biases) under the
    hash all ranks share (the TP size is in it, the rank is not)."""
    return (cache_files.cache_root() / "torch_aot_compile" / key
            / cache_files.rank_folder() / "model")


def _verify_source_unchanged(source_info, compilation_config) -> None:
    """vLLM's (decorators.py): every module the saved trace inlined must have the source it had
    then, and its file joins the traced files (the backend's cache dir is keyed on them). The AOT
    key is computed before Dynamo runs, so it cannot cover these files; this check does instead."""
    changed = set()
    for src in source_info.inlined_sources:  # content: the whole module's source
        module = sys.modules.get(src.module)
        try:
            now = inspect.getsource(module) if module else None
        except (OSError, TypeError):
            now = None
        if now != src.content:
            changed.add(src.module)
        elif getattr(module, "__file__", None):
            compilation_config.traced_files.add(module.__file__)
    if changed:
        names = ", ".join(sorted(changed)[:3])
        raise RuntimeError(f"traced source changed since it was saved: {names}")


def record_built_for(model) -> None:
    """Write into the freshly compiled function what a later load must find again: the key and
    model it was built for (a file copied to another model's path is then noticed), and what the
    trace assumed (traced_state.py: its sources, the values it baked in). Nothing to record where
    nothing is saved."""
    if not caching.compile_cache_enabled(model.compilation_config):
        return
    path = getattr(model, "aot_path", None) or aot_path(model)
    model.aot_compiled_fn._artifacts.compiled_fn.built_for = {
        "aot_key": path.parent.parent.name, "model": _class_name(model),
        "traced": traced_state.record(model)}


def _class_name(model) -> str:
    return f"{type(model).__module__}.{type(model).__qualname__}"


def _verify_built_for(compiled_fn, model, path: Path) -> None:
    """The artifact's own record against the loading model: built for this key and class, from
    the same sources, with the same baked-in values. Raises, naming the first difference."""
    built = getattr(compiled_fn, "built_for", None) or {}
    key = path.parent.parent.name
    if built.get("aot_key") != key or built.get("model") != _class_name(model):
        raise RuntimeError(f"it was built for another model: {built.get('model', 'unknown')} (key "
                           f"{built.get('aot_key')}), not {_class_name(model)} (key {key})")
    traced_state.check(built.get("traced", {}), model)


def refuse_forced_load_without_aot(cc) -> None:
    """VLLM_FORCE_AOT_LOAD=1 promises a load or an error, never a compile. A model of VLLM_COMPILE
    with Inductor, where a switch turns the AOT load off, would compile: refused instead, naming
    the switch (vLLM skips the load there and compiles: its VLLM_FORCE_AOT_LOAD acts only inside
    the load)."""
    if (not envs.VLLM_FORCE_AOT_LOAD or cc.mode != CompilationMode.VLLM_COMPILE
        or cc.backend != "inductor"):
        return
    import torch._inductor.config as inductor_config

    if envs.VLLM_DISABLE_COMPILE_CACHE:
        why = "VLLM_DISABLE_COMPILE_CACHE=1"
    elif cc.inductor_compile_config.get("force_disable_caches", False):
        why = "inductor_compile_config={'force_disable_caches': True} (the compile cache is off)"
    elif inductor_config.force_disable_caches:
        why = ("Inductor's force_disable_caches (TORCHINDUCTOR_FORCE_DISABLE_CACHES=1: "
               "the compile cache is off)")
    elif not envs.VLLM_USE_AOT_COMPILE:
        why = "VLLM_USE_AOT_COMPILE=0" + ("" if envs._aot_supported()
                                          else " (this torch has no AOT compile)")
    elif not envs.VLLM_USE_STANDALONE_COMPILE:
        why = "VLLM_USE_STANDALONE_COMPILE=0 (the AOT artifact needs standalone_compile's)"
    else:
        return
    raise RuntimeError(f"VLLM_FORCE_AOT_LOAD=1 with {why}: nothing can be "
                       "loaded; unset one of them")


def _try_load_aot_compiled_fn(model):
    """The saved compiled forward (vLLM's function of the same name), or None: compile it."""
    force = envs.VLLM_FORCE_AOT_LOAD
    if not caching.compile_cache_enabled(model.compilation_config):
        return None
    path = model.aot_path = aot_path(model)
    if not path.exists():
        if force:
            raise FileNotFoundError("VLLM_FORCE_AOT_LOAD=1 but there is no AOT "
                                    f"artifact at {path}: run once without "
                                    "VLLM_FORCE_AOT_LOAD to compile and save it")
        return None
    try:
        with open(path, "rb") as f, caching.loading_for(model.compilation_config):
            fn = torch.compiler.load_compiled_function(f, f_globals=model.forward.__globals__)
        _verify_built_for(fn._artifacts.compiled_fn, model, path)
        _verify_source_unchanged(fn.source_info(), model.compilation_config)
        if not model.compilation_config.dynamic_shapes_config.evaluate_guards:
            fn.disable_guard_check()
        # without the mega artifact the backend runs again now, on the saved Dynamo graph (the
        # traced files just added key its cache dir), and loads each piece from its index
        fn._artifacts.compiled_fn.finalize_loading(model.compilation_config, functools.partial(
            VllmBackend, from_saved_graph=True, model_factors=lambda: model.model_factors))
    except Exception as e:  # corrupt, truncated, stale, or from another torch: compile again
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        if force:
            raise RuntimeError("VLLM_FORCE_AOT_LOAD=1 and the AOT artifact at "
                               f"{path} cannot be used: {reason}") from e
        logger.warning("AOT artifact %s is unusable (%s); compiling afresh", path, reason)
        return None
    compilation_counter.num_aot_artifacts_loaded += 1
    return fn


def save_aot_compiled_function(model) -> None:
    """Save model.aot_compiled_fn (vLLM's method of the same name): atomically, readable by a shared
    cache's other users; a failure is logged and the function stays in memory.

    torch writes the file through a temporary file beside the target, which a failed or killed save
    leaves behind (one more per start on a full disk). So torch writes into a folder of its own
    here, removed whatever happens; and since every save holds the folder's lock, whatever an
    earlier, killed save left is swept away first."""
    if not caching.compile_cache_enabled(model.compilation_config):
        return
    path = model.aot_path  # _try_load_aot_compiled_fn computed it before this compile
    artifacts = getattr(model.aot_compiled_fn, "_artifacts", None)
    built = getattr(getattr(artifacts, "compiled_fn", None), "built_for", None) or {}
    unreadable = traced_state.unreadable(built.get("traced", {}))
    if unreadable:
        _warn_not_saved(_class_name(model), ", ".join(unreadable[:3]))
        return
    try:
        with cache_files.locked(path.parent):
            _sweep_partial_saves(path)
            work = tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.saving.")
            try:
                tmp = os.path.join(work, path.name)
                model.aot_compiled_fn.save_compiled_function(tmp)
                # torch writes it through a NamedTemporaryFile, mode 0600 (vLLM's AOT files are
                # private to their owner that way): give it what open() gives, so a shared cache
                # can read it
                os.chmod(tmp, cache_files.file_mode())
                os.replace(tmp, path)
            finally:
                shutil.rmtree(work, ignore_errors=True)
    except Exception as e:
        logger.warning("cannot save the AOT artifact to %s (%s); it stays in memory", path, e)
        return
    compilation_counter.num_aot_artifacts_saved += 1


@functools.cache  # once per class and process
def _warn_not_saved(model: str, where: str) -> None:
    logger.warning(
        "%s is not saved to the compile cache: the source of %s cannot be read (defined with "
        "python -c or exec?), so a later start could not tell an edited version from this one and "
        "would run this compiled code. It is compiled at every start; define it in a file or a "
        "notebook cell to cache it.", model, where)


def _sweep_partial_saves(path: Path) -> None:
    """What a killed save left beside `path` (called under the folder's lock, so no save is under
    way): our work folders, and the temporary files earlier versions let torch leave there."""
    for leftover in path.parent.iterdir():
        name = leftover.name
        if name.startswith(f".{path.name}.saving."):
            shutil.rmtree(leftover, ignore_errors=True)
        elif (name.startswith("tmp") or (name.startswith(f".{path.name}.")
                                         and name.endswith(".tmp"))) \
                and leftover.is_file():
            with contextlib.suppress(OSError):
                leftover.unlink()
