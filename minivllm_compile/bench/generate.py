"""generate() tokens per second, prefill and decode, for every mode (`--only generate`)."""

from __future__ import annotations

import os
import time

import torch

from minivllm_compile.bench.common import M, build, clear_dynamo_cache, set_threads, stats, sync


def bench_generate(q: bool) -> dict:
    from minivllm_compile.models.tokenizer import ByteTokenizer

    set_threads(os.cpu_count() or 1)
    nprompt, plen, steps, reps = (2, 8, 4, 2) if q else (4, 32, 32, 5)
    base = "The quick brown fox jumps over the lazy dog. " * 4
    prompts = [(str(i) + base)[:plen] for i in range(nprompt)]
    plen = len(ByteTokenizer().encode(prompts[0]))
    be = "eager" if q else "inductor"
    # compiled modes with custom_ops=["none"], vLLM's default with Inductor: Inductor gets the
    # plain-torch layers to fuse; "vllm_compile_custom_ops" keeps the opaque ops, for comparison
    native = {"custom_ops": ["none"]}
    variants = {"eager": build(M.NONE, 2, max_tokens=256),
                "dynamo_trace_once": build(M.DYNAMO_TRACE_ONCE, 2, backend=be,
                                           max_tokens=256, **native),
                "vllm_compile": build(M.VLLM_COMPILE, 2, backend=be, max_tokens=256,
                                      compile_sizes=[nprompt],
                                      **native),
                "vllm_compile_custom_ops": build(M.VLLM_COMPILE, 2, backend=be, max_tokens=256,
                                                 compile_sizes=[nprompt])}
    clear_dynamo_cache()  # stock is then the only model entering Dynamo (the others use the hook)
    variants["stock"] = build(M.STOCK_TORCH_COMPILE, 2, backend=be, max_tokens=256, **native)
    steps_log: dict = {}
    for name, lm in variants.items():
        inner = lm.forward_step

        def timed(ids, pos, md, inner=inner, name=name):
            sync()
            t0 = time.perf_counter()
            out = inner(ids, pos, md)
            sync()
            steps_log[name].append((ids.numel(), time.perf_counter() - t0))
            return out

        lm.forward_step = timed  # the step itself, inside the real generate() loop
        for _ in range(2):  # warm up: stock compiles its prefill and decode shapes here
            steps_log[name] = []
            lm.generate(prompts, steps)
    samples = {k: {"prefill": [], "decode": [], "e2e": [], "new_tokens": []} for k in variants}
    for r in range(reps):
        k = r % len(variants)
        for name in list(variants)[k:] + list(variants)[:k]:
            steps_log[name] = []
            t0 = time.perf_counter()
            variants[name].generate(prompts, steps)
            wall = time.perf_counter() - t0
            log = steps_log[name]
            s = samples[name]
            s["prefill"].append(log[0][0] / log[0][1])
            dec = log[1:]
            s["decode"].append(sum(t for t, _ in dec) / sum(x for _, x in dec) if dec
                               else float("nan"))
            new = sum(t for t, _ in dec) + nprompt  # the prefill samples one token per sequence
            s["e2e"].append(new / wall)
            s["new_tokens"].append(new)
    res = {k: {"prefill_tok_s": stats(v["prefill"]), "decode_tok_s": stats(v["decode"]),
               "generate_new_tok_s": stats(v["e2e"]), "new_tokens": v["new_tokens"][0]}
           for k, v in samples.items()}
    d = {k: v["decode_tok_s"]["median"] for k, v in res.items()}
    return {"config": {"prompts": nprompt, "prompt_tokens": plen, "max_new_tokens": steps,
                       "repeats": reps,
                       "backend": be, "vllm_compile_sizes": [nprompt],
                       "threads": torch.get_num_threads()},
            "custom_ops": {"compiled modes": ["none"],
                           "eager and vllm_compile_custom_ops": ["all"]},
            "modes": res, "decode_ratio_vllm_vs_eager": d["vllm_compile"] / d["eager"],
            "decode_ratio_vllm_vs_stock": d["vllm_compile"] / d["stock"],
            # the same ratios round by round (the modes run back to back in each round): their
            # spread says whether a ratio near 1 is a difference or a tie
            "decode_ratio_per_round": {
                other: stats([v / o for v, o in zip(samples["vllm_compile"]["decode"],
                                                    samples[other]["decode"])])
                for other in ("eager", "stock")}}
