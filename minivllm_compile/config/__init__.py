"""Compilation settings, laid out as vLLM's vllm/config/: `compilation.py` (CompilationConfig,
PassConfig, the modes), `kernel.py` (KernelConfig and the vLLM IR op priority), `parallel.py`
(ParallelConfig, the TP size), `utils.py` (Range; the compile factors: get_compile_factors,
normalize_value, hash_factors, hash_config). Every config has compile_factors(), the fields that
change what is compiled. The names a user reaches for are re-exported here, as
`from vllm.config import CompilationConfig` works in vLLM."""

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
from minivllm_compile.config.parallel import ParallelConfig
from minivllm_compile.config.utils import (
    CompileFactors,
    Range,
    SupportsCompileFactors,
    get_compile_factors,
    hash_config,
    hash_factors,
    normalize_value,
)

__all__ = [
    "CUDAGraphMode", "CompilationConfig", "CompilationMode", "CompileFactors",
    "DynamicShapesConfig", "DynamicShapesType", "IrOpPriorityConfig", "KernelConfig",
    "ParallelConfig", "PassConfig", "Range", "SupportsCompileFactors", "get_compile_factors",
    "get_current_compilation_config", "hash_config", "hash_factors", "normalize_value",
    "set_current_compilation_config",
]
