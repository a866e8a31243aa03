"""FP8 weights and activations with static per-tensor scales (vLLM's Fp8Config + Fp8LinearMethod).

A checkpoint in the layout llm-compressor / AutoFP8 write holds, beside each quantized linear's
``weight`` (float8_e4m3fn), two float32 scalars: ``weight_scale`` (weight ~ weight_fp8 *
weight_scale) and ``input_scale``, calibrated offline from the largest activation the linear saw
(scripts/quantize_fp8.py). config.json says so in its ``quantization_config`` block, the keys
vLLM's Fp8Config.from_config reads: ``{"quant_method": "fp8", "activation_scheme": "static"}``.

A quantized linear then runs, as vLLM's static per-tensor FP8 path does:

    x_fp8 = static_scaled_fp8_quant(x, input_scale)             the op the fusion passes match
    y     = (x_fp8 @ weight_fp8.T) * (input_scale * weight_scale)   in fp32, cast to x's dtype

The second line is ``torch._scaled_mm`` where it runs (probed once per device, see
``scaled_mm_runs``), else the same product spelled out: fp8 values are exact in fp32, so only the
order of the fp32 sums differs between the two.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from minivllm_compile.config import (
    CompilationConfig,
    CompilationMode,
    set_current_compilation_config,
)
from minivllm_compile.kernels.quant_fp8 import FP8_DTYPE, static_scaled_fp8_quant_native
from minivllm_compile.models.layers import use_custom_op

# The name `custom_ops` switches this op by (vLLM's QuantFP8 is CustomOp.register("quant_fp8")),
# listed in config.CUSTOM_OPS
CUSTOM_OP_NAME = "quant_fp8"
# the linears vLLM quantizes in a Llama decoder layer; the embedding and lm_head stay unquantized
QUANTIZED_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# the checkpoint (Hugging Face) names of the shards stacked into one of ours
SHARDS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass
class Fp8Config:
    """The ``quantization_config`` block of config.json, checked (vLLM's Fp8Config.from_config)."""

    activation_scheme: str = "static"
    ignored_layers: list[str] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: dict, source: str = "quantization_config") -> Fp8Config:
        if not isinstance(config, dict):
            raise ValueError(f"{source} must be a JSON object, got {type(config).__name__}")  # noqa: TRY004
        method = config.get("quant_method")
        if method != "fp8":
            raise ValueError(f"{source}: quant_method {method!r} is not supported; only 'fp8' "
                             "(static per-tensor FP8, as vLLM's Fp8Config) is")
        scheme = config.get("activation_scheme")
        if scheme != "static":
            raise ValueError(f"{source}: activation_scheme {scheme!r} is not "
                             "supported; only 'static' (input_scale calibrated offline "
                             "and stored beside each weight) is")
        if config.get("weight_block_size") is not None:
            raise ValueError(f"{source}: weight_block_size {config['weight_block_size']} (block "
                             "FP8) is not supported; only per-tensor scales are")
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
        return cls(activation_scheme=scheme, ignored_layers=list(ignored))


@functools.cache
def scaled_mm_runs(device: str) -> bool:
    """Whether torch._scaled_mm runs on `device` (torch's CPU build has it; a CUDA GPU needs FP8
    tensor cores, compute capability 8.9 or newer). Probed once, on 16x16 matrices (a GPU wants
    multiples of 16), for the two output dtypes a model here runs in."""
    try:
        a = torch.ones(16, 16, device=device).to(FP8_DTYPE)
        one = torch.ones(1, device=device)
        for dtype in (torch.float32, torch.bfloat16):
            torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=dtype)
        return True
    except (RuntimeError, NotImplementedError, TypeError):
        return False


class Fp8Linear(nn.Module):
    """A bias-free linear with an FP8 weight and static per-tensor scales.

    ``__init__`` is vLLM's create_weights, ``process_weights_after_loading`` its method of that
    name, ``forward`` its apply. A stacked linear (qkv_proj: q, k, v; gate_up_proj: gate, up)
    loads one weight_scale and one input_scale per shard; after loading they become one of each,
    the largest, and the shards quantized with a smaller weight_scale are requantized with it
    (vLLM's requantize_with_max_scale), since one matmul takes one scale."""

    def __init__(self, input_size: int, output_size: int, logical_widths: list[int] | None = None):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.logical_widths = list(logical_widths or [output_size])
        if sum(self.logical_widths) != output_size:
            raise ValueError(f"logical_widths {self.logical_widths} do not add up to {output_size}")
        n = len(self.logical_widths)
        self.weight = nn.Parameter(torch.zeros(output_size, input_size, dtype=FP8_DTYPE),
                                   requires_grad=False)
        self.weight_scale = nn.Parameter(torch.zeros(n), requires_grad=False)
        self.input_scale = nn.Parameter(torch.zeros(n), requires_grad=False)
        self.use_custom_op = use_custom_op(CUSTOM_OP_NAME)
        self.use_scaled_mm = scaled_mm_runs("cpu")

    def extra_repr(self) -> str:
        return (f"in={self.input_size}, out={self.output_size}, shards={self.logical_widths}, "
                f"quant={'custom op' if self.use_custom_op else 'native'}, "
                f"matmul={'_scaled_mm' if self.use_scaled_mm else 'dequantized fp32'}")

    @torch.no_grad()
    def process_weights_after_loading(self) -> None:
        ws, xs = self.weight_scale.data, self.input_scale.data
        bad = [i for i in range(len(ws)) if not (ws[i] > 0 and xs[i] > 0
                                                 and torch.isfinite(ws[i] + xs[i]))]
        if bad:
            raise ValueError(f"Fp8Linear: shard(s) {bad} have weight_scale "
                             f"{ws.tolist()} / input_scale {xs.tolist()}; every scale "
                             "must be a positive finite number")
        max_ws = ws.max()
        start = 0
        for width, s in zip(self.logical_widths, ws):
            if s != max_ws:  # dequantize this shard and quantize it again with the shared scale
                rows = self.weight.data[start:start + width]
                rows.copy_(static_scaled_fp8_quant_native(rows.float() * s, max_ws))
            start += width
        self.weight_scale = nn.Parameter(max_ws.reshape(1), requires_grad=False)
        # vLLM's choice too: the largest input scale clips no shard's activations (q, k and v see
        # one input, so their calibrated scales are equal anyway)
        self.input_scale = nn.Parameter(xs.max().reshape(1), requires_grad=False)

    def _apply(self, fn, recurse=True):
        # nn.Module.to(dtype) casts every floating-point tensor, fp8 weights and fp32 scales
        # included; move ours to the new device but keep their dtypes, then choose the matmul
        # for that device.
        mine = {n: self._parameters.pop(n) for n in ("weight", "weight_scale", "input_scale")}
        try:
            super()._apply(fn, recurse)
        finally:
            # where fn sends tensors
            device = fn(torch.empty(0, device=mine["weight"].device)).device
            for n, p in mine.items():
                self._parameters[n] = nn.Parameter(p.data.to(device), requires_grad=False)
        self.use_scaled_mm = scaled_mm_runs(str(device))
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.use_custom_op:
            xq = torch.empty(x2.shape, dtype=FP8_DTYPE, device=x.device)
            torch.ops.minivllm.static_scaled_fp8_quant(xq, x2, self.input_scale)
        else:
            xq = static_scaled_fp8_quant_native(x2, self.input_scale)
        if self.use_scaled_mm:
            out = torch._scaled_mm(xq, self.weight.t(), scale_a=self.input_scale,
                                   scale_b=self.weight_scale,
                                   out_dtype=x.dtype)
        else:
            out = ((xq.float() @ self.weight.float().t())
                   * (self.input_scale * self.weight_scale)).to(x.dtype)
        return out.view(*x.shape[:-1], self.output_size)


def _logical_widths(cfg, name: str, linear: nn.Linear) -> list[int]:
    if name == "qkv_proj":
        kv = cfg.num_key_value_heads * cfg.head_dim
        return [cfg.num_attention_heads * cfg.head_dim, kv, kv]
    if name == "gate_up_proj":
        return [linear.out_features // 2] * 2
    return [linear.out_features]


def _is_skipped(prefix: str, leaf: str, ignored: list[str]) -> bool:
    """vLLM's is_layer_skipped: a stacked layer is skipped when all its shards are listed."""
    names = [prefix] if leaf not in SHARDS else [f"{prefix.rsplit('.', 1)[0]}.{s}"
                                                 for s in SHARDS[leaf]]
    listed = [n in ignored for n in names]
    if any(listed) and not all(listed):
        raise ValueError(f"ignored_layers lists some but not all of {names}; they are stacked into "
                         f"one matmul ({prefix}), so quantize all of them or none")
    return all(listed) or prefix in ignored


def quantize_linears(model: nn.Module, cfg, compilation_config: CompilationConfig | None = None,
                     prefix: str = "model") -> list[str]:
    """Replace the decoder layers' qkv_proj, o_proj, gate_up_proj and down_proj with empty
    Fp8Linear layers for the loader to fill (vLLM picks Fp8LinearMethod per layer in
    Fp8Config.get_quant_method). Returns the replaced layers' names."""
    qcfg = Fp8Config.from_config(cfg.quantization_config)
    replaced = []
    with set_current_compilation_config(compilation_config
                                        or CompilationConfig(mode=CompilationMode.NONE)):
        for parent_name, parent in list(model.named_modules()):
            for leaf, child in list(parent.named_children()):
                name = f"{prefix}.{parent_name}.{leaf}" if parent_name else f"{prefix}.{leaf}"
                if (leaf not in QUANTIZED_LINEARS or not isinstance(child, nn.Linear)
                        or _is_skipped(name, leaf, qcfg.ignored_layers)):
                    continue
                if child.bias is not None:
                    raise ValueError(f"{name} has a bias; Fp8Linear is "
                                     "bias-free, as every linear here is")
                setattr(parent, leaf, Fp8Linear(child.in_features, child.out_features,
                                                _logical_widths(cfg, leaf, child)))
                replaced.append(name)
    return replaced


def measure_agreement(reference, quantized, prompts: list[str], max_new_tokens: int) -> dict:
    """How closely `quantized` (an LM) follows `reference` (another) on `prompts`, three ways:

    - top1_agreement: the reference's greedy continuation of each prompt is fed to both models
      (teacher forcing); the fraction of those positions where both models' argmax is the same
      token. One early difference cannot cascade here, unlike in free-running text.
    - logits_max_abs_diff / logits_mean_abs_diff: |logits difference| over the same positions and
      every vocabulary entry (the reference's logits there span logits_range).
    - identical_prefix: per prompt, how many tokens the two free-running greedy continuations
      share before their first difference (max_new_tokens where they are identical).
    """
    tok = reference.tokenizer
    same = total = n_logits = 0
    max_diff = sum_diff = 0.0
    lo, hi = float("inf"), float("-inf")
    prefixes = []
    for p in prompts:
        prompt_ids = tok.encode(p)
        # greedy, KV-cached (prefill, then one decode step per token), as ids: stops after EOS
        (ref_cont,) = reference.generate_ids([prompt_ids], max_new_tokens)
        (q_cont,) = quantized.generate_ids([prompt_ids], max_new_tokens)
        prefixes.append(next((i for i, (x, y) in enumerate(zip(ref_cont, q_cont)) if x != y),
                             min(len(ref_cont), len(q_cont))))
        ids = torch.tensor(prompt_ids + ref_cont, device=reference.device)
        pos = torch.arange(len(ids), device=reference.device)
        span = slice(len(prompt_ids) - 1, len(ids) - 1)  # the positions that predict ref_cont
        a, b = reference(ids, pos)[span].float(), quantized(ids, pos)[span].float()
        same += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
        d = (a - b).abs()
        max_diff, sum_diff, n_logits = (max(max_diff, d.max().item()), sum_diff + d.sum().item(),
                                        n_logits + d.numel())
        lo, hi = min(lo, a.min().item()), max(hi, a.max().item())
    return {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "positions": total,
            "top1_agreement": same / total,
            "logits_max_abs_diff": max_diff, "logits_mean_abs_diff": sum_diff / n_logits,
            "logits_range": [lo, hi], "identical_prefix": prefixes}
