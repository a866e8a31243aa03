"""One picture of the whole pipeline, with the numbers of a real compile in its boxes: decorator ->
wrapper -> Dynamo -> VllmBackend -> split_graph -> PiecewiseBackend -> Inductor -> post-grad
passes on the first call, and the runtime path of every later call. Plain matplotlib (no Graphviz).

    facts = pipeline_facts(lm.model, counters)     # what each stage did, read from the model
    png = draw_pipeline(lm.model, counters)        # the picture (PNG bytes; fmt="svg" for SVG)

`counters`, optional, is the change of `compilation_counter` over the compile (the counter's
clone from before it, or a dict of deltas such as `compilation_counter.since(before)`); the boxes
then show, beside what the objects hold, vLLM's name of each counter that moved."""

from __future__ import annotations

import io
import itertools
import operator
from dataclasses import dataclass, field
from typing import Any

import torch

# kind -> (fill, line)
COLOURS = {"python": ("#f3f3f3", "#777777"), "dynamo": ("#e9defa", "#7a4fbf"),
           "compile": ("#d6e6fb", "#3d6fb6"), "split": ("#ffe0bd", "#d9822b"),
           "runtime": ("#dcf3dc", "#3f8f3f")}


@dataclass
class Stage:
    name: str  # what runs: "Dynamo", "split_graph", ...
    where: str  # the module (under minivllm_compile/compilation/) that does it
    notebook: str  # where the notebooks open it, "02" or "03, 04"
    kind: str  # a COLOURS key
    lines: list[str] = field(default_factory=list)  # what it did in this compile
    column: int = 0  # 0: the first call (compile), 1: every later call


def _decorated(model: Any) -> torch.nn.Module:
    """The @support_torch_compile module: `lm.model` of a
    load_model/build_model result, or itself."""
    inner = getattr(model, "model", model)
    backend = getattr(inner, "backend", None)
    if backend is None or not hasattr(backend, "piecewise_backends"):
        raise ValueError("pipeline_facts needs a model built with CompilationMode.VLLM_COMPILE "
                         "(its backend is a VllmBackend)")
    if not backend.piecewise_backends:
        raise ValueError("the model has not compiled here: call it once first. (A model loaded "
                         "from an AOT artifact skips the backend: set "
                         "VLLM_DISABLE_COMPILE_CACHE=1 to see every stage.)")
    return inner


def _deltas(counters: Any) -> dict[str, int]:
    """The counters that moved: from a dict of deltas, or against the clone from before."""
    if counters is None:
        return {}
    if isinstance(counters, dict):
        return {k: v for k, v in counters.items() if v}
    from minivllm_compile.compilation.counter import compilation_counter

    return compilation_counter.since(counters)


def _ranges(rs: list) -> str:
    return ", ".join(f"{r.start}" if r.is_single_size() else f"{r.start}-{r.end}"
                     for r in rs) or "none"


def _op_names(gm: torch.fx.GraphModule) -> list[str]:
    names = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is not operator.getitem:
            name = str(n.target).removesuffix(".default")
            if name not in names:
                names.append(name)
    return names


def pipeline_facts(model: Any, counters: Any = None) -> list[Stage]:
    """What each stage of the pipeline did in this model's compile, read from the objects the
    compile left (the guard table, the backend's graphs, pieces and entries, the pass records)."""
    m = _decorated(model)
    cc, backend = m.compilation_config, m.backend
    d = _deltas(counters)

    def counted(name: str, value: int) -> str:
        return f"{value}  ({name} +{d[name]})" if name in d else f"{value}"

    dynamic = [f"{k}[{i}]" for k, s in getattr(m, "input_spec", {}).items()
               for i, n in enumerate(s.get("shape", [])) if n is None]
    stages = [Stage("@support_torch_compile", "decorators.py", "02", "python", [
        f"class {type(m).__name__}, mode {cc.mode.name}",
        f"mark_dynamic: {', '.join(dynamic) or 'none'}",
        "torch.compile(dynamic=False, fullgraph=True)",
        f"traced files: {len(cc.traced_files)}"])]

    guards = m.guard_table
    hook = "on: code captured" if m._compiled_bytecode is not None else \
        "AOT function (no hook)" if m.aot_compiled_fn is not None else "off: Dynamo every call"
    stages.append(Stage("TorchCompileWithNoGuardsWrapper", "wrapper.py", "03, 04", "python", [
        f"guards offered {len(guards)}, kept {sum(g.kept for g in guards)}",
        f"bytecode hook {hook}"]))

    gm = backend.graphs[0]
    syms = [n.name for n in gm.graph.nodes if n.op == "placeholder"
            and isinstance(n.meta.get("example_value"), torch.SymInt)]
    calls = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    dynamo = [f"graphs traced: {counted('num_graphs_seen', len(backend.graphs))}",
              f"FX graph: {len(calls)} nodes, SymInt inputs {', '.join(syms) or 'none'}"]
    if backend.dynamo_time_s is not None:
        dynamo.append(f"bytecode transform: {backend.dynamo_time_s:.2f} s")
    stages.append(Stage("Dynamo", "(torch._dynamo)", "02", "dynamo", dynamo))

    manager = backend.compiler_manager
    stages.append(Stage("VllmBackend", "backends.py", "07, 09", "compile", [
        f"compiler: {manager.compiler.name}",
        # left long (E501): a replacement field cannot span lines before Python 3.12
        f"compile cache: {'off' if backend.cache_dir is None else '.../' + '/'.join(backend.cache_dir.parts[-3:])}"]))  # noqa: E501

    items = backend.piecewise_graphs
    split = [it for it in items if it.is_splitting_graph]
    split_ops = []
    for it in split:
        split_ops += [o for o in _op_names(it.graph) if o not in split_ops]
    stages.append(Stage("split_graph", "backends.py, partition_rules.py", "06", "split", [
        f"pieces: {counted('num_piecewise_graphs_seen', len(items))}",
        (f"to compile: {counted('num_piecewise_capturable_graphs_seen', len(items) - len(split))}, "
         f"splitting: {len(split)}"),
        f"splitting ops: {', '.join(split_ops) or 'none'}"]))

    pieces = backend.piecewise_backends
    entries = list(pieces[0].range_entries)
    sizes = [r for r in entries if r.is_single_size()]
    ranges = [r for r in entries if not r.is_single_size()]
    stages.append(Stage(f"PiecewiseBackend x {len(pieces)}", "piecewise_backend.py",
                        "07", "compile", [
        f"compile sizes: {_ranges(sizes)} (static kernels)",
        f"compile ranges: {_ranges(ranges)} (dynamic)",
        (f"compilations: {len(pieces)} x {len(entries)} = "
         f"{counted('num_backend_compilations', len(manager.entries))}")]))

    ran = [e for e in manager.entries if e.reused_from is None and not e.loaded]
    reused = sum(e.reused_from is not None for e in manager.entries)
    loaded = sum(e.loaded for e in manager.entries)
    compiler = "Inductor" if manager.compiler.name.startswith("inductor") else manager.compiler.name
    lines = [f"compiles run: {counted('num_unique_compiles', len(ran))}"
             + (f", reused {reused} (identical pieces)" if reused else ""),
             f"compile time: {sum(e.seconds for e in ran):.1f} s"]
    if loaded:
        lines.append(f"loaded from the cache: {loaded}")
    if "num_inductor_compiles" in d and compiler == "Inductor":
        lines.append(f"num_inductor_compiles +{d['num_inductor_compiles']}")
    stages.append(Stage(compiler, "compiler_interface.py", "07", "compile", lines))

    pm = backend.post_grad_pass_manager
    if pm is None:
        stages.append(Stage("post-grad passes", "passes/", "05, 13", "compile",
                            [f"none: backend {cc.backend!r} runs no Inductor"]))
    else:
        names = [type(p).__name__ for p in pm.all_passes()]
        # per graph: a pass listed twice (PostCleanup, before and after the IR lowering) runs twice
        runs = {n: sum(1 for s, _ in pm.records if s.endswith(f".{n}.before")) // names.count(n)
                for n in names}
        fix = [(s, src) for s, src in pm.records if ".FixFunctionalizationPass." in s]
        before = sum(src.count("auto_functionalized(") for s, src in fix if s.endswith(".before"))
        after = sum(src.count("auto_functionalized(") for s, src in fix if s.endswith(".after"))
        lines = [" -> ".join(n.removesuffix("Pass") for n in names) or "none",
                 f"ran on {max(runs.values(), default=0)} graphs (inside each compile)"]
        if fix:
            lines.append(f"auto_functionalized: {before} -> {after}")
        stages.append(Stage("post-grad passes", "passes/", "05, 13", "compile", lines))

    stages.append(Stage("later calls: __call__", "decorators.py, wrapper.py", "04", "runtime", [
        "Dynamo's transformed code run directly, no Dynamo" if m._compiled_bytecode is not None else
        "the AOT function, no Dynamo" if m.aot_compiled_fn is not None
        else "through Dynamo's frame",
        "inputs checked against the first call"], column=1))
    stages.append(Stage("stitching graph", "backends.py", "06, 08", "runtime", [
        f"calls {len(items) - len(split)} compiled pieces",
        f"and {len(split)} splitting ops, eagerly",
        "(through the torch dispatcher)"], column=1))
    seen = pieces[0]._entry_for_shape
    shown = ", ".join(f"{n}->{_ranges([e.compile_range])}" for n, e in sorted(seen.items())[:6])
    stages.append(Stage("dispatch by num_tokens", "piecewise_backend.py", "07", "runtime", [
        f"{len(seen)} sizes seen so far" + (f": {shown}" if shown else ""),
        "outside every entry: ValueError"], column=1))
    return stages


def draw_pipeline(model: Any, counters: Any = None, *, fmt: str = "png",
                  title: str | None = None) -> bytes:
    """The pipeline as boxes and arrows (PNG or SVG bytes), each box with what its stage did."""
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    stages = pipeline_facts(model, counters)
    line_h, gap, pad = 0.2, 0.32, 0.1
    widths = [max(max(len(s.name) + len(s.where) + 12, *(len(x) for x in s.lines)) * 0.072 + 0.3
                  for s in stages if s.column == c) for c in (0, 1)]
    xs = [0.3, 0.3 + widths[0] + 1.3]
    fig_w = xs[1] + widths[1] + 0.3
    height = {id(s): (len(s.lines) + 1) * line_h + 2 * pad for s in stages}
    total_h = max(sum(height[id(s)] + gap for s in stages if s.column == c) for c in (0, 1)) + 0.7
    fig = Figure(figsize=(fig_w, total_h))
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, fig_w)
    ax.set_ylim(-total_h, 0)
    ax.axis("off")
    ax.text(0.3, -0.25, title or "The pipeline, from this compile", fontsize=11,
            weight="bold", va="center")
    for c, label in enumerate(("first call: trace and compile, once", "every later call")):
        ax.text(xs[c], -0.55, label, fontsize=9, style="italic", color="#444444", va="center")
    y = [-0.75, -0.75]
    boxes = {}
    for s in stages:
        x, w, h = xs[s.column], widths[s.column], height[id(s)]
        top = y[s.column]
        fill, line = COLOURS[s.kind]
        ax.add_patch(FancyBboxPatch((x, top - h), w, h, facecolor=fill,
                                    edgecolor=line, linewidth=1.2,
                                    boxstyle="round,pad=0.01,rounding_size=0.06"))
        ax.text(x + 0.08, top - pad - line_h / 2, s.name, fontsize=9, weight="bold", va="center")
        ax.text(x + w - 0.08, top - pad - line_h / 2, f"{s.where} · nb {s.notebook}", fontsize=7,
                color=line, va="center", ha="right")
        for i, text in enumerate(s.lines):
            ax.text(x + 0.12, top - pad - (i + 1.5) * line_h, text, fontsize=8,
                    family="monospace", va="center")
        boxes[id(s)] = (x, top, w, h)
        y[s.column] = top - h - gap
    for c in (0, 1):
        col = [boxes[id(s)] for s in stages if s.column == c]
        for (x, top, w, h), (_, top2, _, _) in itertools.pairwise(col):
            ax.add_patch(FancyArrowPatch((x + w / 2, top - h), (x + w / 2, top2), arrowstyle="-|>",
                                         mutation_scale=10, linewidth=0.9, color="#555555"))
    # the compile hands the stitching graph back: it is what every later call runs
    (x0, t0, w0, h0), (x1, t1, _, h1) = boxes[id(stages[4])], boxes[id(stages[-2])]
    ax.add_patch(FancyArrowPatch((x0 + w0, t0 - h0 / 2), (x1, t1 - h1 / 2), arrowstyle="-|>",
                                 connectionstyle="arc3,rad=0.15", mutation_scale=10, linewidth=0.9,
                                 color="#3f8f3f", linestyle="--"))
    ax.text(x0 + w0 + 0.1, t0 - h0 / 2 - 0.12, "the split graph,\nreturned to Dynamo",
            fontsize=7, color="#3f8f3f", ha="left", va="top")
    legend = [("python", "Python wrappers (this package)"), ("dynamo", "torch's Dynamo"),
              ("compile", "compile time"), ("split", "the split"), ("runtime", "run time")]
    ly = y[1] - 0.3
    for kind, text in legend:
        fill, line = COLOURS[kind]
        ax.add_patch(FancyBboxPatch((xs[1], ly - 0.16), 0.3, 0.16, facecolor=fill, edgecolor=line,
                                    boxstyle="round,pad=0.01,rounding_size=0.03"))
        ax.text(xs[1] + 0.4, ly - 0.08, text, fontsize=8, va="center")
        ly -= 0.26
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=100)
    return buf.getvalue()
