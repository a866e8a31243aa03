"""vLLM IR (vLLM 0.34's vllm/ir/): ops declared once, implemented by providers, chosen by priority.

    from minivllm_compile import ir
    ir.ops.rms_norm(x, weight, 1e-6)                  # dispatches by the current priority
    with ir.ops.rms_norm.set_priority(["vllm_c", "native"]): ...

`ir.ops` holds the ops; importing `minivllm_compile.ir.kernels` registers the providers beyond
`native` (vllm_c, triton), as importing vllm.kernels does in vLLM.
"""

from minivllm_compile.ir import ops
from minivllm_compile.ir.impl import RESERVED_PROVIDERS, IrOpImpl
from minivllm_compile.ir.op import (
    IrOp,
    enable_torch_wrap,
    register_op,
    set_default_torch_wrap,
    torch_wrap_enabled,
)

__all__ = [
    "RESERVED_PROVIDERS",
    "IrOp",
    "IrOpImpl",
    "enable_torch_wrap",
    "ops",
    "register_op",
    "set_default_torch_wrap",
    "torch_wrap_enabled",
]
