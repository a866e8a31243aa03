"""CompilationConfig refuses at construction what would fail later, and takes what torch takes:
Inductor freezing under VLLM_COMPILE, "~" in paths, Inductor's aliased options."""

from __future__ import annotations

import pytest
import torch._inductor.config as inductor_config

from minivllm_compile import CompilationConfig, CompilationMode
from minivllm_compile.models import build_model


def test_freezing_in_the_config_is_refused_under_vllm_compile_saying_why():
    match = (r'Inductor freezing \(inductor_compile_config=\{"freezing": True\}\) cannot be used '
             r"with mode=VLLM_COMPILE: the piecewise backend gives each piece the weights as "
             r"inputs.*Turn freezing off")
    with pytest.raises(ValueError, match=match):
        CompilationConfig(inductor_compile_config={"freezing": True})
    # the whole-graph modes compile it without failing, and freezing off is no one's business
    CompilationConfig(mode=CompilationMode.DYNAMO_TRACE_ONCE,
                      inductor_compile_config={"freezing": True})
    CompilationConfig(inductor_compile_config={"freezing": False})


def test_freezing_set_for_the_whole_process_is_refused_naming_the_switch(monkeypatch):
    # TORCHINDUCTOR_FREEZING=1 is read into torch._inductor.config.freezing when torch starts
    monkeypatch.setenv("TORCHINDUCTOR_FREEZING", "1")
    with inductor_config.patch(freezing=True):
        with pytest.raises(ValueError, match=r"freezing \(TORCHINDUCTOR_FREEZING=1\) cannot"):
            CompilationConfig()
        # False in the config reaches Inductor, but Dynamo still reads the global switch
        with pytest.raises(ValueError, match="does not undo for Dynamo"):
            CompilationConfig(inductor_compile_config={"freezing": False})
        CompilationConfig(mode=CompilationMode.STOCK_TORCH_COMPILE)
    monkeypatch.delenv("TORCHINDUCTOR_FREEZING")
    with inductor_config.patch(freezing=True), \
            pytest.raises(ValueError, match=r"\(torch._inductor.config.freezing = True\)"):
        CompilationConfig()


def test_inductor_options_that_are_aliases_are_accepted():
    """force_disable_caches is torch.compiler.config's, aliased into Inductor's config:
    get_config_copy() leaves it out, but Inductor's patch() takes it, so the config does too."""
    for name in ("force_disable_caches", "max_autotune", "triton.cudagraphs"):
        cc = CompilationConfig(inductor_compile_config={name: False})
        with inductor_config.patch(cc.inductor_compile_config):
            pass
    with pytest.raises(ValueError, match="did you mean 'force_disable_caches'"):
        CompilationConfig(inductor_compile_config={"force_disable_cache": True})


@pytest.mark.compiles
def test_a_home_relative_cache_dir_is_expanded(tmp_path, monkeypatch):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(cwd)
    cc = CompilationConfig(backend="eager", cache_dir="~/x", debug_dump_path="~/dump",
                           max_num_batched_tokens=16)
    assert cc.cache_dir == str(home / "x") and cc.debug_dump_path == str(home / "dump")
    # a compile with the cache on writes there, and nothing into a folder named "~"
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "0")
    lm = build_model("llama", num_layers=1, compilation_config=cc)
    lm.warmup()
    assert any((home / "x").rglob("*.py")), list(tmp_path.rglob("*"))
    assert not (cwd / "~").exists()


@pytest.mark.parametrize("graphs", ["FULL", "PIECEWISE", "FULL_AND_PIECEWISE"])
def test_stock_torch_compile_captures_no_cuda_graph(graphs, caplog):
    """vLLM 0.34's VllmConfig._disable_cudagraphs_for_stock_torch_compile: CUDA graphs are
    turned off, and the sizes with them, in its words."""
    import logging

    from minivllm_compile import CUDAGraphMode

    with caplog.at_level(logging.INFO, logger="minivllm_compile"):
        cc = CompilationConfig(mode=CompilationMode.STOCK_TORCH_COMPILE, cudagraph_mode=graphs,
                               cudagraph_capture_sizes=[1, 2])
    assert cc.cudagraph_mode == CUDAGraphMode.NONE and cc.cudagraph_capture_sizes == []
    assert f"Overriding cudagraph_mode {graphs} to NONE" in caplog.text
