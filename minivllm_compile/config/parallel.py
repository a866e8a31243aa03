"""`ParallelConfig`: how many ranks share the model (vLLM's vllm/config/parallel.py, made small:
tensor parallelism only, the one kind this project has).

vLLM's engine builds one ParallelConfig and hands it to every worker; here each process reads its
place in the TP group from distributed/parallel_state.py (`ParallelConfig.current()`). Its compile
factors are the sizes, never the rank: every rank of a TP group compiles the same graph shape and
shares one cache hash, and the rank names the folder below it instead (rank_{rank}_{dp_rank}).
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm_compile.config.utils import CompileFactors, get_compile_factors


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    rank: int = 0  # this process's rank in the TP group (vLLM's `rank`, of the whole world)

    @classmethod
    def current(cls) -> ParallelConfig:
        """This process's: TP size 1 and rank 0 without a TP group (or under
        tensor_parallel_disabled())."""
        from minivllm_compile.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return cls(tensor_parallel_size=get_tensor_model_parallel_world_size(),
                   rank=get_tensor_model_parallel_rank())

    def compile_factors(self) -> CompileFactors:
        """The TP size: a TP=2 rank's graph holds all-reduces and half-size weights, and must not
        load what a TP=1 start compiled. Not the rank (vLLM's ignored_factors name it too)."""
        return get_compile_factors(self, {"rank"})
