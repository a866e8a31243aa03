"""The all-reduce fused with the RMSNorm after it: the op AllReduceFusionPass puts in place of the
two (compilation/passes/fusion/allreduce_rms_fusion.py).

`torch.ops.minivllm.flashinfer_trtllm_fused_allreduce_norm` has vLLM's name, its mutated
arguments (`allreduce_in`, `residual`, `norm_out`) and their meaning:

    norm_out is None (after o_proj, after down_proj: a residual stream follows)
        residual    <- all_reduce(allreduce_in) + residual
        allreduce_in <- rms_norm(residual) * rms_gamma
    norm_out given (the first layer's norm, the residual a zero tensor)
        allreduce_in <- all_reduce(allreduce_in) + residual
        norm_out    <- rms_norm(allreduce_in) * rms_gamma

Its body is a STAND-IN for FlashInfer's fused kernel (trtllm's allreduce_fusion, CUDA only in
vLLM): the same collective as the unfused graph (`dist.all_reduce` on the TP group: gloo on the
CPU, NCCL on CUDA), then the reference norm, the vLLM IR op dispatched by the current priority.
So it saves no memory traffic here: what the fusion shows is the graph (one op where there were
two, the boundary Inductor can no longer fuse across gone) and the range gate, with logits that
equal the unfused ones. FlashInfer's kernel does the reduce and the norm in one pass over a
workspace of `max_token_num` rows; here `max_token_num` is checked as vLLM asserts it.

It lives here, not in the pass's module, so that a warm start that loads a fused graph from the
compile cache finds the op registered (every model imports this package).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from minivllm_compile.distributed.parallel_state import _lookup
from minivllm_compile.ops import direct_register_custom_op


def flashinfer_trtllm_fused_allreduce_norm(
    allreduce_in: torch.Tensor, residual: torch.Tensor, rms_gamma: torch.Tensor, rms_eps: float,
    world_size: int, max_token_num: int, group_name: str,
    norm_out: torch.Tensor | None = None,
) -> None:
    from minivllm_compile import ir  # the IR norm ops (imported late: ir imports the models' ops)

    num_tokens = allreduce_in.numel() // allreduce_in.shape[-1]
    if num_tokens > max_token_num:  # vLLM asserts: FlashInfer's workspace has this many rows
        raise ValueError(f"flashinfer_trtllm_fused_allreduce_norm: {num_tokens} tokens, more than "
                         f"max_token_num={max_token_num} (AllReduceFusionPass's range gate should "
                         "have left this range unfused)")
    group = _lookup(group_name)
    if group.world_size != world_size:
        raise ValueError(f"flashinfer_trtllm_fused_allreduce_norm: group {group_name!r} has "
                         f"{group.world_size} ranks, the graph was built for {world_size}")
    group.wait_for_compiling_peers()
    dist.all_reduce(allreduce_in, group=group.device_group)
    if norm_out is None:
        normed, summed = ir.ops.fused_add_rms_norm(allreduce_in, residual, rms_gamma, rms_eps)
        residual.copy_(summed)
        allreduce_in.copy_(normed)
    else:
        allreduce_in.add_(residual)
        norm_out.copy_(ir.ops.rms_norm(allreduce_in, rms_gamma, rms_eps))


def _fake(allreduce_in, residual, rms_gamma, rms_eps, world_size, max_token_num, group_name,
          norm_out=None) -> None:
    return None  # every result is an argument it writes


direct_register_custom_op("flashinfer_trtllm_fused_allreduce_norm",
                          flashinfer_trtllm_fused_allreduce_norm,
                          mutates_args=["allreduce_in", "residual", "norm_out"], fake_impl=_fake)
