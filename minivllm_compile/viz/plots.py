"""The notebooks' charts: small functions that take what a notebook cell computed (plain dicts,
lists, names) and return a matplotlib Figure. They compute nothing about the compile themselves;
the cell that calls one keeps its assertions on the data. Matplotlib only (no Graphviz).

    fig = plot_call_times(median, title="...")   # notebook 04
    plt.show()                                   # the cell shows it (the inline backend does)

A function that draws on one axes takes `ax=None`: given one, it draws there (for a figure of
several panels) and returns that axes' figure. Figures are made with pyplot, as the notebooks'
own are, so a notebook shows them; a script that makes many should `plt.close(fig)` each one."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle


def _axes(ax: Any, figsize: tuple[float, float], dpi: float | None = None) -> Any:
    if ax is not None:
        return ax
    return plt.subplots(figsize=figsize, **({"dpi": dpi} if dpi else {}))[1]


def _grouped_bars(ax: Any, series: Mapping[str, Mapping[Any, float]], categories: Sequence[Any], *,
                  width: float, horizontal: bool = False, colours: Mapping[str, str] | None = None,
                  positions: Sequence[float] | None = None) -> None:
    """One bar per (series, category), the series side by side around each category's position."""
    positions = list(range(len(categories))) if positions is None else list(positions)
    k = len(series)
    for i, (name, values) in enumerate(series.items()):
        offset = (i - (k - 1) / 2) * width
        xs = [p + offset for p in positions]
        ys = [values.get(c, 0) for c in categories]
        colour = {"color": colours[name]} if colours and name in colours else {}
        if horizontal:
            ax.barh(xs, ys, height=width, label=name, **colour)
        else:
            ax.bar(xs, ys, width, label=name, **colour)


# --- notebook 04: per-call overhead of the bytecode hook ---------------------------------------

def plot_call_times(median: Mapping[str, Mapping[int, float]], *, title: str = "",
                    ylabel: str = "µs per decoder call (median)", ax: Any = None) -> Figure:
    """Grouped bars: for each num_tokens, one bar per variant.

    median: {variant: {num_tokens: µs per call}}, every variant with the same sizes (the first
    variant's sizes, in its order, are the x ticks); the legend keeps the dict's order."""
    ax = _axes(ax, (8, 3.6), dpi=80)
    sizes = list(next(iter(median.values())))
    _grouped_bars(ax, median, sizes, width=0.8 / max(len(median), 1), positions=sizes)
    ax.set_xticks(sizes)
    ax.set_xlabel("num_tokens")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.set_ylim(0, 1.3 * max(max(by_n.values()) for by_n in median.values()))
    ax.legend(ncol=len(median), fontsize=8, loc="upper center")
    return ax.figure


# --- notebook 05: FixFunctionalizationPass -----------------------------------------------------

REWRITE_COLOURS = {"arg": "#dde8f5", "op": "#f5dcdc", "getitem": "#f5ecd0", "user": "#e3f0dd",
                   "call": "#d5eef3"}


def _place(ax: Any, columns: Sequence[Sequence[tuple]], gap: float = 0.5) -> dict:
    """Draws columns of boxed texts, (key, text, y, colour) each, left to right, each column `gap`
    after the widest box of the one before; returns {key: (left edge, right
    edge, y)} (data units)."""
    renderer = ax.figure.canvas.get_renderer()
    to_data = ax.transData.inverted()
    # the frame's pad (0.3 em of 8 pt) in data units
    pad = 0.3 * 8 / 72 * ax.figure.dpi * (ax.get_xlim()[1]
                                          - ax.get_xlim()[0]) / ax.get_window_extent(renderer).width
    x, where = 0.1, {}
    for column in columns:
        right = x
        for key, text, y, colour in column:
            t = ax.text(x, y, text, ha="left", va="center", fontsize=8, family="monospace",
                        bbox={"boxstyle": "round,pad=0.3", "fc": colour, "ec": "0.3"})
            box = t.get_window_extent(renderer).transformed(to_data)  # the text, without its frame
            where[key] = (box.x0 - pad, box.x1 + pad, y)
            right = max(right, box.x1 + pad)
        x = right + gap
    return where


def _arrow(ax: Any, where: dict, src: Any, dst: Any) -> None:
    (_, x1, y1), (x0, _, y0) = where[src], where[dst]
    ax.annotate("", xy=(x0, y0), xytext=(x1, y1),
                arrowprops={"arrowstyle": "->", "color": "0.35", "shrinkA": 1, "shrinkB": 1})


def draw_rewrite(args: Mapping[str, str], hop: str,
                 getitems: Mapping[int, tuple[str, Sequence[str]]],
                 mutated: Mapping[int, str], call: str,
                 readers_after: Mapping[int, Sequence[str]]) -> Figure:
    """Two panels, the neighbourhood of one auto_functionalized node before and after
    FixFunctionalizationPass, as boxes and arrows.

    args: {argument name: node name} of the wrapped op's tensor arguments, top down;
    hop: the text of the auto_functionalized box (its node name and the op's);
    getitems: {index i: (getitem node name, [names of the nodes that read it])};
    mutated: {index i: argument name} (the pass's MUTATED_ARGS row for the op);
    call: the name of the in-place call that replaces the node;
    readers_after: {index i: [names, after the pass, of the readers of getitems[i]]}, same order.
    Before: arguments -> the wrapped op -> getitem [i] -> its readers. After: arguments -> the
    in-place call (below them), and each reader of [i] drawn reading argument mutated[i]."""
    c = REWRITE_COLOURS
    # one row per tensor argument, top down
    row = {name: len(args) - 1 - i for i, name in enumerate(args)}
    fig, axes = plt.subplots(2, 1, figsize=(9.5, 5.2))
    for ax, title in zip(axes, ("before: functional", "after FixFunctionalizationPass")):
        ax.set_title(title, fontsize=10)
        ax.set_xlim(0, 10)
        ax.set_ylim(-1.5, len(args) - 0.4)
        ax.axis("off")
    # fixed: boxes are measured
    fig.subplots_adjust(left=0.01, right=0.99, top=0.93, bottom=0.02, hspace=0.2)
    fig.canvas.draw()  # so the text extents can be measured
    arg_column = [(name, f"{name}={node}", row[name], c["arg"]) for name, node in args.items()]

    ax = axes[0]
    readers = [(("user", i, j), u, row[mutated[i]] - 0.5 * j, c["user"])
               for i, (_, users) in getitems.items() for j, u in enumerate(users)]
    where = _place(ax, [arg_column, [("hop", hop, (len(args) - 1) / 2, c["op"])],
                        [(i, f"{g} = [{i}]", row[mutated[i]], c["getitem"])
                         for i, (g, _) in getitems.items()],
                        readers])
    for name in args:
        _arrow(ax, where, name, "hop")
    for i, (_, users) in getitems.items():
        _arrow(ax, where, "hop", i)
        for j in range(len(users)):
            _arrow(ax, where, i, ("user", i, j))

    ax = axes[1]
    readers = [(("user", i, j), u, row[mutated[i]] - 0.5 * j, c["user"])
               for i, users in readers_after.items() for j, u in enumerate(users)]
    call_text = f"{call}\nwrites {', '.join(mutated.values())} in place"
    where = _place(ax, [arg_column, [("call", call_text, -1.0, c["call"])], readers])
    for name in args:
        _arrow(ax, where, name, "call")
    for i, users in readers_after.items():
        for j in range(len(users)):
            # [i]'s reader now reads what the op wrote
            _arrow(ax, where, mutated[i], ("user", i, j))
    return fig


def plot_pass_effect(off: Mapping[str, float], on: Mapping[str, float], *, title: str = "",
                     ax: Any = None) -> Figure:
    """Paired bars, pass off / pass on, for each statistic of the generated code.

    off, on: {statistic: value}, the same keys (off's order is the x axis')."""
    ax = _axes(ax, (6, 2.8))
    keys = list(off)
    _grouped_bars(ax, {"pass off": off, "pass on": on}, keys, width=0.4,
                  colours={"pass off": "#d9a0a0", "pass on": "#8fb8d9"})
    ax.set_xticks(range(len(keys)), keys)
    ax.set_title(title, fontsize=10)
    ax.legend()
    ax.figure.tight_layout()
    return ax.figure


# --- notebook 08: what reaches the dispatcher --------------------------------------------------

def plot_dispatch_counts(seen: Mapping[str, Mapping[str, int]], ops: Sequence[str], *,
                         xlabel: str = "",
                         ax: Any = None) -> Figure:
    """Horizontal paired bars: for each op (top down, in `ops` order), its count in each run.

    seen: {run name: {op name: calls}}, e.g. {"eager": Counter, "compiled": Counter}; an op a run
    never called counts 0. The first run is drawn grey (the upper bar of a
    pair), the second blue."""
    ax = _axes(ax, (8, 4.2))
    _grouped_bars(ax, seen, ops, width=0.4, horizontal=True,
                  colours=dict(zip(seen, ("#aaaaaa", "#3d6fb6"))))
    ax.set_yticks(range(len(ops)), ops, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.legend()
    ax.figure.tight_layout()
    return ax.figure


# --- notebook 10: profiler ranges on a timeline ------------------------------------------------

ATTENTION_OP = "minivllm::unified_attention_with_output"
SHORT_OP_NAMES = {"rms_norm": "norm", "fused_add_rms_norm": "add+norm", "rotary_embedding": "rope",
                  "unified_attention_with_output": "attn", "silu_and_mul": "silu*"}
TIMELINE_LEGEND = [("tab:blue", "layer / piece range"), ("tab:red", "attention-op range"),
                   ("salmon", "attention op"), ("tab:orange", "other minivllm op"),
                   ("tab:purple", "Inductor graph call"), ("0.6", "aten op, other")]


def timeline_colour(name: str) -> str:
    """The colour of a profiler event on the timeline (TIMELINE_LEGEND says what each means)."""
    if name.startswith("model.layers") and name.endswith(".attn"):
        return "tab:red"
    if name.startswith(("model.layers", "piece")):
        return "tab:blue"
    if name == ATTENTION_OP:
        return "salmon"
    if name.startswith("minivllm::"):
        return "tab:orange"
    if name.startswith("## Call CompiledFxGraph"):
        return "tab:purple"
    return "0.6"


def timeline_label(name: str) -> str:
    """A profiler event's short name: model.layers.2 -> layer 2, model.layers.2.self_attn.attn ->
    attn 2, minivllm::rms_norm -> norm, piece 1 (compiled) -> piece 1, aten::mm -> mm."""
    if name.startswith("minivllm::"):
        return SHORT_OP_NAMES.get(name.removeprefix("minivllm::"), name.removeprefix("minivllm::"))
    if name.startswith("model.layers"):
        return ("attn " if name.endswith(".attn") else "layer ") + name.split(".")[2]
    if name.startswith("piece"):
        return name.removesuffix(" (compiled)")
    if name.startswith("## Call CompiledFxGraph"):
        return "Inductor graph"
    return name.removeprefix("aten::")


def _span(s: Any) -> tuple[str, float, float, int]:
    if isinstance(s, tuple):
        name, start, end, depth = s
        return name, start, end, depth
    return s.name, s.start, s.end, s.depth


def draw_timeline(spans: Iterable[Any], title: str = "", *,
                  rows: Sequence[str] = ("ranges", "ops in a range", "ops inside those"),
                  range_prefixes: tuple[str, ...] = ("model.layers", "piece"),
                  ax: Any = None) -> Figure:
    """One step's profiler events Gantt-style, one row per nesting depth (depth 1 on top).

    spans: the step's events, each (name, start µs, end µs, depth) or an object with those
    attributes (depth 1 = directly inside the step); events deeper than len(rows) are left out.
    The x axis (ms) spans the ranges (names starting with one of range_prefixes), 4% either side.
    Depth-1 events and minivllm ops get their short name (timeline_label) where it fits."""
    ax = _axes(ax, (13, 2.8), dpi=80)
    spans = [_span(s) for s in spans]
    rs = [s for s in spans if s[0].startswith(range_prefixes)]
    if not rs:
        raise ValueError(f"no range (a name starting with {range_prefixes}) among the spans")
    lo, hi = min(s[1] for s in rs), max(s[2] for s in rs)
    lo, hi = lo - 0.04 * (hi - lo), hi + 0.04 * (hi - lo)
    for name, start, end, depth in spans:
        if depth > len(rows) or end < lo or start > hi:
            continue
        y, dur = depth - 1, end - start
        ax.barh(y, dur / 1e3, left=start / 1e3, height=0.8, color=timeline_colour(name),
                edgecolor="white",
                linewidth=0.4)
        text = timeline_label(name)
        if dur > (hi - lo) * (len(text) + 1) / 160 and (depth == 1
                                                        or name.startswith("minivllm::")):
            ax.text((start + dur / 2) / 1e3, y, text, ha="center", va="center", fontsize=8,
                    color="white" if depth == 1 else "black", clip_on=True)
    ax.set_xlim(lo / 1e3, hi / 1e3)
    ax.legend(handles=[Patch(color=c, label=t) for c, t in TIMELINE_LEGEND], loc="upper left",
              bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_yticks(range(len(rows)), rows)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began")
    ax.set_title(title)
    return ax.figure


# --- notebook 11: conv_state lines ---------------------------------------------------------------

OLD, NEW = "#9dc3e6", "#f6c85f"


def draw_conv_states(states: Sequence[Mapping[str, Any]], *,
                     windows: Sequence[tuple[str, str]] = (),
                     notes: Sequence[tuple[int, int, str]] = (), figsize: tuple[float, float]
                     | None = None) -> Figure:
    """conv_state lines as rows of boxes, one row per state, top down.

    Each state is a dict: "title" (left of the row), "slots" (the token ids, 0 for an empty slot;
    drawn t<id>), and optionally "new" (the slots written from x, shaded), "val" (the VAL boundary,
    a red line before that slot) and "window" ((first slot, length): a dashed frame, colour
    "window_colour", black by default).
    windows: (colour, label) legend entries for the dashed frames; notes: (row, slot, text) in red
    above a slot."""
    nrows = len(states)
    nslots = max(len(s["slots"]) for s in states)
    fig, ax = plt.subplots(figsize=figsize or (3.75 + 0.75 * nslots, 0.9 * nrows + 0.1))
    for r, state in enumerate(states):
        y = -1.4 * r
        new = state.get("new", ())
        for s, v in enumerate(state["slots"]):
            ax.add_patch(Rectangle((s, y), 0.95, 0.8, color=NEW if s in new else OLD))
            ax.text(s + 0.47, y + 0.4, f"t{v}" if v else "0", ha="center", va="center")
        val = state.get("val")
        if val is not None:
            ax.plot([val - 0.025] * 2, [y - 0.15, y + 0.95], color="red", lw=2)
            ax.text(val, y - 0.4, f"VAL={val}", color="red", ha="center", fontsize=8)
        window = state.get("window")
        if window is not None:
            ax.add_patch(Rectangle((window[0] - 0.03, y - 0.07), window[1], 0.94, fill=False,
                                   ec=state.get("window_colour", "black"), lw=2, ls="--"))
        ax.text(-0.2, y + 0.4, state["title"], ha="right", va="center", fontsize=9)
    for r, s, text in notes:
        ax.text(s + 0.47, -1.4 * r + 0.95, text, color="red", ha="center", fontsize=8)
    handles = [Patch(color=OLD, label="old history"), Patch(color=NEW, label="new tokens (from x)"),
               *[Line2D([], [], color=c, ls="--", label=t) for c, t in windows]]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0),
              fontsize=8, frameon=False)
    ax.set_xlim(-2.6, nslots + 0.1)
    ax.set_ylim(-1.4 * (nrows - 1) - 0.6, 1.0)
    ax.axis("off")
    fig.tight_layout()
    return fig


# --- notebook 09: cold, warm and AOT-load starts ------------------------------------------------

START_COLOURS = ("#c44e52", "#dd8452", "#8172b3", "#55a868")


def plot_startups(seconds: Mapping[str, float], labels: Mapping[str, str], *, title: str = "",
                  xlabel: str = "first call of a fresh process (s)", ax: Any = None) -> Figure:
    """One horizontal bar per start (top down, in `labels`' order), labelled with its seconds.

    seconds: {start: s} (startup.startup_times' median_s); labels: {start: the bar's label}."""
    ax = _axes(ax, (6, 3.2), dpi=80)
    keys = list(labels)
    bars = ax.barh([labels[k] for k in keys], [seconds[k] for k in keys],
                   color=[START_COLOURS[i % len(START_COLOURS)] for i in range(len(keys))])
    ax.bar_label(bars, fmt="%.1f s", padding=3)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_xlim(0, max(seconds[k] for k in keys) * 1.25)
    ax.set_title(title)
    ax.figure.tight_layout()
    return ax.figure


# --- notebook 12: the capstone's modes side by side ----------------------------------------------

STEP_SHAPES = {"decode": ("decode: 4 seqs x 1 token", "#4c72b0"),
               "prefill": ("prefill: 32 tokens", "#dd8452")}


def _short_mode(label: str) -> str:
    return label.replace("VLLM_COMPILE", "VLLM").replace("_TORCH_COMPILE", "").replace(", ", "\n")


def plot_modes(results: Mapping[str, Mapping[str, Any]], *, title: str = "",
               latency_label: str = "median step latency (ms, 1 CPU thread)") -> Figure:
    """Two panels over the same rows, one row per mode (top down, in the dict's order): the median
    step latency of each step shape (left, ms), and the process's first call (right, s, labelled).

    results: {mode label: {"latency_s": {shape: s}, "first_call_s": s}}, the shapes those of
    STEP_SHAPES ("decode", "prefill")."""
    labels = list(results)
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 3.6), dpi=80)
    _grouped_bars(ax0, {name: {lb: results[lb]["latency_s"][shape] * 1e3 for lb in labels}
                        for shape, (name, _) in STEP_SHAPES.items()},
                  labels, width=0.4, horizontal=True, colours=dict(STEP_SHAPES.values()))
    ax0.set_yticks(range(len(labels)), [_short_mode(lb) for lb in labels])
    ax0.invert_yaxis()
    ax0.set_xlabel(latency_label)
    ax0.legend(fontsize=8, loc="lower right")
    first = [results[lb]["first_call_s"] for lb in labels]
    bars = ax1.barh(range(len(labels)), first, color="#c44e52")
    ax1.bar_label(bars, fmt="%.1f s", padding=3, fontsize=8)
    ax1.set_yticks(range(len(labels)), [""] * len(labels))
    ax1.invert_yaxis()
    ax1.set_xlabel("first call of the process (s)")
    ax1.set_xlim(0, max(first) * 1.25)
    fig.suptitle(title)
    fig.tight_layout()
    return fig
