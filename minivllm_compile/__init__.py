"""minivllm_compile: vLLM's compilation system, small enough to read and run on a laptop CPU."""

__version__ = "0.1.0"
