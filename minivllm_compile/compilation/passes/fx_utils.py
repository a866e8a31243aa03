"""Reading an FX graph, for the passes (vLLM's compilation/passes/fx_utils.py): the helpers more
than one pass uses, each kept once here. What a fusion pass registers its patterns for is read
from the graph it is given (its activation dtypes here, the eps of its IR norms in ir/utils.py),
since a pass is built from the PassConfig alone."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import fx

from minivllm_compile import ir

if TYPE_CHECKING:  # the pattern matcher imports Inductor's lowerings: not for a warm start
    import torch._inductor.pattern_matcher as pm

# activation dtypes the quant ops take (ops._QUANT_INPUT_DTYPES); a graph input of another float
# dtype (the fp8 weights) is no candidate
MODEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def is_func(node: fx.Node, target: Any) -> bool:
    return node.op == "call_function" and node.target == target


def find_model_dtypes(graph: fx.Graph) -> set[torch.dtype]:
    """The activation dtypes a pattern may need: those among the graph's inputs."""
    vals = (n.meta.get("val") for n in graph.find_nodes(op="placeholder"))
    return {v.dtype for v in vals if isinstance(v, torch.Tensor) and v.dtype in MODEL_DTYPES}


def norm_dtypes_match(match: pm.Match) -> bool:
    """The fused norm ops take input, residual and weight of one dtype (ops._check_like refuses
    others at run time); a plain-torch norm with, say, an fp32 weight on bf16 activations would
    still match, so refuse it here (vLLM's _rms_input_weight_dtype_match)."""
    vals = [match.kwargs[k].meta.get("val") for k in ("input", "residual", "weight")
            if isinstance(match.kwargs.get(k), fx.Node)]
    return len({v.dtype for v in vals if isinstance(v, torch.Tensor)}) <= 1


def rms_norm_ir(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The norm as the model's layers call it, the vLLM IR op: what the norm fusions match."""
    return ir.ops.rms_norm(x, weight, eps)  # AOTAutograd drops variance_size=None as well
