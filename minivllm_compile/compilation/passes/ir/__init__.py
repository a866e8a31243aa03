"""The vLLM IR passes (vLLM 0.34's compilation/passes/ir/): VllmIRInplaceFunctionalizationPass
before AOTAutograd, VllmIRLoweringPass and UnsafeCloneEliminationPass after the fusion passes."""

from minivllm_compile.compilation.passes.ir.clone_elimination import UnsafeCloneEliminationPass
from minivllm_compile.compilation.passes.ir.inplace_functionalization import (
    VllmIRInplaceFunctionalizationPass,
)
from minivllm_compile.compilation.passes.ir.lowering_pass import VllmIRLoweringPass
from minivllm_compile.compilation.passes.ir.utils import get_ir_op

__all__ = [
    "UnsafeCloneEliminationPass",
    "VllmIRInplaceFunctionalizationPass",
    "VllmIRLoweringPass",
    "get_ir_op",
]


def install_pre_grad_pass(inductor_config: dict) -> None:
    """Put VllmIRInplaceFunctionalizationPass where Inductor runs it before AOTAutograd (vLLM's
    VllmBackend.configure_post_pass), kept out of AOTAutograd's pickled config: Inductor hashes a
    custom pass by its uuid, and pickling the pass object would only add noise."""
    import torch._inductor.config as inductor_config_module

    if "pre_grad_custom_pass" in inductor_config:
        raise ValueError(
            "inductor_compile_config['pre_grad_custom_pass'] is the backend's: it installs "
            "VllmIRInplaceFunctionalizationPass there; add your pass as a post-grad pass"
        )
    inductor_config["pre_grad_custom_pass"] = VllmIRInplaceFunctionalizationPass()
    ignore = list(inductor_config_module._cache_config_ignore_prefix)
    if "pre_grad_custom_pass" not in ignore:  # torch 2.13 lists it already
        inductor_config["_cache_config_ignore_prefix"] = ignore + ["pre_grad_custom_pass"]
