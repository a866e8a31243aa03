"""`AllReduceFusionPass`: all-reduce + RMSNorm -> one fused op (vLLM's
passes/fusion/allreduce_rms_fusion.py, the two plain-norm patterns).

Under tensor parallelism every row-parallel linear (o_proj, down_proj) and the vocabulary-parallel
embedding end in an all-reduce, and what reads the sum is an RMSNorm:

    summed = all_reduce(partial, "tp:0")                    # the collective writes the sum
    normed, residual = fused_add_rms_norm(summed, residual, weight, eps)   # read back, normed

vLLM replaces the two with FlashInfer's fused kernel (CUDA only), which reduces and normalises in
one pass. Here the replacement is the same op by vLLM's name,
`torch.ops.minivllm.flashinfer_trtllm_fused_allreduce_norm` (distributed/fused_allreduce_norm.py),
whose body stands in for FlashInfer's: the gloo/NCCL all-reduce, then the reference norm.

Patterns, as vLLM's (the norm matched as the vLLM IR op, before VllmIRLoweringPass):
- AllReduceRMSNormPattern: all_reduce -> rms_norm, returning (normed, summed): the first layer's
  input norm, after the embedding's all-reduce (the sum is the residual stream's start);
- AllReduceFusedAddRMSNormPattern: all_reduce -> fused_add_rms_norm, returning (normed, residual),
  and the same returning normed only (the model's final norm, whose residual nobody reads).
So a Llama of L layers has 2L + 1 matches: after o_proj and down_proj in every layer, and after the
embedding.

vLLM's gates, kept: the pass is in the pipeline when `PassConfig.fuse_allreduce_rms` is on, and
disabled at TP <= 1 (nothing to reduce; vLLM warns once and its `is_applicable_for_range` says
no); it applies to compile ranges that end at or below `max_token_num`
(`PassConfig.allreduce_fusion_max_token_num`, at most max_num_batched_tokens), which is also a
compile-range endpoint (config/compilation.py), so that the decode-sized range fuses and the
prefill one keeps the plain all-reduce. The eps values and dtypes are read from the graph (as
RMSNormQuantFusionPass does) where vLLM registers 1e-5 and 1e-6 up front.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._inductor.pattern_matcher import PatternMatcherPass

import minivllm_compile.distributed.fused_allreduce_norm  # noqa: F401  (registers the fused op)
from minivllm_compile.compilation.passes.fusion.rms_quant_fusion import (
    fused_add_rms_norm_ir,
    register,
)
from minivllm_compile.compilation.passes.fx_utils import (
    find_model_dtypes,
    norm_dtypes_match,
    rms_norm_ir,
)
from minivllm_compile.compilation.passes.inductor_pass import enable_fake_mode
from minivllm_compile.compilation.passes.ir.utils import find_rms_norm_eps
from minivllm_compile.compilation.passes.vllm_inductor_pass import (
    VllmInductorPass,
    VllmPatternMatcherPass,
)
from minivllm_compile.config import PassConfig, Range
from minivllm_compile.distributed.parallel_state import (
    get_tensor_model_parallel_world_size,
    get_tp_group,
)

logger = logging.getLogger(__name__)
NUM_TOKENS, HIDDEN = 5, 16  # example sizes to trace the patterns (the search ignores sizes)


@dataclass(frozen=True)
class FlashInferFusedAllReduceParams:
    """What the fused op is told besides its tensors (vLLM's class of the same name, less the
    FlashInfer launch flags): the TP size, the workspace's token rows, and the group by name."""

    world_size: int
    max_token_num: int
    group_name: str

    def get_trtllm_fused_allreduce_kwargs(self) -> dict:
        return {"world_size": self.world_size, "max_token_num": self.max_token_num,
                "group_name": self.group_name}


def fused_allreduce_norm():
    return torch.ops.minivllm.flashinfer_trtllm_fused_allreduce_norm.default


def all_reduce(input: torch.Tensor, group_name: str) -> torch.Tensor:
    # vLLM: tensor_model_parallel_all_reduce
    return torch.ops.minivllm.all_reduce(input, group_name)


@dataclass(frozen=True)
class AllReduceRMSNormPattern:
    """(rms_norm(all_reduce(input)), all_reduce(input)) -> the fused op with a zero residual."""

    epsilon: float
    dtype: torch.dtype
    params: FlashInferFusedAllReduceParams

    def get_inputs(self) -> list[torch.Tensor]:
        return [torch.empty(NUM_TOKENS, HIDDEN, dtype=self.dtype),  # input
                torch.empty(HIDDEN, dtype=self.dtype)]              # weight

    def register(self, pm_pass: PatternMatcherPass) -> None:
        eps, kw = self.epsilon, self.params.get_trtllm_fused_allreduce_kwargs()

        def pattern(input: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            allreduce_output = all_reduce(input, kw["group_name"])
            return rms_norm_ir(allreduce_output, weight, eps), allreduce_output

        def replacement(input: torch.Tensor,
                        weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            at = auto_functionalized(fused_allreduce_norm(), allreduce_in=input,
                                     residual=torch.zeros_like(input),
                                     rms_gamma=weight, rms_eps=eps,
                                     norm_out=torch.empty_like(input), **kw)
            return at[3], at[1]  # norm_out, allreduce_in (the sum)

        register(pattern, replacement, self.get_inputs(), pm_pass, norm_dtypes_match)


@dataclass(frozen=True)
class AllReduceFusedAddRMSNormPattern:
    """fused_add_rms_norm(all_reduce(input), residual) -> the fused op, writing the norm into
    `allreduce_in` and the new residual into `residual`; also with the norm alone returned."""

    epsilon: float
    dtype: torch.dtype
    params: FlashInferFusedAllReduceParams

    def get_inputs(self) -> list[torch.Tensor]:
        return [torch.empty(NUM_TOKENS, HIDDEN, dtype=self.dtype),  # residual
                torch.empty(NUM_TOKENS, HIDDEN, dtype=self.dtype),  # input
                torch.empty(HIDDEN, dtype=self.dtype)]              # weight

    def register(self, pm_pass: PatternMatcherPass) -> None:
        eps, kw = self.epsilon, self.params.get_trtllm_fused_allreduce_kwargs()

        def pattern(residual: torch.Tensor, input: torch.Tensor,
                    weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            allreduce_output = all_reduce(input, kw["group_name"])
            return fused_add_rms_norm_ir(allreduce_output, residual, weight, eps)

        def replacement(residual: torch.Tensor, input: torch.Tensor,
                        weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            at = auto_functionalized(fused_allreduce_norm(), allreduce_in=input, residual=residual,
                                     rms_gamma=weight, rms_eps=eps, norm_out=None, **kw)
            return at[1], at[2]  # allreduce_in (the norm), residual

        register(pattern, replacement, self.get_inputs(), pm_pass, norm_dtypes_match)
        # the same, the norm alone returned: the end of the graph, where the residual is not read
        def first_return_only(fn):
            return lambda a, b, c: fn(a, b, c)[0]

        register(first_return_only(pattern), first_return_only(replacement), self.get_inputs(),
                 pm_pass, norm_dtypes_match)


class AllReduceFusionPass(VllmPatternMatcherPass):
    def __init__(self, pass_config: PassConfig | None = None, records=None, *,
                 max_num_batched_tokens: int | None = None):
        super().__init__(pass_config, records)
        self.disabled = True
        self.tp_size = get_tensor_model_parallel_world_size()
        self.max_token_num = self.group_name = None
        if self.tp_size <= 1:
            _warn_disabled_once()
            return
        self.group_name = get_tp_group().unique_name
        caps = [n for n in (self.pass_config.allreduce_fusion_max_token_num, max_num_batched_tokens)
                if n is not None]
        # vLLM: min(FlashInfer's workspace rows, max_num_batched_tokens)
        self.max_token_num = min(caps) if caps else 2**31 - 1
        self.params = FlashInferFusedAllReduceParams(self.tp_size, self.max_token_num,
                                                     self.group_name)
        self.patterns = PatternMatcherPass(pass_name="all_reduce_fusion_pass")
        self.registered: set[tuple[float, torch.dtype]] = set()
        self.disabled = False

    @enable_fake_mode  # traced on fake tensors: registering runs no all-reduce (vLLM's, too)
    def register_patterns(self, epsilon: float, dtype: torch.dtype) -> None:
        AllReduceRMSNormPattern(epsilon, dtype, self.params).register(self.patterns)
        AllReduceFusedAddRMSNormPattern(epsilon, dtype, self.params).register(self.patterns)
        self.registered.add((epsilon, dtype))

    def is_applicable_for_range(self, compile_range: Range | None) -> bool:
        if self.disabled:
            return False
        return compile_range is None or compile_range.end <= self.max_token_num

    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        if self.disabled:
            return
        for eps in sorted(find_rms_norm_eps(graph)):
            for dtype in sorted(find_model_dtypes(graph), key=str):
                if (eps, dtype) not in self.registered:
                    self.register_patterns(eps, dtype)
        self.record_matches(self.patterns.apply(graph))

    def uuid(self) -> str:
        # the gate and what the replacement bakes in (the TP size, max_token_num, the group) too
        source = VllmInductorPass.hash_source(
            self, AllReduceRMSNormPattern, AllReduceFusedAddRMSNormPattern,
            FlashInferFusedAllReduceParams, all_reduce, fused_allreduce_norm, rms_norm_ir,
            fused_add_rms_norm_ir, find_rms_norm_eps, find_model_dtypes,
            norm_dtypes_match, register)
        return VllmInductorPass.hash_dict({"source": source, "tp_size": self.tp_size,
                                           "max_token_num": self.max_token_num,
                                           "group_name": self.group_name})


@functools.cache
def _warn_disabled_once() -> None:
    logger.warning("AllReduce fusion pass is disabled for tp_size <= 1.")  # vLLM's words
