"""`gelu_and_mul_sparse` as an IR op (vLLM 0.34's vllm/ir/ops/activation.py).

The gated MLP activation of Gemma 3n (vLLM's `GeluAndMulSparse` layer, in
vllm/model_executor/layers/activation.py, calls this op): the first half of the last dimension is
the gate, the second the up projection. Each row's gate keeps only what lies above its mean plus
`std_multiplier` standard deviations, shifted down by that cut-off; GELU of that, times the up
half. The layer sets `std_multiplier` to the normal quantile of its `activation_sparsity`: the
input generator's 1.6449 is the 0.95 quantile, so about 5% of a normal gate survives.

The body is the `native` provider, vLLM's. Its only other provider is vLLM's `triton`, one Triton
kernel (ir/kernels/triton_ops.py, kernels/activation.py), the only op whose `triton` provider
vLLM ships: the norms' `triton` provider is this project's own. No `vllm_c`: vLLM has no C++
kernel for it. Tolerances: vLLM registers none of its own, so the defaults (ir/tolerances.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from minivllm_compile.ir.op import register_op


@register_op
def gelu_and_mul_sparse(x: Tensor, std_multiplier: float, approximate: str = "none") -> Tensor:
    """Apply Gaussian sparsification, GELU, and gated multiplication."""
    d = x.shape[-1] // 2
    gate = x[..., :d]
    # the statistics are each row's (vLLM: "local to each tensor-parallel shard"), in x's dtype
    mean = torch.mean(gate, dim=-1, keepdim=True)
    std = torch.std(gate, dim=-1, keepdim=True, unbiased=False)
    sparse_gate = F.relu(gate - (mean + std * std_multiplier))
    return F.gelu(sparse_gate, approximate=approximate) * x[..., d:]


@gelu_and_mul_sparse.register_input_generator
def _gelu_and_mul_sparse_input_generator(
    num_tokens: int,
    hidden_size: int,
    dtype: torch.dtype,
    std_multiplier: float = 1.6448536269514722,
    approximate: str = "tanh",
) -> tuple:
    # hidden_size is the output's width (vLLM's intermediate size): x holds gate and up, 2x wide
    x = torch.randn(num_tokens, hidden_size * 2, dtype=dtype)
    return x, std_multiplier, approximate
