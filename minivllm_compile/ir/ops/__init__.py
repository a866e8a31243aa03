"""The IR ops (vLLM 0.34's vllm/ir/ops/); their providers are in minivllm_compile.ir.kernels."""

from minivllm_compile.ir.ops.activation import gelu_and_mul_sparse
from minivllm_compile.ir.ops.layernorm import fused_add_rms_norm, rms_norm

__all__ = ["fused_add_rms_norm", "gelu_and_mul_sparse", "rms_norm"]
