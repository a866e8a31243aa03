"""depyf through compilation/depyf_compat.py (vLLM 0.34's): depyf 0.20's `load_by_key_path` hook
has a frozen signature and Inductor passes it `set_sys_modules`, so a compile that loads a module
through `PyCodeCache.load` while `debug_dump_path` is set failed with a TypeError."""

from __future__ import annotations

import pytest
import torch
from torch._inductor.codecache import PyCodeCache

from minivllm_compile import CompilationConfig, CompilationMode
from minivllm_compile.compilation import depyf_compat
from minivllm_compile.models import build_model

depyf = pytest.importorskip("depyf")

SOURCE = "def answer():\n    return 42\n"


def test_the_installed_hook_takes_set_sys_modules_and_dumps_the_source(tmp_path):
    with depyf_compat.prepare_debug(str(tmp_path)):
        hook = PyCodeCache.load_by_key_path  # depyf's, as it stands while depyf is active
        assert hook is not depyf_compat._hook_accepts_inductor_keywords  # (a function of ours)
        key, path = PyCodeCache.write(SOURCE)
        assert hook(key, path, set_sys_modules=False).answer() == 42
        assert PyCodeCache.load(SOURCE).answer() == 42  # Inductor's way in: it passes the keyword
    dumped = [p for p in tmp_path.iterdir() if ".kernel_" in p.name]
    assert dumped and all(p.read_text() == SOURCE for p in dumped)  # depyf's dump, as before
    unpatched = depyf.explain.global_variables.data["unpatched_load_by_key_path"]
    assert PyCodeCache.load_by_key_path.__func__ is unpatched.__func__  # depyf put torch's back


def test_only_a_hook_that_lacks_inductors_keywords_is_patched():
    from depyf.explain.patched_load_by_key_path import patched_load_by_key_path as depyfs_own

    def takes_everything(key, path, linemap=None, attrs=None, **kwargs): ...

    def takes_the_parameters(key, path, linemap=None, attrs=None, set_sys_modules=None): ...

    assert not depyf_compat._hook_accepts_inductor_keywords(depyfs_own)  # depyf 0.20's
    assert depyf_compat._hook_accepts_inductor_keywords(takes_everything)
    assert depyf_compat._hook_accepts_inductor_keywords(takes_the_parameters)


def _load_a_module(graph: torch.fx.Graph) -> None:
    """A post-grad pass that imports generated source through PyCodeCache.load, as Inductor does
    for each Triton kernel on a GPU (a CPU compile with the C++ backend never calls it)."""
    assert PyCodeCache.load(SOURCE).answer() == 42


@pytest.mark.compiles
def test_a_compile_that_loads_through_the_code_cache_with_debug_dump_path(tmp_path):
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, debug_dump_path=str(tmp_path),
                           max_num_batched_tokens=16,
                           inductor_compile_config={"post_grad_custom_post_pass": _load_a_module})
    lm = build_model("llama", num_layers=1, compilation_config=cc)
    eager = build_model("llama", num_layers=1)
    ids, positions = torch.arange(4) + 1, torch.arange(4)
    torch.testing.assert_close(lm(ids, positions), eager(ids, positions), rtol=1e-4, atol=1e-4)
    names = {p.name for p in tmp_path.iterdir()}
    assert any(".kernel_" in n for n in names)  # the pass's module, dumped by the hook
    assert any(n.startswith("__compiled_fn_") for n in names)  # depyf's dumps of the graphs
    assert "transformed_code.py" in names
