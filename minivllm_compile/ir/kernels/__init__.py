"""The providers of the IR ops beyond `native` (vLLM 0.34's vllm/kernels/): importing this package
registers them, as importing vllm.kernels does (its platform's import_ir_kernels)."""

from minivllm_compile.ir.kernels import triton_ops, vllm_c

__all__ = ["triton_ops", "vllm_c"]
