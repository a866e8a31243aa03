"""Tensor parallelism: the process groups, the collectives as custom ops, the parallel layers
(vLLM's vllm/distributed/ and the parallel layers of model_executor/layers/).

Start N ranks with `minivllm_compile.launch` (`launch.run(fn, tp=2)` from Python); each rank then
builds the same model, and the layers built below take their shard of every weight."""

from minivllm_compile.distributed import fused_allreduce_norm  # noqa: F401  (registers the op)
from minivllm_compile.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from minivllm_compile.distributed.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from minivllm_compile.distributed.parallel_state import (
    DEFAULT_TIMEOUT_S,
    GroupCoordinator,
    destroy_distributed_environment,
    destroy_model_parallel,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    get_world_group,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
    tensor_parallel_disabled,
)
from minivllm_compile.distributed.rank_check import RankMismatchError, check_same_on_all_ranks
from minivllm_compile.distributed.utils import (
    default_weight_loader,
    divide,
    set_weight_attrs,
    sharded_weight_loader,
)
from minivllm_compile.distributed.vocab_parallel_embedding import (
    DEFAULT_VOCAB_PADDING_SIZE,
    LogitsProcessor,
    ParallelLMHead,
    VocabParallelEmbedding,
    pad_vocab_size,
)

__all__ = [
    "ColumnParallelLinear", "DEFAULT_TIMEOUT_S", "DEFAULT_VOCAB_PADDING_SIZE",
    "GroupCoordinator", "LinearBase", "LogitsProcessor", "MergedColumnParallelLinear",
    "ParallelLMHead", "QKVParallelLinear", "RankMismatchError", "RowParallelLinear",
    "VocabParallelEmbedding", "check_same_on_all_ranks", "default_weight_loader",
    "destroy_distributed_environment", "destroy_model_parallel", "divide",
    "get_tensor_model_parallel_rank", "get_tensor_model_parallel_world_size", "get_tp_group",
    "get_world_group", "init_distributed_environment", "initialize_model_parallel",
    "model_parallel_is_initialized", "pad_vocab_size", "set_weight_attrs",
    "sharded_weight_loader", "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce", "tensor_parallel_disabled",
]
