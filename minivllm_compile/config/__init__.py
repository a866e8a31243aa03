"""Compilation settings, laid out as vLLM's vllm/config/: `compilation.py` (CompilationConfig,
PassConfig, the modes), `kernel.py` (KernelConfig and the vLLM IR op priority), `utils.py` (Range).
The names a user reaches for are re-exported here, as `from vllm.config import CompilationConfig`
works in vLLM."""

from minivllm_compile.config.compilation import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    DynamicShapesConfig,
    DynamicShapesType,
    PassConfig,
    get_current_compilation_config,
    set_current_compilation_config,
)
from minivllm_compile.config.kernel import IrOpPriorityConfig, KernelConfig
from minivllm_compile.config.utils import Range

__all__ = [
    "CUDAGraphMode", "CompilationConfig", "CompilationMode", "DynamicShapesConfig",
    "DynamicShapesType", "IrOpPriorityConfig", "KernelConfig", "PassConfig", "Range",
    "get_current_compilation_config", "set_current_compilation_config",
]
