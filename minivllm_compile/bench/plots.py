"""One PNG per benchmark of bench.json (matplotlib Agg, dpi 80): medians
with min..max error bars."""

from __future__ import annotations

from pathlib import Path


def _bars(ax, labels: list[str], stats: list[dict], ylabel: str) -> None:
    med = [s["median"] for s in stats]
    err = [[m - s["min"] for m, s in zip(med, stats)], [s["max"] - m for m, s in zip(med, stats)]]
    ax.bar(range(len(labels)), med, yerr=err, capsize=3, color="tab:blue")
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)


def plot_all(res: dict, out: Path) -> dict[str, str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = {}

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=80)
        plt.close(fig)
        written[name] = f"{name}.png"

    if "per_call_us" in res.get("overhead", {}):
        o = res["overhead"]["per_call_us"]
        fig, ax = plt.subplots(figsize=(7, 4))
        for name, by_n in o.items():
            ns = sorted(by_n, key=int)
            med = [by_n[n]["median"] for n in ns]
            err = [[m - by_n[n]["min"] for m, n in zip(med, ns)],
                   [by_n[n]["max"] - m for m, n in zip(med, ns)]]
            ax.errorbar([int(n) for n in ns], med, yerr=err, marker="o", capsize=3, label=name)
        ax.set_xlabel("num_tokens")
        ax.set_ylabel("µs per call (median, min..max)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        ax.set_title("per-call overhead")
        save(fig, "overhead")
    if "startup" in res and "runs" in res["startup"]:
        s = res["startup"]
        fig, ax = plt.subplots(figsize=(5, 4))
        keys = list(s["runs"])
        _bars(ax, keys, [{"median": s["median_s"][k], "min": s["min_max_s"][k][0],
                          "max": s["min_max_s"][k][1]}
                         for k in keys], "first call, s")
        ax.set_title(f"start-up (AOT load {s['aot_speedup_vs_cold']:.1f}x faster than cold)")
        save(fig, "startup")
    if "on" in res.get("fix_functionalization", {}):
        f = res["fix_functionalization"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 4))
        keys = ["buffers", "generated_kernels", "copy_kernels", "extern_calls", "op_calls",
                "copy_calls"]
        for i, on in enumerate(("on", "off")):
            a1.bar([k + i * 0.4 for k in range(len(keys))], [f[on]["code"][k] for k in keys],
                   width=0.4, label=on)
        a1.set_xticks(range(len(keys)), keys, rotation=30, ha="right", fontsize=8)
        a1.legend(title="FixFunctionalization")
        a1.set_title(f"generated code at {f['num_tokens']} tokens")
        _bars(a2, ["on", "off"], [f["on"]["step_us"], f["off"]["step_us"]], "step µs")
        a2.set_title("step latency")
        save(fig, "fix_functionalization")
    if "by_layers" in res.get("compile_scaling", {}):
        c = res["compile_scaling"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 4))
        _bars(a1, [str(p["layers"]) for p in c["by_layers"]], [p["wall_s"] for p in c["by_layers"]],
              "cold compile s")
        a1.set_xlabel("layers")
        for p, x in zip(c["by_layers"], range(len(c["by_layers"]))):
            a1.annotate(f"{p['num_unique_compiles']} ind.", (x, p["wall_s"]["median"]),
                        ha="center", fontsize=7)
        pts = c["by_sizes_2_layers"]
        _bars(a2, [f"s{p['sizes']} e{p['endpoints']}" for p in pts], [p["wall_s"] for p in pts],
              "cold compile s")
        for x, p in enumerate(pts):
            a2.annotate(f"{p['num_unique_compiles']} ind.", (x, p["wall_s"]["median"]),
                        ha="center", fontsize=7)
        save(fig, "compile_scaling")
    if "modes" in res.get("generate", {}):
        g = res["generate"]["modes"]
        fig, axes = plt.subplots(1, 2, figsize=(8, 4))
        for ax, key in zip(axes, ("prefill_tok_s", "decode_tok_s")):
            _bars(ax, list(g), [v[key] for v in g.values()], key.replace("_", " "))
        save(fig, "generate")
    if "modes" in res.get("cuda_graphs", {}):
        ran = {k: v for k, v in res["cuda_graphs"]["modes"].items() if "step_us" in v}
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 4))
        _bars(a1, list(ran), [v["step_us"] for v in ran.values()], "decode step µs")
        a2.bar(range(len(ran)), [v["launches_per_step"]["total"] for v in ran.values()],
               color="tab:orange")
        a2.set_xticks(range(len(ran)), list(ran), rotation=30, ha="right", fontsize=8)
        a2.set_ylabel(next(iter(ran.values()))["launches_per_step"]["what"] if ran
                      else "", fontsize=7)
        a1.set_title(f"CUDA-graph modes on {res['cuda_graphs']['config']['device']}")
        save(fig, "cuda_graphs")
    if "ratios_vs_native" in res.get("ir_priority", {}):
        r = res["ir_priority"]
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(8, 4))
        names = r["priorities"]
        _bars(a1, names, [r[p]["step_us"] for p in names],
              f"decode step µs ({r['num_tokens']} tokens)")
        a2.bar(range(len(names)), [r[p]["compile_s"] for p in names], color="tab:orange")
        a2.set_xticks(range(len(names)), names)
        a2.set_ylabel("compile s (warm-up)")
        a1.set_title("vLLM IR priority")
        save(fig, "ir_priority")
    return written
