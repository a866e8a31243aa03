"""Every Triton kernel against its reference on one small, awkward input (hidden sizes that are not
powers of two, uneven varlen batches). The tour runs it (python -m
minivllm_compile.kernels.selfcheck); on CPU it needs TRITON_INTERPRET=1 in the environment before
torch is imported (torch's import already imports triton, which then keeps
its interpreter setting)."""

from __future__ import annotations

from typing import Callable

import torch

from minivllm_compile.kernels import activation, causal_conv1d, layernorm, qk_norm_rope
from minivllm_compile.kernels import rotary_embedding as rope

# (rtol, atol): bf16 keeps 8 bits of mantissa, so one rounding step apart is 2**-8 relative
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}


def _cases(dtype: torch.dtype, device: str) -> dict[str, Callable[[bool], list[torch.Tensor]]]:
    """name -> run(use_triton) returning every tensor the kernel writes."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    T, H, nq, nkv, hd = 7, 200, 3, 1, 48
    x, res, w = rand(T, H), rand(T, H), rand(H)
    gate_up = rand(T, 2 * 136)
    pos = torch.tensor([5, 0, 3, 9, 1, 2, 30], device=device)
    cache = rope.compute_cos_sin_cache(hd, 64).to(device=device, dtype=dtype)
    qkv = rand(T, (nq + 2 * nkv) * hd)
    qw, kw = rand(hd), rand(hd)
    dim, width, lens = 100, 4, [1, 7, 3]
    qsl = torch.tensor([0, 1, 8, 11], dtype=torch.int32, device=device)
    cx, cw = rand(dim, sum(lens)), rand(dim, width)
    states = rand(len(lens), dim, width - 1)
    init = torch.tensor([False, True, True], device=device)
    dx = rand(len(lens), dim)

    def pick(mod, ref_name: str, triton: bool):
        # the conv kernels keep vLLM's names (causal_conv1d_fn); the others are <op>_triton
        triton_name = ref_name.removesuffix("_ref") + ("" if ref_name.startswith("causal")
                                                       else "_triton")
        return getattr(mod, triton_name if triton else ref_name)

    def rms(t):
        out = torch.empty_like(x)
        pick(layernorm, "rms_norm_ref", t)(out, x, w, 1e-5)
        return [out]

    def add_rms(t):
        a, b = x.clone(), res.clone()
        pick(layernorm, "fused_add_rms_norm_ref", t)(a, b, w, 1e-5)
        return [a, b]

    def rotary(neox):
        def run(t):
            q, k = x[:, : nq * hd].clone(), res[:, : nkv * hd].clone()
            pick(rope, "rotary_embedding_ref", t)(pos, q, k, hd, cache, neox)
            return [q, k]
        return run

    def silu(t):
        out = torch.empty(T, 136, device=device, dtype=dtype)
        pick(activation, "silu_and_mul_ref", t)(out, gate_up)
        return [out]

    def qk_rope(t):
        z = qkv.clone()
        pick(qk_norm_rope, "fused_qk_norm_rope_ref", t)(z, nq, nkv, nkv, hd, 1e-5, qw, kw,
                                                        cache, True, pos)
        return [z]

    def conv_fn(t):
        s = states.clone()
        out = pick(causal_conv1d, "causal_conv1d_fn_ref", t)(cx, cw, None, s, qsl,
                                                             has_initial_state=init)
        return [out, s]

    def conv_update(t):
        s = states.clone()
        out = pick(causal_conv1d, "causal_conv1d_update_ref", t)(dx, s, cw, None, "silu")
        return [out, s]

    return {"rms_norm": rms, "fused_add_rms_norm": add_rms, "rotary_embedding (NeoX)": rotary(True),
            "rotary_embedding (GPT-J)": rotary(False), "silu_and_mul": silu,
            "fused_qk_norm_rope": qk_rope, "causal_conv1d_fn": conv_fn,
            "causal_conv1d_update": conv_update}


def check_all_kernels(device: str = "cpu", dtypes=(torch.float32, torch.bfloat16)) -> list[dict]:
    """One row per (kernel, dtype): the largest difference between Triton and reference outputs,
    and whether every element is within rtol * |reference| + atol."""
    rows = []
    for dtype in dtypes:
        rtol, atol = TOLERANCE[dtype]
        for name, run in _cases(dtype, device).items():
            pairs = [(a.float(), b.float()) for a, b in zip(run(True), run(False))]
            rows.append({"kernel": name, "dtype": str(dtype).replace("torch.", ""),
                         "max_abs_diff": max((a - b).abs().max().item() for a, b in pairs),
                         "rtol": rtol, "atol": atol,
                         "ok": all(torch.allclose(a, b, rtol=rtol, atol=atol) for a, b in pairs)})
    return rows


def main() -> int:
    """Print the check as a table; exit status 1 if any kernel is off."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = check_all_kernels(device)
    for r in rows:
        print(f"{r['kernel']:<26} {r['dtype']:<9} max |triton - ref| = {r['max_abs_diff']:.2e}  "
              f"{'ok' if r['ok'] else 'MISMATCH'}")
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} of {len(rows)} kernel checks passed")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
