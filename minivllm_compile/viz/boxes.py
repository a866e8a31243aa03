"""A plain matplotlib drawing of boxes and arrows: draw_graph's renderer when Graphviz's `dot` is
not installed."""

from __future__ import annotations

import io

# kind -> (fill, line): compiled pieces blue, splitting pieces orange, anything else grey
COLOURS = {"compiled": ("#d6e6fb", "#3d6fb6"), "splitting": ("#ffe0bd", "#d9822b"),
           None: ("#eeeeee", "#777777")}


Box = tuple[str, str, "str | None", "str | None"]  # id, label, kind (a COLOURS key), group


def render_boxes(boxes: list[Box], edges: list[tuple[str, str, bool]], title: str, fmt: str = "png",
                 max_rows: int = 16) -> bytes:
    """PNG or SVG bytes. Boxes in columns, top to bottom, a header row where the group (the piece)
    changes. An edge (from, to, solid) within a column goes straight down to the next box, or as a
    bracket on the right, further out the longer it spans; edges between columns are left out
    (the title says how many)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

    rows, last = [], object()
    for box in boxes:
        if box[3] is not None and box[3] != last:
            rows.append(("header", box))
        rows.append(("box", box))
        last = box[3]
    height = {"header": lambda b: 0.32, "box": lambda b: 0.2 * (1 + b[1].count("\n")) + 0.12}
    ncols = max(1, -(-len(rows) // max_rows))
    per_col = -(-len(rows) // ncols)
    width = max(len(line) for b in boxes for line in b[1].split("\n")) * 0.078 + 0.3
    cols = [rows[c * per_col:(c + 1) * per_col] for c in range(ncols)]
    total_h = max(sum(height[k](b) + 0.16 for k, b in col) for col in cols) + 0.6
    fig_w = ncols * (width + 1.0) + 0.3
    fig = Figure(figsize=(fig_w, total_h))
    ax = fig.add_axes([0, 0, 1, 1])
    ax.set_xlim(0, fig_w)
    ax.set_ylim(-total_h, 0)
    ax.axis("off")
    pos: dict[str, tuple[int, int, float, float, float]] = {}  # id -> column, row, x, top, height
    for c, col in enumerate(cols):
        x, y = 0.3 + c * (width + 1.0), -0.5
        for r, (k, (i, label, kind, group)) in enumerate(col):
            h = height[k]((i, label))
            fill, line = COLOURS[kind]
            if k == "header":
                ax.text(x, y - h / 2, group, fontsize=8, weight="bold", color=line, va="center")
            else:
                ax.add_patch(FancyBboxPatch((x, y - h), width, h, facecolor=fill, edgecolor=line,
                                            boxstyle="round,pad=0.01,rounding_size=0.05",
                                            linewidth=1.1))
                ax.text(x + 0.07, y - h / 2, label, fontsize=8, va="center", family="monospace")
                pos[i] = (c, r, x, y, h)
            y -= h + 0.16
    dropped = 0
    for a, b, solid in edges:
        (ca, ra, xa, ya, ha), (cb, rb, xb, yb, hb) = pos[a], pos[b]
        if ca != cb:
            dropped += 1
            continue
        if rb == ra + 1:
            start, end, style = (xa + width / 2, ya - ha), (xb + width / 2, yb), "arc3,rad=0"
        else:
            arm = min(10 + 3 * abs(rb - ra), 55)
            start, end = (xa + width, ya - ha / 2), (xb + width, yb - hb / 2)
            style = f"arc,angleA=0,angleB=0,armA={arm},armB={arm},rad=4"
        ax.add_patch(FancyArrowPatch(start, end, connectionstyle=style, arrowstyle="-|>",
                                     mutation_scale=8, linewidth=0.7, color="#555555",
                                     linestyle="-" if solid else "--"))
    note = f" ({dropped} edges between columns not drawn)" if dropped else ""
    ax.text(0.15, -0.22, title + note, fontsize=10, weight="bold", va="center")
    buf = io.BytesIO()
    fig.savefig(buf, format=fmt, dpi=100)
    return buf.getvalue()
