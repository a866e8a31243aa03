"""`ActivationQuantFusionPass`: SiLU-and-mul + static FP8 quant -> `silu_and_mul_quant`
(vLLM's passes/fusion/act_quant_fusion.py, static per-tensor FP8 only).

A Llama MLP's down_proj is an FP8 linear, so its input, the gated activation, is quantized first:

    act = silu_and_mul(gate_up)                  # [T, d] written to memory
    xq  = static_scaled_fp8_quant(act, scale)    # read back, quantized

`silu_and_mul_quant(result, gate_up, scale)` does both in one pass and never stores `act`.

As in rms_quant_fusion.py, both forms of each op are matched, in all four combinations: the
custom op as functionalization leaves it (`auto_functionalized(op, out=empty(...), ...)`) and its
plain-torch form (`custom_ops` "none": `silu(x[..., :d]) * x[..., d:]`, and
static_scaled_fp8_quant_native). The split point d is not burned in: the search ignores ints,
and Inductor's check re-traces the pattern with the match's inputs, so d is the graph's own. The
activation dtype is (the plain-torch quant casts to fp32, a cast an fp32 graph does not hold), so
the plain-torch patterns are registered per dtype among the graph's inputs, on first sight.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._inductor.pattern_matcher import PatternMatcherPass

import minivllm_compile.ops  # noqa: F401  (registers torch.ops.minivllm.*)
from minivllm_compile.compilation.passes.fusion.rms_quant_fusion import (
    empty_quant,
    quant_fp8,
    register,
)
from minivllm_compile.compilation.passes.fx_utils import find_model_dtypes
from minivllm_compile.compilation.passes.inductor_pass import enable_fake_mode
from minivllm_compile.compilation.passes.vllm_inductor_pass import (
    VllmInductorPass,
    VllmPatternMatcherPass,
)

logger = logging.getLogger(__name__)
minivllm = torch.ops.minivllm
NUM_TOKENS, WIDTH = 5, 8  # example gate_up sizes for tracing: any even width will do


# --- the two forms of silu_and_mul --------------------------------------------------------------
# the plain-torch form restates SiluAndMul.forward's native path (the core may not import models/)

def silu_and_mul_native(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def silu_and_mul_custom(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
    at = auto_functionalized(minivllm.silu_and_mul.default, out=out, input=x)
    return at[1]


@dataclass(frozen=True)
class SiluMulFp8StaticQuantPattern:
    """quant(silu_and_mul(input)) -> silu_and_mul_quant, for one dtype and form of each op."""

    dtype: torch.dtype
    custom_act: bool
    custom_quant: bool

    def get_inputs(self) -> list[torch.Tensor]:
        return [torch.empty(NUM_TOKENS, WIDTH, dtype=self.dtype),  # input: gate and up side by side
                torch.empty(1, dtype=torch.float32)]               # scale

    def register(self, pm_pass: PatternMatcherPass) -> None:
        act = silu_and_mul_custom if self.custom_act else silu_and_mul_native
        quant = quant_fp8(self.custom_quant)

        def pattern(input: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return quant(act(input), scale)

        def replacement(input: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            shape = input.shape[:-1] + (input.shape[-1] // 2,)
            at = auto_functionalized(minivllm.silu_and_mul_quant.default,
                                     result=empty_quant(shape, input),
                                     input=input, scale=scale)
            return at[1]

        register(pattern, replacement, self.get_inputs(), pm_pass)


class ActivationQuantFusionPass(VllmPatternMatcherPass):
    def __init__(self, pass_config=None, records=None):
        super().__init__(pass_config, records)
        self.patterns = PatternMatcherPass(pass_name="activation_quant_fusion_pass")
        self.registered: set[torch.dtype] = set()  # dtypes registered so far

    @enable_fake_mode
    def register_patterns(self, dtype: torch.dtype) -> None:
        # custom act + custom quant holds no cast, so it fits any dtype: register it once
        for custom_act in (True, False):
            for custom_quant in (True, False):
                if custom_act and custom_quant and self.registered:
                    continue
                SiluMulFp8StaticQuantPattern(dtype, custom_act,
                                             custom_quant).register(self.patterns)
        self.registered.add(dtype)
        logger.debug("ActivationQuantFusionPass: registered patterns for %s", dtype)

    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        for dtype in sorted(find_model_dtypes(graph) - self.registered, key=str):
            self.register_patterns(dtype)
        self.record_matches(self.patterns.apply(graph))

    def uuid(self) -> str:
        # the class alone would miss the patterns and the forms they are traced from
        return VllmInductorPass.hash_source(
            self, SiluMulFp8StaticQuantPattern, silu_and_mul_native, silu_and_mul_custom,
            find_model_dtypes, register, empty_quant, quant_fp8)
