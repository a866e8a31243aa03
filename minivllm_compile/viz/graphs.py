"""Pictures and tables of FX graphs and of the split graph (notebooks 06-08).

`draw_graph` draws one FX graph node by node, or the split graph piece by piece (compiled pieces
blue, splitting pieces orange). With Graphviz's `dot` on the PATH it renders DOT text made by
`to_dot`; without it, a plain matplotlib drawing. Both return an IPython image.
"""

from __future__ import annotations

import itertools
import operator
import re
import shutil
import subprocess
import textwrap
from typing import Any

import torch
import torch.fx as fx

from minivllm_compile.viz.boxes import COLOURS, render_boxes


def op_label(node: fx.Node) -> str:
    """A short name for what a node runs: `minivllm.rms_norm`, `linear`, `.split`, `getitem`."""
    if node.op == "call_method":
        return f".{node.target}"
    if node.op in ("placeholder", "output", "call_module", "get_attr"):
        return str(node.target)
    target = node.target
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return str(target)
    return getattr(target, "__name__", str(target))


def describe(value: Any) -> str:
    """`f32[s72, 96]` for a tensor, `Sym(s72)` for a SymInt, a number as itself, '' for None."""
    if isinstance(value, torch.Tensor):
        dtype = str(value.dtype).removeprefix("torch.").replace("float", "f").replace("int", "i")
        return f"{dtype}[{', '.join(str(d) for d in value.shape)}]"
    if isinstance(value, torch.SymInt):
        return f"Sym({value})"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    if isinstance(value, (bool, int, float)):
        return repr(value)
    return "" if value is None else type(value).__name__


def short_name(name: str) -> str:
    """Dynamo's input names, shortened: l_self_modules_layers_modules_0_modules_mlp_modules_
    gate_up_proj_parameters_weight_ -> layers.0.mlp.gate_up_proj.weight."""
    name = re.sub(r"^[lL]_self_(modules|parameters|buffers)_", "", name)
    return re.sub(r"_(modules|parameters|buffers)_", ".", name).strip("_")


def graph_table(gm: fx.GraphModule, placeholders: bool = True) -> list[dict[str, str]]:
    """One row per node: node name (inputs shortened), op kind, target, shape (from node.meta)."""
    return [{"node": short_name(n.name) if n.op == "placeholder" else n.name, "op": n.op,
             "target": "" if n.op == "placeholder" else op_label(n),
             "shape": describe(n.meta.get("example_value"))}
            for n in gm.graph.nodes if placeholders or n.op != "placeholder"]


def table_text(rows: list[dict[str, Any]], max_width: int = 60) -> str:
    """Rows of dicts as aligned plain text (long cells cut at max_width)."""
    if not rows:
        return ""
    cols = list(rows[0])

    def cut(v: str) -> str:
        return v if len(v) <= max_width else v[:max_width - 1] + "…"

    cell = [[cut(str(r[c])) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cell)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cell]
    return "\n".join(lines)


def _pieces(obj: Any) -> tuple[list[Any], fx.GraphModule | None]:
    """(SplitItems, stitching graph or None) from a VllmBackend, split_graph's tuple or a list."""
    if hasattr(obj, "piecewise_graphs"):
        record = getattr(obj, "record", None)
        return list(obj.piecewise_graphs), record.split_gm if record is not None else None
    if isinstance(obj, tuple) and len(obj) == 2 and isinstance(obj[0], fx.GraphModule):
        return list(obj[1]), obj[0]
    if isinstance(obj, list) and all(hasattr(it, "is_splitting_graph") for it in obj):
        return obj, None
    raise TypeError("expected a VllmBackend, split_graph's (split_gm, items) or a list of "
                    f"SplitItems, got {type(obj)}")


def _calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def piece_summary(obj: Any) -> list[dict[str, Any]]:
    """Per piece: name, splitting?, number of nodes, the ops it runs (getitems left out), and for
    a compiled piece of a VllmBackend the entries it was compiled for."""
    items, _ = _pieces(obj)
    rows = []
    for it in items:
        ops = [op_label(n) for n in _calls(it.graph) if n.target is not operator.getitem]
        row = {"name": it.submod_name, "splitting": it.is_splitting_graph,
               "nodes": len(_calls(it.graph)), "ops": ops}
        record = getattr(obj, "record", None)  # a VllmBackend's (compilation/piecewise_backend.py)
        backend = record.backends.get(it.submod_name) if record is not None else None
        if backend is not None:
            row["entries"] = [str(r) for r in backend.range_entries]
        rows.append(row)
    return rows


def piece_of_node(gm: fx.GraphModule, pieces: Any) -> dict[fx.Node, Any]:
    """Which piece (SplitItem) each node of the unsplit graph went to. split_module keeps program
    order, so the pieces' nodes, read in order, are the graph's nodes; {} when they are not."""
    items, _ = _pieces(pieces)
    ours = _calls(gm)
    theirs = [(it, n) for it in items for n in _calls(it.graph)]
    same = len(ours) == len(theirs) and all((a.op, a.target) == (b.op, b.target)
                                            for a, (_, b) in zip(ours, theirs))
    if not same:
        return {}
    return {a: it for a, (it, _) in zip(ours, theirs)}


def _split_edges(items: list[Any], split_gm: fx.GraphModule | None) -> list[tuple[str, str, bool]]:
    """(from, to, carries data): data edges of the stitching graph; consecutive pieces with no
    data between them (a splitting op writes its output in place) get an order-only edge."""
    names = [it.submod_name for it in items]
    data: set[tuple[str, str]] = set()
    if split_gm is not None:
        for node in split_gm.graph.nodes:
            if node.op == "call_module":
                for arg in node.all_input_nodes:
                    while arg.op == "call_function" and arg.target is operator.getitem:
                        arg = arg.args[0]
                    if arg.op == "call_module":
                        data.add((arg.target, node.target))
    edges = [(a, b, True) for a, b in sorted(data,
                                             key=lambda e: (names.index(e[1]), names.index(e[0])))]
    edges += [(a, b, False) for a, b in itertools.pairwise(names) if (a, b) not in data]
    return edges


def _kind(it: Any) -> str:
    return "splitting" if it.is_splitting_graph else "compiled"


def _model(obj: Any, pieces: Any, show_inputs: bool):
    """What to draw: boxes [(id, label, kind, group)], edges [(from, to, solid)], title."""
    if not isinstance(obj, fx.GraphModule):  # piece view
        items, split_gm = _pieces(obj)
        summary = {r["name"]: r for r in piece_summary(obj)}
        boxes = []
        for it in items:
            r = summary[it.submod_name]
            head = f"{it.submod_name} · {_kind(it)}"
            head += f" · {len(r['entries'])} entries" if "entries" in r else ""
            label = head + "\n" + textwrap.fill(", ".join(r["ops"]), 48)
            boxes.append((it.submod_name, label, _kind(it), None))
        return boxes, _split_edges(items, split_gm), f"{len(items)} pieces"
    where = piece_of_node(obj, pieces) if pieces is not None else {}
    nodes = [n for n in obj.graph.nodes if show_inputs or n.op != "placeholder"]
    shown = set(nodes)
    boxes = []
    for n in nodes:
        label = op_label(n) if n.op != "placeholder" else short_name(n.name)
        shape = describe(n.meta.get("example_value")) if n.op != "output" else ""
        it = where.get(n)
        boxes.append((n.name, f"{label}  {shape}".strip(), _kind(it) if it else None,
                      f"{it.submod_name} · {_kind(it)}" if it else None))
    edges = [(a.name, n.name, True) for n in nodes for a in n.all_input_nodes if a in shown]
    hidden = sum(n.op == "placeholder" for n in obj.graph.nodes if n not in shown)
    return boxes, edges, f"{len(nodes)} nodes" + (f", {hidden} inputs not drawn" if hidden else "")


def _dot_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(obj: Any, pieces: Any = None, *, show_inputs: bool = False,
           title: str | None = None) -> str:
    """Graphviz DOT text for what draw_graph draws (pieces of a node view become clusters)."""
    boxes, edges, default_title = _model(obj, pieces, show_inputs)
    lines = ["digraph G {", f"  label={_dot_str(title or default_title)}; labelloc=t; rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];']
    groups: dict[str | None, list[str]] = {}
    for i, label, kind, group in boxes:
        fill, line = COLOURS[kind]
        groups.setdefault(group, []).append(f"{_dot_str(i)} [label={_dot_str(label)}, "
                                            f"fillcolor={_dot_str(fill)}, color={_dot_str(line)}];")
    for k, (group, decls) in enumerate(groups.items()):
        if group is None:
            lines += [f"  {d}" for d in decls]
        else:
            lines += [f"  subgraph cluster_{k} {{", f"    label={_dot_str(group)}; style=dashed;"]
            lines += [f"    {d}" for d in decls] + ["  }"]
    for a, b, solid in edges:
        lines.append(f"  {_dot_str(a)} -> {_dot_str(b)}" + ("" if solid else " [style=dashed]")
                     + ";")
    return "\n".join(lines + ["}"])


def render_dot(dot: str, fmt: str = "png") -> bytes:
    """Run Graphviz's `dot` on DOT text."""
    exe = shutil.which("dot")
    if exe is None:
        raise FileNotFoundError("Graphviz's `dot` is not on the PATH")
    done = subprocess.run([exe, f"-T{fmt}"], input=dot.encode(), capture_output=True, check=True,
                          timeout=60)
    return done.stdout


def draw_graph(obj: Any, pieces: Any = None, *, fmt: str = "png", renderer: str = "auto",
               show_inputs: bool = False, max_rows: int = 16, title: str | None = None) -> Any:
    """Draw an FX graph (nodes coloured by piece when `pieces` is a VllmBackend or split_graph's
    result) or the split graph (pass a VllmBackend, split_graph's tuple or its SplitItems).
    renderer: "dot", "matplotlib" or "auto" (dot when installed). Returns an IPython Image/SVG."""
    if fmt not in ("png", "svg"):
        raise ValueError(f"fmt must be 'png' or 'svg', got {fmt!r}")
    use_dot = renderer == "dot" or (renderer == "auto" and shutil.which("dot") is not None)
    if use_dot:
        data = render_dot(to_dot(obj, pieces, show_inputs=show_inputs, title=title), fmt)
    else:
        boxes, edges, default_title = _model(obj, pieces, show_inputs)
        data = render_boxes(boxes, edges, title or default_title, fmt, max_rows)
    try:
        from IPython.display import SVG, Image
    except ImportError:
        return data
    return SVG(data) if fmt == "svg" else Image(data)
