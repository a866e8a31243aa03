"""The collectives a layer calls (vLLM's distributed/communication_op.py): over the TP group.

With no TP group (a single process that never called init_distributed_environment) they return
their input, as vLLM's GroupCoordinator does for a group of one."""

from __future__ import annotations

import torch

from minivllm_compile.distributed import parallel_state


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    """Sum `input_` over the TP ranks, out of place: `torch.ops.minivllm.all_reduce` in a graph."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return input_
    return parallel_state.get_tp_group().all_reduce(input_)


def tensor_model_parallel_all_gather(input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `input_` along `dim`, in rank order."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return input_
    return parallel_state.get_tp_group().all_gather(input_, dim)
