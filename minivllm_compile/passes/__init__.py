"""Post-grad graph passes run inside Inductor (vLLM's vllm/compilation/passes/)."""

from minivllm_compile.passes.act_quant_fusion import ActivationQuantFusionPass
from minivllm_compile.passes.fix_functionalization import FixFunctionalizationPass
from minivllm_compile.passes.inductor_pass import (
    CallableInductorPass,
    InductorPass,
    graph_text,
    is_func,
)
from minivllm_compile.passes.noop_elimination import NoOpEliminationPass
from minivllm_compile.passes.pass_manager import PostGradPassManager, make_pass_manager
from minivllm_compile.passes.qk_norm_rope_fusion import QKNormRoPEFusionPass
from minivllm_compile.passes.rms_quant_fusion import RMSNormQuantFusionPass
from minivllm_compile.passes.vllm_inductor_pass import (
    Records,
    VllmInductorPass,
    VllmPatternMatcherPass,
)

__all__ = [
    "ActivationQuantFusionPass", "CallableInductorPass", "FixFunctionalizationPass", "InductorPass",
    "NoOpEliminationPass", "PostGradPassManager", "QKNormRoPEFusionPass", "RMSNormQuantFusionPass", "Records", "VllmInductorPass", "VllmPatternMatcherPass",
    "graph_text", "is_func", "make_pass_manager",
]
