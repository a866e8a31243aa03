"""Notebook 15's views of vLLM IR: the pass order as the pass manager holds it, the IR nodes of a
graph, and the step times per priority. They draw what a cell computed; the cell keeps the
assertions."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import fx

from minivllm_compile.viz.boxes import render_boxes


def pass_order(manager: Any) -> list[tuple[str, str]]:
    """(stage, pass name) in the order a compile runs them: the pre-grad IR functionalization
    before AOTAutograd, then the post-grad manager's passes (PostCleanup twice, as it runs)."""
    rows = [
        ("before AOTAutograd", "VllmIRInplaceFunctionalizationPass"),
        ("AOTAutograd", "functionalize, decompose"),
    ]
    return rows + [("post-grad", type(p).__name__) for p in manager.all_passes()]


def draw_pass_order(manager: Any, *, fmt: str = "png", title: str = "") -> Any:
    """Boxes top to bottom, one per pass, grouped by stage; the IR passes in the compiled-piece
    colour, AOTAutograd orange, the others grey."""
    ir_passes = {
        "VllmIRInplaceFunctionalizationPass",
        "VllmIRLoweringPass",
        "UnsafeCloneEliminationPass",
    }
    boxes = []
    for i, (stage, name) in enumerate(pass_order(manager)):
        kind = "compiled" if name in ir_passes else "splitting" if stage == "AOTAutograd" else None
        boxes.append((str(i), name, kind, stage))
    edges = [(str(i), str(i + 1), True) for i in range(len(boxes) - 1)]
    data = render_boxes(
        boxes, edges, title or "one compile of one piece, in order", fmt, max_rows=32
    )
    try:
        from IPython.display import SVG, Image
    except ImportError:
        return data
    return SVG(data) if fmt == "svg" else Image(data)


def ir_nodes(graph: fx.Graph) -> list[dict[str, str]]:
    """Every IR op node of a graph: its name, op and overload, and the shape of its first input."""
    from minivllm_compile.compilation.passes.ir import get_ir_op
    from minivllm_compile.compilation.passes.ir.utils import overload_or_default

    rows = []
    for node in graph.nodes:
        op = get_ir_op(node)
        if op is None:
            continue
        x = (
            node.args[0].meta.get("example_value", node.args[0].meta.get("val"))
            if isinstance(node.args[0], fx.Node)
            else None
        )
        shape = "?" if x is None else "[" + ", ".join(str(d) for d in x.shape) + "]"
        rows.append(
            {
                "node": node.name,
                "op": op.name,
                "overload": overload_or_default(node.target)._overloadname,
                "x": shape,
            }
        )
    return rows


def plot_step_times(
    step_us: Mapping[str, Mapping[str, float]],
    *,
    title: str = "",
    order: Sequence[str] | None = None,
) -> Any:
    """Bars of the median step time per priority, min..max as error bars.

    step_us: {label: {"median": µs, "min": µs, "max": µs}} (bench.stats' keys)."""
    import matplotlib.pyplot as plt

    labels = list(order or step_us)
    med = [step_us[k]["median"] for k in labels]
    err = [
        [m - step_us[k]["min"] for m, k in zip(med, labels)],
        [step_us[k]["max"] - m for m, k in zip(med, labels)],
    ]
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=80)
    bars = ax.bar(range(len(labels)), med, yerr=err, capsize=4, color="#4c72b0")
    ax.bar_label(bars, fmt="%.0f µs", padding=3, fontsize=8)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_ylabel("decode step, µs (median; min..max)")
    ax.set_ylim(0, 1.3 * max(s["max"] for s in step_us.values()))
    ax.set_title(title)
    fig.tight_layout()
    return fig
