"""How far a provider may be from `native` and still pass (vLLM 0.34's vllm/ir/tolerances.py).

The tests run every supported provider on the op's generated inputs and compare with the native
body under these bounds; an op whose reduction rounds more (RMSNorm in float16) overrides its own.
"""

from __future__ import annotations

import torch

ToleranceSpec = dict[torch.dtype, dict[str, float]]

# Each bound sits a little above the format's rounding: float32's is PyTorch's own default for
# comparing kernels, float16's and bfloat16's vLLM's kernel tests use, bfloat16 with a wider rtol
# for its 7-bit mantissa. FP8 (3 and 2 mantissa bits), FP4 and int8 are here for ops that quantize.
DEFAULT_TOLERANCES: ToleranceSpec = {
    torch.float64: {"atol": 1e-8, "rtol": 1e-8},
    torch.float32: {"atol": 1e-5, "rtol": 1.3e-6},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-3, "rtol": 1.6e-2},
    torch.float8_e4m3fn: {"atol": 1e-1, "rtol": 1e-1},
    torch.float8_e5m2: {"atol": 2e-1, "rtol": 2e-1},
    torch.float4_e2m1fn_x2: {"atol": 3e-1, "rtol": 3e-1},  # FP4 (1 mantissa bit), packed in pairs
    torch.int8: {"atol": 1, "rtol": 0},  # off by one after rounding; relative error means nothing
}
