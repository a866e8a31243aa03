"""The tensor-parallel linears (vLLM's model_executor/layers/linear.py, unquantized).

Megatron's split of a transformer block, which vLLM keeps: the first matmul of a block is column
parallel (each rank computes some of the output features, no communication), the second is row
parallel (each rank multiplies its slice of the features and the partial sums are all-reduced).
So an attention or MLP block costs one all-reduce, after `o_proj` and after `down_proj`.

Each layer is an `nn.Linear` of its rank's shard. At TP=1 the shard is the whole weight and the
forward is nn.Linear's `F.linear(x, weight, bias)`, so a single-process model computes, traces and
initialises exactly as it did with nn.Linear (and models/quant.py still finds its linears).
vLLM's LinearBase is a plain module with a quant_method; FP8 here replaces the layer instead.

Each parameter carries a `weight_loader(param, checkpoint_tensor[, shard_id])` that keeps this
rank's part of the whole checkpoint tensor (vLLM's loaders, without the quantized cases).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minivllm_compile.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from minivllm_compile.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from minivllm_compile.distributed.utils import check_shape, divide, set_weight_attrs


class LinearBase(nn.Linear):
    # which of this layer's plain values differ from rank to rank: left out of the cache key
    # (cache_keys.model_constants), whose hash all ranks share; each rank's folder keeps its own
    # compiled code (vLLM's hash excludes the rank, its folder rank_{rank}_{dp_rank} has it)
    _rank_dependent_attrs = ("tp_rank",)

    def __init__(self, input_size: int, output_size: int, input_size_per_partition: int,
                 output_size_per_partition: int, bias: bool, skip_bias_add: bool, prefix: str,
                 return_bias: bool):
        super().__init__(input_size_per_partition, output_size_per_partition, bias=bias)
        self.input_size, self.output_size = input_size, output_size
        self.input_size_per_partition = input_size_per_partition
        self.output_size_per_partition = output_size_per_partition
        self.skip_bias_add, self.return_bias, self.prefix = skip_bias_add, return_bias, prefix
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})
        if bias:
            set_weight_attrs(self.bias, {"weight_loader": self.weight_loader})

    def _name(self, what: str) -> str:
        return f"{self.prefix}: {what}" if self.prefix else what

    def _result(self, output: torch.Tensor):
        if not self.return_bias:
            return output
        return output, (self.bias if self.skip_bias_add else None)


def _tp(disable_tp: bool) -> tuple[int, int]:
    if disable_tp:
        return 0, 1
    return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()


class ColumnParallelLinear(LinearBase):
    """Y = X A + b with A split by columns (output features): rank r computes Y_r = X A_r + b_r.
    `gather_output` all-gathers the Y_r into Y; the models here leave it off (the next layer is
    row parallel and takes Y_r as it is)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 gather_output: bool = False, skip_bias_add: bool = False,
                 params_dtype: torch.dtype | None = None, prefix: str = "", *,
                 return_bias: bool = True, disable_tp: bool = False):
        self.tp_rank, self.tp_size = _tp(disable_tp)
        what = f"{prefix}: output_size" if prefix else "output_size"
        per_partition = divide(output_size, self.tp_size, what)
        # a stacked layer (QKV, merged gate/up) splits each of its parts, not the whole
        self.output_partition_sizes = [divide(s, self.tp_size, what) for s in
                                       getattr(self, "output_sizes", [output_size])]
        super().__init__(input_size, output_size, input_size, per_partition, bias, skip_bias_add,
                         prefix, return_bias)
        self.gather_output = gather_output
        if params_dtype is not None:
            self.to(params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        is_bias = param.dim() == 1
        check_shape(self._name("bias" if is_bias else "weight"), loaded_weight,
                    (self.output_size,) if is_bias else (self.output_size, self.input_size))
        shard = param.shape[0]
        param.data.copy_(loaded_weight.narrow(0, self.tp_rank * shard, shard))

    def forward(self, input_: torch.Tensor):
        bias = self.bias if not self.skip_bias_add else None
        output = F.linear(input_, self.weight, bias)
        if self.gather_output and self.tp_size > 1:
            output = tensor_model_parallel_all_gather(output)
        return self._result(output)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, "
                f"output_features={self.output_size_per_partition}, bias={self.bias is not None}, "
                f"tp_size={self.tp_size}, gather_output={self.gather_output}")


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel linears on one input, stacked into one matmul (gate and up of an
    MLP; B, C and x of a short conv). Rank r holds the r-th slice of each part, side by side, so
    its output splits into its share of every part."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True,
                 gather_output: bool = False, skip_bias_add: bool = False,
                 params_dtype: torch.dtype | None = None, prefix: str = "", *,
                 return_bias: bool = True, disable_tp: bool = False):
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias, gather_output, skip_bias_add,
                         params_dtype, prefix, return_bias=return_bias, disable_tp=disable_tp)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: int | None = None) -> None:
        if loaded_shard_id is None:  # stacked in the checkpoint already (a short conv's in_proj)
            check_shape(self._name("weight" if param.dim() == 2 else "bias"), loaded_weight,
                        (self.output_size,) + ((self.input_size,) if param.dim() == 2 else ()))
            offset = 0
            for i, size in enumerate(self.output_sizes):
                self.weight_loader(param, loaded_weight.narrow(0, offset, size), i)
                offset += size
            return
        if not 0 <= loaded_shard_id < len(self.output_sizes):
            raise ValueError(self._name(f"shard id {loaded_shard_id} out of range for "
                                        f"{len(self.output_sizes)} parts"))
        size = self.output_partition_sizes[loaded_shard_id]
        part = (self.output_sizes[loaded_shard_id],) + (
            (self.input_size,) if param.dim() == 2 else ())
        check_shape(self._name(f"part {loaded_shard_id}"), loaded_weight, part)
        dst = param.data.narrow(0, sum(self.output_partition_sizes[:loaded_shard_id]), size)
        dst.copy_(loaded_weight.narrow(0, self.tp_rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul, split by attention heads: rank r computes heads
    [r * H/tp, (r+1) * H/tp) of q and its share of the key/value heads. With more ranks than KV
    heads, each KV head is replicated on tp / num_kv_heads ranks (vLLM's num_kv_head_replicas)."""

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = True,
                 skip_bias_add: bool = False, params_dtype: torch.dtype | None = None,
                 prefix: str = "", *, return_bias: bool = True, disable_tp: bool = False):
        self.hidden_size, self.head_size = hidden_size, head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        tp_size = _tp(disable_tp)[1]
        self.num_heads = divide(total_num_heads, tp_size, "num_attention_heads")
        if tp_size >= self.total_num_kv_heads:  # each rank one KV head, shared by several ranks
            if tp_size % self.total_num_kv_heads:
                raise ValueError(f"num_key_value_heads={self.total_num_kv_heads}: a "
                                 "tensor-parallel size above it must be a multiple of it (each KV "
                                 "head is then replicated on tp / num_key_value_heads ranks), got "
                                 f"{tp_size}")
            self.num_kv_heads = 1
            self.num_kv_head_replicas = tp_size // self.total_num_kv_heads
        else:
            self.num_kv_heads = divide(self.total_num_kv_heads, tp_size, "num_key_value_heads")
            self.num_kv_head_replicas = 1
        self.output_sizes = [self.num_heads * head_size * tp_size,
                             self.num_kv_heads * head_size * tp_size,
                             self.num_kv_heads * head_size * tp_size]
        super().__init__(hidden_size, sum(self.output_sizes), bias, False, skip_bias_add,
                         params_dtype, prefix, return_bias=return_bias, disable_tp=disable_tp)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      loaded_shard_id: str | None = None) -> None:
        if loaded_shard_id not in ("q", "k", "v"):
            raise ValueError(self._name(f"shard id must be 'q', 'k' or 'v', "
                                        f"got {loaded_shard_id!r}"))
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        offset, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[loaded_shard_id]
        heads = self.total_num_heads if loaded_shard_id == "q" else self.total_num_kv_heads
        full = (heads * self.head_size,) + ((self.input_size,) if param.dim() == 2 else ())
        check_shape(self._name(f"{loaded_shard_id}_proj"), loaded_weight, full)
        # a replicated KV head: ranks r*R .. r*R+R-1 all load KV shard r
        shard_rank = (self.tp_rank if loaded_shard_id == "q"
                      else self.tp_rank // self.num_kv_head_replicas)
        param.data.narrow(0, offset, size).copy_(loaded_weight.narrow(0, shard_rank * size, size))


class RowParallelLinear(LinearBase):
    """Y = X A + b with A split by rows (input features) and X by columns: rank r computes
    X_r A_r, and the all-reduce sums the partial products into Y on every rank. The bias is added
    on rank 0 only, before the sum, so that it is added once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True,
                 input_is_parallel: bool = True, skip_bias_add: bool = False,
                 params_dtype: torch.dtype | None = None, reduce_results: bool = True,
                 prefix: str = "", *, return_bias: bool = True, disable_tp: bool = False):
        self.tp_rank, self.tp_size = _tp(disable_tp)
        per_partition = divide(input_size, self.tp_size,
                               f"{prefix}: input_size" if prefix else "input_size")
        if not reduce_results and bias and not skip_bias_add:
            raise ValueError("When not reduce the results, adding bias to the results can lead to "
                             "incorrect results")  # vLLM's words
        super().__init__(input_size, output_size, per_partition, output_size, bias, skip_bias_add,
                         prefix, return_bias)
        self.input_is_parallel, self.reduce_results = input_is_parallel, reduce_results
        if params_dtype is not None:
            self.to(params_dtype)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if param.dim() == 1:  # the bias: whole on every rank (only rank 0 adds it)
            check_shape(self._name("bias"), loaded_weight, (self.output_size,))
            param.data.copy_(loaded_weight)
            return
        check_shape(self._name("weight"), loaded_weight, (self.output_size, self.input_size))
        shard = param.shape[1]
        param.data.copy_(loaded_weight.narrow(1, self.tp_rank * shard, shard))

    def forward(self, input_: torch.Tensor):
        if not self.input_is_parallel:
            input_ = input_.chunk(self.tp_size, dim=-1)[self.tp_rank].contiguous()
        bias = None if (self.tp_rank > 0 or self.skip_bias_add) else self.bias
        output = F.linear(input_, self.weight, bias)
        if self.reduce_results and self.tp_size > 1:
            output = tensor_model_parallel_all_reduce(output)
        return self._result(output)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size_per_partition}, "
                f"output_features={self.output_size}, bias={self.bias is not None}, "
                f"tp_size={self.tp_size}, reduce_results={self.reduce_results}")
