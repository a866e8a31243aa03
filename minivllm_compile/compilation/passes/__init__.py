"""Post-grad graph passes run inside Inductor (vLLM's vllm/compilation/passes/).

The fusion passes are imported on first use (PEP 562 __getattr__ below): they import Inductor's
pattern matcher, which a warm start from the AOT artifact never needs."""

import importlib
from typing import Any

from minivllm_compile.compilation.passes.fx_utils import is_func
from minivllm_compile.compilation.passes.inductor_pass import (
    CallableInductorPass,
    InductorPass,
    PassContext,
    get_pass_context,
    graph_text,
    pass_context,
)
from minivllm_compile.compilation.passes.pass_manager import PostGradPassManager, make_pass_manager
from minivllm_compile.compilation.passes.utility.fix_functionalization import (
    FixFunctionalizationPass,
)
from minivllm_compile.compilation.passes.utility.noop_elimination import NoOpEliminationPass
from minivllm_compile.compilation.passes.vllm_inductor_pass import (
    Records,
    VllmInductorPass,
    VllmPatternMatcherPass,
)

__all__ = [
    "ActivationQuantFusionPass", "CallableInductorPass", "FixFunctionalizationPass", "InductorPass",
    "NoOpEliminationPass", "PassContext", "PostGradPassManager", "QKNormRoPEFusionPass",
    "RMSNormQuantFusionPass", "Records", "VllmInductorPass", "VllmPatternMatcherPass",
    "get_pass_context", "graph_text", "is_func", "make_pass_manager", "pass_context",
]

_LAZY = {"ActivationQuantFusionPass": "fusion.act_quant_fusion",
         "QKNormRoPEFusionPass": "fusion.qk_norm_rope_fusion",
         "RMSNormQuantFusionPass": "fusion.rms_quant_fusion"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
