"""The example user pass (passes/example_user_pass.py), run as vLLM runs a user's pass: given in
inductor_compile_config["post_grad_custom_post_pass"], merged into the pass manager."""

import pytest
import torch

from minivllm_compile import CompilationConfig, CompilationMode
from minivllm_compile.compilation import cache_keys
from minivllm_compile.compilation.passes.example_user_pass import SiluAndMulToNativePass
from minivllm_compile.models import build_model


def compiled_llama(**inductor_config):
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, compile_sizes=[4],
                           max_num_batched_tokens=32,
                           # a hit skips the pass
                           inductor_compile_config={"fx_graph_cache": False, **inductor_config})
    return build_model("llama", num_layers=2, compilation_config=cc)


@pytest.fixture(autouse=True)
def no_cache(monkeypatch):
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")


def generated_code(lm) -> str:
    return "\n".join("\n".join(e.code) for e in lm.model.backend.compiler_manager.entries)


@pytest.mark.compiles
def test_the_pass_unwraps_every_silu_and_mul_and_changes_no_output():
    eager = build_model("llama", num_layers=2)
    user_pass = SiluAndMulToNativePass()
    lm, plain = compiled_llama(post_grad_custom_post_pass=user_pass), compiled_llama()
    for n in (4, 11):
        ids = torch.randint(0, 258, (n,))
        torch.testing.assert_close(lm(ids, torch.arange(n)), eager(ids, torch.arange(n)),
                                   atol=1e-4, rtol=1e-4)
        plain(ids, torch.arange(n))
    assert "silu_and_mul" in generated_code(plain)  # the opaque call, without the pass
    assert "silu_and_mul" not in generated_code(lm)  # Inductor got silu and mul, and fused them
    manager = lm.model.backend.post_grad_pass_manager
    assert user_pass in manager.passes and manager.all_passes()[-1] is manager.fix_functionalization
    # one silu_and_mul per layer, in the pieces that hold an MLP: pieces 1 and 2 for 2 layers
    assert user_pass.matched_count == 1  # the last graph it saw: the last piece's last entry


def test_the_pass_is_in_the_key_by_its_source():
    with_pass = CompilationConfig(inductor_compile_config={
        "post_grad_custom_post_pass": SiluAndMulToNativePass()})
    again = CompilationConfig(inductor_compile_config={
        "post_grad_custom_post_pass": SiluAndMulToNativePass()})
    # a new instance, the same pass
    assert cache_keys.passes_uuid(with_pass) == cache_keys.passes_uuid(again)
    assert cache_keys.passes_uuid(with_pass) != cache_keys.passes_uuid(CompilationConfig())
