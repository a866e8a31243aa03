"""`RMSNormQuantFusionPass`: RMSNorm + static FP8 quant -> one fused op
(vLLM's passes/fusion/rms_quant_fusion.py, static per-tensor FP8 only).

An FP8 linear quantizes its input first (models/quant.py), and in a Llama layer that input is
an RMSNorm's output:

    normed = rms_norm(x, weight, eps)                 # written to memory
    xq     = static_scaled_fp8_quant(normed, scale)   # read back, quantized

`rms_norm_static_fp8_quant` does both in one pass over the row and never stores `normed`. The
residual form fuses too: `fused_add_rms_norm` (returns the norm and x + residual) followed by the
quant becomes `fused_add_rms_norm_static_fp8_quant`, which writes the new residual and the
quantized norm.

The norm is matched as vLLM 0.34 matches it: the vLLM IR op, `torch.ops.minivllm_ir.rms_norm`
(and fused_add_rms_norm's default overload, which the pre-grad pass made of `maybe_inplace`), one
node whatever provider the priority will lower it to: this pass runs before VllmIRLoweringPass.
The quant comes in two forms, and both are registered (vLLM's matcher_utils picks one form per op
from the config; here one pass serves any `custom_ops`):
- the custom op, as functionalization leaves it: `auto_functionalized(op, out=empty(...), ...)`;
- its plain-torch form, what `custom_ops` "none" traces
(kernels.quant_fp8.static_scaled_fp8_quant_native). The replacement is the fused op, written
functionally, `auto_functionalized(fused, result=...)`; FixFunctionalization (last in the pipeline)
makes it a direct in-place call.

Two things are burned into a pattern rather than matched:
- eps: Inductor's matcher ignores float arguments when it searches, then re-traces the pattern
  with the match's real inputs and compares, so a pattern registered for eps 1e-6 finds a 1e-5
  norm and then refuses it. vLLM registers for 1e-5 and 1e-6 up front. This pass is built from
  the PassConfig alone (no model config), so it reads the eps values from the graph it is given
  (each IR norm node's `epsilon`) and registers each new one on first sight, as QKNormRoPEFusionPass
  does for its geometry.
- the activation dtype: the plain-torch quant casts to fp32, and for an fp32 model that cast
  vanishes from the graph, so a bf16 pattern does not fit an fp32 graph nor the reverse. The
  candidates are the floating-point dtypes of the graph's inputs (activations and norm weights;
  the fp32 scales always add fp32, a cheap extra). The IR norm with the custom quant holds no cast,
  so that pattern is registered once per eps.
Shapes are not burned in: the search ignores sizes, and the re-trace uses the match's own.
Patterns for several eps values share one search pattern; one whose check refuses a match leaves
the node to the next, so the order of registration does not matter across eps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch._inductor.pattern_matcher as pm
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._inductor.pattern_matcher import PatternMatcherPass

import minivllm_compile.ir.kernels  # noqa: F401  (the IR ops and their providers)
import minivllm_compile.ops  # noqa: F401  (registers torch.ops.minivllm.*)
from minivllm_compile import ir

# what the patterns are registered for, read from the graph (the QK-norm and all-reduce passes
# read them the same way), and the norm as the layers call it
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
from minivllm_compile.ir.op import enable_torch_wrap
from minivllm_compile.kernels.quant_fp8 import FP8_DTYPE, static_scaled_fp8_quant_native

logger = logging.getLogger(__name__)
aten = torch.ops.aten
minivllm = torch.ops.minivllm

NUM_TOKENS, HIDDEN = 5, 16  # example sizes for tracing the patterns: any will do (see above)


# --- the norm as the IR op, the quant in both forms ----------------------------------------------

def fused_add_rms_norm_ir(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return ir.ops.fused_add_rms_norm(x, residual, weight, eps)  # (normed, x + residual)


def quant_fp8_custom(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # as Fp8Linear.forward allocates it
    result = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    at = auto_functionalized(minivllm.static_scaled_fp8_quant.default, result=result,
                             input=x, scale=scale)
    return at[1]


quant_fp8_native = static_scaled_fp8_quant_native  # the very function Fp8Linear calls under "none"


def quant_fp8(custom: bool):
    return quant_fp8_custom if custom else quant_fp8_native


# --- registering a pattern -------------------------------------------------------------------

def register(pattern, replacement, inputs: list[torch.Tensor], pm_pass: PatternMatcherPass,
             extra_check=lambda match: True) -> None:
    """Trace both on the (fake) example inputs, with the IR ops' torch wrap on (so an IR op traces
    to its one node). Called from a register_patterns under enable_fake_mode, as vLLM's are."""
    with torch.no_grad(), enable_torch_wrap(True):
        pm.register_replacement(pattern, replacement, inputs, pm.fwd_only, pm_pass,
                                extra_check=extra_check)


def empty_quant(shape, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, dtype=FP8_DTYPE, device=like.device)


# --- the patterns -------------------------------------------------------------------------------

@dataclass(frozen=True)
class RMSNormStaticQuantPattern:
    """quant(rms_norm(input)) -> rms_norm_static_fp8_quant, for one eps,
    dtype and form of each op."""

    epsilon: float
    dtype: torch.dtype
    custom_quant: bool

    def get_inputs(self) -> list[torch.Tensor]:
        return [torch.empty(NUM_TOKENS, HIDDEN, dtype=self.dtype),  # input
                torch.empty(HIDDEN, dtype=self.dtype),              # weight
                torch.empty(1, dtype=torch.float32)]                # scale

    def register(self, pm_pass: PatternMatcherPass) -> None:
        # plain functions, not bound methods: the matcher reads the argument names off them
        norm, quant, eps = rms_norm_ir, quant_fp8(self.custom_quant), self.epsilon

        def pattern(input: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            return quant(norm(input, weight, eps), scale)

        def replacement(input: torch.Tensor, weight: torch.Tensor,
                        scale: torch.Tensor) -> torch.Tensor:
            at = auto_functionalized(minivllm.rms_norm_static_fp8_quant.default,
                                     result=empty_quant(input.shape, input),
                                     input=input, weight=weight,
                                     scale=scale, epsilon=eps)
            return at[1]

        register(pattern, replacement, self.get_inputs(), pm_pass, norm_dtypes_match)


@dataclass(frozen=True)
class FusedAddRMSNormStaticQuantPattern:
    """(quant(norm(input + residual)), input + residual) -> fused_add_rms_norm_static_fp8_quant."""

    epsilon: float
    dtype: torch.dtype
    custom_quant: bool

    def get_inputs(self) -> list[torch.Tensor]:
        return [torch.empty(NUM_TOKENS, HIDDEN, dtype=self.dtype),  # input
                torch.empty(HIDDEN, dtype=self.dtype),              # weight
                torch.empty(NUM_TOKENS, HIDDEN, dtype=self.dtype),  # residual
                torch.empty(1, dtype=torch.float32)]                # scale

    def register(self, pm_pass: PatternMatcherPass) -> None:
        norm, quant, eps = fused_add_rms_norm_ir, quant_fp8(self.custom_quant), self.epsilon

        def pattern(input: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                    scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            normed, residual = norm(input, residual, weight, eps)
            # the new residual is returned: the next layer reads it, so it leaves the match
            return quant(normed, scale), residual

        def replacement(input: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                        scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            at = auto_functionalized(minivllm.fused_add_rms_norm_static_fp8_quant.default,
                                     result=empty_quant(input.shape, input), input=input,
                                     residual=residual, weight=weight, scale=scale, epsilon=eps)
            return at[1], at[2]  # result, residual

        register(pattern, replacement, self.get_inputs(), pm_pass, norm_dtypes_match)


class RMSNormQuantFusionPass(VllmPatternMatcherPass):
    def __init__(self, pass_config=None, records=None):
        super().__init__(pass_config, records)
        self.patterns = PatternMatcherPass(pass_name="rmsnorm_quant_fusion_pass")
        self.registered: set[tuple[float, torch.dtype]] = set()  # (eps, dtype) registered so far

    @enable_fake_mode
    def register_patterns(self, epsilon: float, dtype: torch.dtype) -> None:
        # the IR norm + custom quant holds no cast, so it fits any dtype: register it once per eps
        # (the plain-torch quant casts its input to fp32, so that one does not)
        first_for_eps = not any(e == epsilon for e, _ in self.registered)
        for custom_quant in (True, False):
            if custom_quant and not first_for_eps:
                continue
            FusedAddRMSNormStaticQuantPattern(epsilon, dtype, custom_quant).register(self.patterns)
            RMSNormStaticQuantPattern(epsilon, dtype, custom_quant).register(self.patterns)
        self.registered.add((epsilon, dtype))
        logger.debug("RMSNormQuantFusionPass: registered patterns for eps=%g, %s", epsilon, dtype)

    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        for eps in sorted(find_rms_norm_eps(graph)):
            for dtype in sorted(find_model_dtypes(graph), key=str):
                if (eps, dtype) not in self.registered:
                    self.register_patterns(eps, dtype)
        self.record_matches(self.patterns.apply(graph))

    def uuid(self) -> str:
        # the class alone would miss the patterns and the forms they are traced from
        return VllmInductorPass.hash_source(
            self, RMSNormStaticQuantPattern, FusedAddRMSNormStaticQuantPattern, rms_norm_ir,
            fused_add_rms_norm_ir, quant_fp8_custom,
            quant_fp8_native, find_rms_norm_eps, find_model_dtypes, norm_dtypes_match,
            register, empty_quant)
