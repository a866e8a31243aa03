"""minivllm_compile: vLLM's compilation system, small enough to read and run on a laptop CPU."""

__version__ = "0.1.0"

# modules notebooks reach for (the cache's three importable from here as they always were; their
# home is minivllm_compile/compilation/)
from minivllm_compile import envs  # noqa: F401
from minivllm_compile.compilation import cache_files, cache_keys, caching  # noqa: F401
from minivllm_compile.compilation.counter import compilation_counter
from minivllm_compile.compilation.decorators import ignore_torch_compile, support_torch_compile
from minivllm_compile.config import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    DynamicShapesConfig,
    DynamicShapesType,
    PassConfig,
    Range,
)
from minivllm_compile.logger import configure as _configure_logging

_configure_logging()

__all__ = [
    "CompilationConfig", "CompilationMode", "CUDAGraphMode", "DynamicShapesConfig",
    "DynamicShapesType", "PassConfig",
    "Range", "compilation_counter", "ignore_torch_compile", "support_torch_compile",
]
