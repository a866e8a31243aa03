"""Make the tiny-llama-fp8 checkpoint: tiny-llama with FP8 (e4m3fn) weights and static per-tensor
activation scales, in the layout llm-compressor / AutoFP8 write and vLLM's Fp8Config loads.

    python scripts/quantize_fp8.py          (about a minute on one CPU core)

1. Calibrate: run held-out text of the kind the model was trained on (the standard library's
   source, the last 200,000 bytes of the corpus scripts/train_tiny.py reads, which training kept
   for validation) through the fp32 model, recording the largest |input| each decoder linear sees.
2. Quantize each Hugging Face linear on its own (q, k, v, o, gate, up, down of every layer):
   weight_scale = max|W| / 448, input_scale = max|x| / 448 (448: e4m3fn's largest value), and
   weight_fp8 = fp8(W / weight_scale). q, k and v see one input, so their input_scale is one;
   their weight scales differ, and the loader requantizes them to the largest (as vLLM does).
   The embedding, the norms and lm_head stay fp32, as vLLM leaves them.
3. Write model.safetensors and config.json (with its quantization_config block), copy tiny-llama's
   training log and loss curve (the same training), and record in quantization_log.json how the
   checkpoint was made and how closely it follows the fp32 model (models.quant.measure_agreement).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from minivllm_compile.kernels.quant_fp8 import FP8_MAX, static_scaled_fp8_quant_native
from minivllm_compile.models import CHECKPOINTS, load_model
from minivllm_compile.models.quant import QUANTIZED_LINEARS, SHARDS, measure_agreement
from minivllm_compile.tour import PROMPTS

ROOT = Path(__file__).resolve().parents[1]
QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "static",
                       "ignored_layers": ["lm_head"]}


def calibration_text(num_seqs: int, seq_len: int) -> torch.Tensor:
    """num_seqs windows of seq_len bytes from the corpus tail that training held out."""
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "scripts" / "train_tiny.py")
    train_tiny = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_tiny)
    val = train_tiny.load_corpus(12_000_000)[-200_000:]  # train_tiny.py's defaults
    starts = torch.randint(0, len(val) - seq_len, (num_seqs,),
                           generator=torch.Generator().manual_seed(2))
    return torch.stack([val[s:s + seq_len] for s in starts.tolist()])


@torch.no_grad()
def input_absmax(lm, batches: torch.Tensor) -> dict[str, float]:
    """Largest |input| of every quantized linear over the calibration batches, by module name."""
    seen: dict[str, float] = {}
    hooks = []
    for name, m in lm.model.named_modules():
        if name.rsplit(".", 1)[-1] in QUANTIZED_LINEARS:
            def hook(mod, args, name=name):
                seen[name] = max(seen.get(name, 0.0), args[0].abs().max().item())
            hooks.append(m.register_forward_pre_hook(hook))
    for ids in batches:
        lm(ids, torch.arange(len(ids)))
    for h in hooks:
        h.remove()
    return seen


def quantize(tensors: dict[str, torch.Tensor], absmax: dict[str, float]) -> tuple[dict, dict]:
    """The FP8 checkpoint's tensors, and each quantized linear's scales (for the log)."""
    out, scales = {}, {}
    for name, t in tensors.items():
        layer, _, leaf = name.rpartition(".")  # model.layers.0.self_attn.q_proj, weight
        hf_linear = layer.rsplit(".", 1)[-1]
        ours = next((o for o, shards in SHARDS.items() if hf_linear in shards), hf_linear)
        if (leaf != "weight" or ours not in QUANTIZED_LINEARS
            or not layer.startswith("model.layers.")):
            out[name] = t
            continue
        x_max = absmax[f"{layer.rsplit('.', 1)[0].removeprefix('model.')}.{ours}"]
        w_scale = (t.abs().max().float() / FP8_MAX).reshape(())
        x_scale = torch.tensor(x_max / FP8_MAX, dtype=torch.float32)
        out[name] = static_scaled_fp8_quant_native(t, w_scale)
        out[f"{layer}.weight_scale"], out[f"{layer}.input_scale"] = w_scale, x_scale
        scales[layer] = {"weight_scale": w_scale.item(), "input_scale": x_scale.item(),
                         "input_absmax": x_max}
    return out, scales


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--out", type=Path, default=CHECKPOINTS / "tiny-llama-fp8")
    args = ap.parse_args()
    torch.manual_seed(0)
    t0 = time.perf_counter()
    src = CHECKPOINTS / "tiny-llama"
    lm = load_model("tiny-llama")
    absmax = input_absmax(lm, calibration_text(args.num_seqs, args.seq_len))
    tensors, scales = quantize(load_file(str(src / "model.safetensors")), absmax)

    args.out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(args.out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = QUANTIZATION_CONFIG
    (args.out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in ("training_log.json", "loss.png"):
        shutil.copy(src / f, args.out / f)

    agreement = measure_agreement(lm, load_model(args.out), PROMPTS, args.max_new_tokens)
    log = {
        "made_by": "scripts/quantize_fp8.py",
        "source": "tiny-llama",
        "torch": torch.__version__,
        "scheme": "FP8 e4m3fn weights and activations, static per-tensor "
                  "scales (scale = absmax / 448)",
        "quantized": "every decoder layer's q/k/v/o/gate/up/down_proj; "
                     "embedding, norms, lm_head stay fp32",
        "calibration": {"text": "held-out tail (last 200,000 bytes) of "
                                "train_tiny.py's stdlib corpus",
                        "sequences": args.num_seqs, "seq_len": args.seq_len},
        "agreement_with_fp32": {"prompts": PROMPTS, **agreement},
        "scales": scales,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    (args.out / "quantization_log.json").write_text(json.dumps(log, indent=1) + "\n")
    size = (args.out / "model.safetensors").stat().st_size
    print(f"wrote {args.out} ({size / 2**20:.2f} MiB safetensors, fp32 was "
          f"{(src / 'model.safetensors').stat().st_size / 2**20:.2f} MiB)")
    print(json.dumps(agreement, indent=1))


if __name__ == "__main__":
    main()
