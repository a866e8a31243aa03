"""Train the tiny checkpoints that ship inside the package, on text every Python install has: the
standard library's own source files, read as bytes.

    python scripts/train_tiny.py --arch llama &
    python scripts/train_tiny.py --arch hybrid

(1000 steps each on one core each, so both train at once on a 2-core machine; --minutes caps the
wall time, 28 by default)

The model here is plain, differentiable torch (autograd cannot run through the in-place custom ops
the inference models use). It stores weights under Hugging Face Llama names, so the inference
model in minivllm_compile.models loads it, and tests check the two agree, and that transformers'
LlamaForCausalLM agrees with ours on the Llama checkpoint.
"""

from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from minivllm_compile.models.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, VOCAB_SIZE

CHECKPOINTS = Path(__file__).resolve().parents[1] / "minivllm_compile" / "models" / "checkpoints"

SIZES = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=1024,
)


def make_config(arch: str) -> dict:
    cfg = dict(SIZES, bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID,
               tie_word_embeddings=False, hidden_act="silu", attention_bias=False,
               mlp_bias=False, torch_dtype="float32")
    if arch == "llama":
        cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    else:
        # LFM2-like: short-conv mixers with a few attention layers (with per-head q/k norm)
        cfg.update(model_type="minivllm_hybrid", architectures=["MiniHybridForCausalLM"],
                   layer_types=["conv", "full_attention", "conv", "full_attention"],
                   conv_L_cache=3)
    return cfg


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x, cos, sin):  # NeoX style (rotate halves), as HF Llama
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, c, qk_norm: bool):
        super().__init__()
        self.nh, self.nkv, self.hd = (c["num_attention_heads"],
                                      c["num_key_value_heads"], c["head_dim"])
        h = c["hidden_size"]
        self.q_proj = nn.Linear(h, self.nh * self.hd, bias=False)
        self.k_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.v_proj = nn.Linear(h, self.nkv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.nh * self.hd, h, bias=False)
        if qk_norm:
            self.q_norm = RMSNorm(self.hd, c["rms_norm_eps"])
            self.k_norm = RMSNorm(self.hd, c["rms_norm_eps"])
        self.qk_norm = qk_norm

    def forward(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.nh, self.hd)
        k = self.k_proj(x).view(b, t, self.nkv, self.hd)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class ShortConv(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, self.L = c["hidden_size"], c["conv_L_cache"]
        self.in_proj = nn.Linear(h, 3 * h, bias=False)
        self.conv = nn.Conv1d(h, h, self.L, groups=h, bias=False, padding=self.L - 1)
        self.out_proj = nn.Linear(h, h, bias=False)

    def forward(self, x, cos, sin):
        b_gate, c_gate, xx = self.in_proj(x).transpose(1, 2).chunk(3, dim=1)
        y = self.conv(b_gate * xx)[..., : x.shape[1]]  # causal: drop the right padding
        return self.out_proj((c_gate * y).transpose(1, 2))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, i = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c, kind: str):
        super().__init__()
        if kind == "conv":
            self.conv = ShortConv(c)
        else:
            self.self_attn = Attention(c, qk_norm=c["model_type"] != "llama")
        self.mixer = self.conv if kind == "conv" else self.self_attn
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = MLP(c)

    def forward(self, x, cos, sin):
        x = x + self.mixer(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TrainLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        kinds = c.get("layer_types", ["full_attention"] * c["num_hidden_layers"])
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.model.layers = nn.ModuleList(Layer(c, k) for k in kinds)
        self.model.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        hd = c["head_dim"]
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2).float() / hd))
        freqs = torch.outer(torch.arange(c["max_position_embeddings"]).float(), inv)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, ids):
        t = ids.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


def load_corpus(max_bytes: int) -> torch.Tensor:
    """The standard library's .py files, in a fixed order, each wrapped in BOS ... EOS."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    ids: list[int] = []
    for path in sorted(stdlib.glob("*.py")) + sorted(stdlib.glob("*/*.py")):
        if "test" in path.parts[-2:][0] or path.name.startswith("test"):
            continue
        ids += [BOS_TOKEN_ID, *path.read_bytes(), EOS_TOKEN_ID]
        if len(ids) >= max_bytes:
            break
    return torch.tensor(ids[:max_bytes], dtype=torch.long)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=["llama", "hybrid"], required=True)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--minutes", type=float, default=28.0, help="stop early at this wall time")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=24)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--corpus-bytes", type=int, default=12_000_000)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = make_config(args.arch)
    out = args.out or CHECKPOINTS / f"tiny-{args.arch}"
    data = load_corpus(args.corpus_bytes)
    n_val = 200_000
    train, val = data[:-n_val], data[-n_val:]
    model = TrainLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    print(f"{args.arch}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
          f"{len(train) / 1e6:.1f}M training bytes")

    def batch(src):
        starts = torch.randint(0, len(src) - args.seq_len - 1, (args.batch,))
        chunk = torch.stack([src[s : s + args.seq_len + 1] for s in starts.tolist()])
        return chunk[:, :-1], chunk[:, 1:]

    @torch.no_grad()
    def val_loss():
        g = torch.Generator().manual_seed(1)
        starts = torch.randint(0, len(val) - args.seq_len - 1, (16,), generator=g)
        chunk = torch.stack([val[s : s + args.seq_len + 1] for s in starts.tolist()])
        logits = model(chunk[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten()).item()

    budget, t0, step, history = args.minutes * 60, time.time(), 0, []
    warmup = 30
    # cosine schedule over whichever ends first, the steps or the time budget, so the run always
    # ends on a low learning rate (a busy machine gets fewer steps, not a half-finished schedule)
    while (frac := max(step / args.steps, (time.time() - t0) / budget)) < 1.0:
        elapsed = time.time() - t0
        lr = args.lr * min(1.0, (step + 1) / warmup) * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = batch(train)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0 or step == 1:
            entry = {"step": step, "seconds": round(elapsed, 1),
                     "train_loss": round(loss.item(), 4)}
            if step % 100 == 0:
                entry["val_loss"] = round(val_loss(), 4)
            history.append(entry)
            print(entry, flush=True)
    history.append({"step": step, "seconds": round(time.time() - t0, 1),
                    "val_loss": round(val_loss(), 4)})
    print(history[-1])

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()
             if k not in ("cos", "sin") and ".mixer." not in k}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "training_log.json").write_text(json.dumps(
        {"args": {k: str(v) for k, v in vars(args).items()}, "steps": step,
         "torch": torch.__version__, "history": history}, indent=1) + "\n")
    plot_loss(history, out / "loss.png", args.arch)
    print(f"saved {out}")


def plot_loss(history: list[dict], path: Path, arch: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(5, 3), dpi=80)
    tr = [h for h in history if "train_loss" in h]
    va = [h for h in history if "val_loss" in h]
    ax.plot([h["step"] for h in tr], [h["train_loss"] for h in tr], label="train")
    ax.plot([h["step"] for h in va], [h["val_loss"] for h in va], "o-", label="validation")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/byte)", title=f"tiny-{arch}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
