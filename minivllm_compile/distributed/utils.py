"""Small helpers the parallel layers share (vLLM's distributed/utils.py and weight_utils.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from minivllm_compile.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)


def divide(numerator: int, denominator: int, what: str = "the size") -> int:
    """numerator // denominator, refusing a remainder. vLLM asserts "{n} is not divisible by {d}";
    here the error names the dimension (`what`), so a user knows which --tp to pick."""
    if numerator % denominator:
        fits = [d for d in range(1, min(numerator, 64) + 1) if numerator % d == 0]
        raise ValueError(f"{what}={numerator} is not divisible by the tensor-parallel size "
                         f"{denominator}: every rank must hold an equal share; --tp values that "
                         f"divide it: {fits}")
    return numerator // denominator


def set_weight_attrs(weight: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Attach loading hints to a parameter (vLLM's helper): here only `weight_loader`, the function
    the checkpoint loader calls with the parameter and the whole checkpoint tensor."""
    for key, value in attrs.items():
        if hasattr(weight, key):
            raise AttributeError(f"overwriting the existing tensor attribute {key!r}")
        setattr(weight, key, value)


def check_shape(what: str, loaded: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"{what}: the checkpoint tensor has shape {tuple(loaded.shape)}, expected "
                         f"{tuple(expected)} (the whole, unsharded tensor)")


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """A replicated parameter: every rank holds all of it."""
    check_shape("replicated parameter", loaded_weight, param.shape)
    param.data.copy_(loaded_weight)


def sharded_weight_loader(shard_axis: int) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """A loader that keeps this rank's equal slice along `shard_axis` (vLLM's helper)."""

    def loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        size = param.shape[shard_axis]
        full = list(param.shape)
        full[shard_axis] = size * get_tensor_model_parallel_world_size()
        check_shape("sharded parameter", loaded_weight, tuple(full))
        start = get_tensor_model_parallel_rank() * size
        param.data.copy_(loaded_weight.narrow(shard_axis, start, size))

    return loader
