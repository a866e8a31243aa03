"""Load Hugging Face Llama-layout weights, stacking q/k/v and gate/up as vLLM's load_weights does.

An FP8 checkpoint (llm-compressor / AutoFP8 layout) holds, beside each quantized linear's
float8_e4m3fn `weight`, a float32 scalar `weight_scale` and `input_scale`; a stacked layer
(qkv_proj, gate_up_proj) takes one of each per shard (models/quant.py, Fp8Linear)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

SCALES = (".weight_scale", ".input_scale")  # per-tensor FP8 scales: one scalar per shard

# checkpoint name piece -> (our name piece, which shard of the stacked tensor)
STACKED = {
    ".q_proj.": (".qkv_proj.", 0),
    ".k_proj.": (".qkv_proj.", 1),
    ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


def _shard_rows(module_params: dict[str, torch.Tensor], name: str, cfg) -> list[int]:
    """Row counts of the shards stacked into one of our tensors."""
    if ".qkv_proj." in name:
        q = cfg.num_attention_heads * cfg.head_dim
        kv = cfg.num_key_value_heads * cfg.head_dim
        return [q, kv, kv]
    half = module_params[name].shape[0] // 2
    return [half, half]


def expected_checkpoint(params: dict[str, torch.Tensor],
                        cfg) -> dict[str, tuple[str, slice | None, tuple]]:
    """Every tensor a checkpoint must hold: its name -> (our parameter, row slice, shape)."""
    spec: dict[str, tuple[str, slice | None, tuple]] = {}
    for name, p in params.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stacked = [(ck, ours, i) for ck, (ours, i) in STACKED.items() if ours in name]
        if stacked and name.endswith(SCALES):  # one scalar per shard, into slot i of ours
            for ck, ours, i in stacked:
                spec[name.replace(ours, ck)] = (name, slice(i, i + 1), ())
        elif stacked:
            rows = _shard_rows(params, name, cfg)
            for ck, ours, i in stacked:
                start = sum(rows[:i])
                spec[name.replace(ours, ck)] = (name, slice(start, start + rows[i]),
                                                (rows[i], p.shape[1]))
        elif name.endswith(SCALES):
            spec[name] = (name, None, ())
        # nn.Conv1d stores the depthwise kernel [dim, 1, width]
        elif name.endswith(".conv.conv_weight"):
            spec[name.replace(".conv.conv_weight", ".conv.conv.weight")] = (
                name, None, (p.shape[0], 1, p.shape[1]))
        else:
            spec[name] = (name, None, tuple(p.shape))
    return spec


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors; a damaged file is refused naming it and saying what is wrong (the
    safetensors library's own message names neither the file nor, often, the damage)."""
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as e:  # OSError: reading or mapping the file
        try:
            damage = _safetensors_damage(path) or str(e)
        except OSError:
            damage = str(e)
        raise ValueError(f"{path} is not a readable safetensors file: {damage}. Copy or download "
                         "it again, or save it again with safetensors.torch.save_file") from None


def _safetensors_damage(path: Path) -> str | None:
    """What is wrong with a file that does not load, read from its layout: an 8-byte little-endian
    header length, a JSON header, then the tensor data the header's data_offsets cover."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        first = f.read(8)
        if len(first) < 8:
            return f"it holds {size} bytes, fewer than the 8 that give the header's length"
        n = int.from_bytes(first, "little")
        if n > size - 8:
            return (f"its first 8 bytes give a header of {n} bytes but only {size - 8} follow: the "
                    "file is cut short, or was never a safetensors file")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            return f"its {n}-byte header is not valid JSON ({e})"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    spans = [v.get("data_offsets") for k, v in header.items()
             if k != "__metadata__" and isinstance(v, dict)]
    ends = [s[1] for s in spans if isinstance(s, list) and len(s) == 2 and isinstance(s[1], int)]
    data = size - 8 - n
    if ends and max(ends) > data:
        return (f"its header lists {max(ends)} bytes of tensor data but the file holds {data}: it "
                "is truncated (an interrupted download or copy?)")
    if ends and max(ends) < data:
        return f"it has {data - max(ends)} bytes after the last tensor its header lists"
    return None


def load_checkpoint_weights(model: nn.Module, lm_head: nn.Linear, cfg, path: str | Path) -> None:
    """Fill `model` (prefix "model.") and `lm_head` from model.safetensors; refuse a checkpoint
    with a missing, unexpected or mis-shaped tensor, naming it."""
    path = Path(path)
    tensors = read_safetensors(path)
    params = {f"model.{n}": p for n, p in model.named_parameters()}
    params["lm_head.weight"] = lm_head.weight
    spec = expected_checkpoint(params, cfg)
    missing = sorted(set(spec) - set(tensors))
    extra = sorted(set(tensors) - set(spec))
    if scales := [n for n in missing if n.endswith(SCALES)]:
        raise ValueError(f"{path}: the FP8 checkpoint has no tensor {scales[0]!r}"
                         + (f" (nor {len(scales) - 1} more scales)" if len(scales) > 1 else "")
                         + "; config.json's quantization_config asks for static FP8, which needs a "
                         "float32 weight_scale and input_scale beside each quantized weight")
    if missing or extra:
        raise ValueError(f"{path}: checkpoint does not fit a {cfg.model_type} model "
                         f"with {cfg.num_hidden_layers} layers: missing "
                         f"{missing[:5]}, unexpected {extra[:5]}")
    for ck_name, (ours, rows, shape) in spec.items():
        t = tensors[ck_name]
        if shape == () and t.numel() == 1 and t.dim() <= 1:
            t = t.reshape(())  # a per-tensor scale: writers store it as [] or [1]
        dst_dtype = params[ours].dtype
        if (dst_dtype == torch.float8_e4m3fn) != (t.dtype == torch.float8_e4m3fn):
            raise ValueError(f"{path}: tensor {ck_name!r} is {t.dtype} but the layer "
                             f"stores {dst_dtype} (config.json's quantization_config "
                             "and the weights disagree)")
        if tuple(t.shape) != shape:
            raise ValueError(f"{path}: tensor {ck_name!r} has shape {tuple(t.shape)}, expected "
                             f"{shape} (from config.json)")
        with torch.no_grad():
            dst = params[ours] if rows is None else params[ours][rows]
            dst.copy_(t.reshape(dst.shape))
    if cfg.tie_word_embeddings:
        lm_head.weight = model.embed_tokens.weight
    for module in model.modules():  # vLLM's loader does this too, once every weight is in
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()


# --- tensor parallelism: each rank's shard of the same checkpoint ---------------------------------
# (the single-process path above is unchanged; this one hands every whole checkpoint tensor to the
# parameter's weight_loader, which keeps this rank's rows or columns: vLLM's load_weights loop)

def tensor_digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Each tensor's dtype, shape and a SHA-256 of its bytes (a few ms for these checkpoints)."""
    out = {}
    for name, t in sorted(tensors.items()):
        raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        out[name] = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}:" \
            f"{hashlib.sha256(raw.tobytes()).hexdigest()[:16]}"
    return out


def load_checkpoint_shards(model: nn.Module, lm_head: nn.Module, cfg,
                           tensors: dict[str, torch.Tensor], source: str) -> None:
    """Fill a tensor-parallel `model` and `lm_head` with this rank's shard of `tensors` (a whole
    checkpoint, by Hugging Face names; `source` names it in errors). The same names are required as
    on one rank; each shape is checked by the layer against the whole, unsharded tensor."""
    from minivllm_compile.distributed import default_weight_loader
    from minivllm_compile.distributed.rank_check import check_same_on_all_ranks

    # every rank must shard the same checkpoint: else the all-reduces sum parts of two models
    check_same_on_all_ranks("checkpoint", {"config": dataclasses.asdict(cfg),
                                            "weights": tensor_digests(tensors)})
    params = {f"model.{n}": p for n, p in model.named_parameters()}
    params["lm_head.weight"] = lm_head.weight
    spec = expected_checkpoint(params, cfg)  # its names do not depend on the shapes
    missing, extra = sorted(set(spec) - set(tensors)), sorted(set(tensors) - set(spec))
    if missing or extra:
        raise ValueError(f"{source}: checkpoint does not fit a {cfg.model_type} model with "
                         f"{cfg.num_hidden_layers} layers: missing {missing[:5]}, "
                         f"unexpected {extra[:5]}")
    for ck_name, (ours, _, _) in spec.items():
        t, param = tensors[ck_name], params[ours]
        if ours.endswith(".conv.conv_weight") and t.dim() == 3 and t.shape[1] == 1:
            t = t[:, 0]  # nn.Conv1d's [dim, 1, width] -> ours [dim, width]
        stacked = [i for ck, (piece, i) in STACKED.items() if ck in ck_name and piece in ours]
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            with torch.no_grad():
                if stacked:  # q/k/v by letter (vLLM's QKVParallelLinear), gate/up by index
                    loader(param, t, "qkv"[stacked[0]] if ".qkv_proj." in ours else stacked[0])
                else:
                    loader(param, t)
        except ValueError as e:
            raise ValueError(f"{source}: tensor {ck_name!r}: {e}") from None
    if cfg.tie_word_embeddings:
        lm_head.weight = model.embed_tokens.weight


def checkpoint_tensors(model: nn.Module, lm_head: nn.Module, cfg) -> dict[str, torch.Tensor]:
    """The checkpoint a single-process model would load, from its parameters (the inverse of
    load_checkpoint_weights): by Hugging Face names, q/k/v and gate/up unstacked."""
    params = {f"model.{n}": p for n, p in model.named_parameters()}
    params["lm_head.weight"] = lm_head.weight
    out = {}
    for ck_name, (ours, rows, shape) in expected_checkpoint(params, cfg).items():
        t = params[ours].detach()
        out[ck_name] = (t if rows is None else t[rows]).reshape(shape).clone()
    return out
