"""viz/plots.py: the notebooks' charts draw what they are given (made-up data here, no compiles)."""

import matplotlib

matplotlib.use("Agg")  # no display needed

import matplotlib.pyplot as plt
import pytest
from matplotlib.patches import Rectangle
from matplotlib.text import Annotation

from minivllm_compile.viz.plots import (
    draw_conv_states,
    draw_rewrite,
    draw_timeline,
    plot_call_times,
    plot_dispatch_counts,
    plot_modes,
    plot_pass_effect,
    timeline_colour,
    timeline_label,
)


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def _bars(ax):
    return [p for p in ax.patches if isinstance(p, Rectangle)]


def _texts(ax):
    return [t.get_text() for t in ax.texts]


def test_call_times_one_bar_per_variant_and_size():
    median = {"eager": {1: 50.0, 2: 55.0, 3: 60.0}, "hook on": {1: 40.0, 2: 42.0, 3: 45.0}}
    fig = plot_call_times(median, title="1-layer Llama")
    (ax,) = fig.axes
    bars = _bars(ax)
    assert len(bars) == 6 and sorted(b.get_height() for b in bars) == [40, 42, 45, 50, 55, 60]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["eager", "hook on"]
    assert ax.get_title() == "1-layer Llama" and ax.get_xlabel() == "num_tokens"
    assert list(ax.get_xticks()) == [1, 2, 3]
    # each size's bars sit around its tick, the variants in the dict's order
    eager = sorted(ax.containers[0], key=lambda b: b.get_x())
    assert [round(b.get_x() + b.get_width() / 2, 6) for b in eager] == [0.8, 1.8, 2.8]
    assert ax.get_ylim()[1] == pytest.approx(1.3 * 60)


def test_rewrite_boxes_and_arrows_before_and_after():
    fig = draw_rewrite(args={"input": "add", "residual": "arg2", "weight": "arg3"},
                       hop="auto_functionalized\nfused_add_rms_norm",
                       getitems={1: ("getitem_1", ["mm"]), 2: ("getitem_2", ["add_1", "mul"])},
                       mutated={1: "input", 2: "residual"}, call="fused_add_rms_norm",
                       readers_after={1: ["mm"], 2: ["add_1", "mul"]})
    before, after = fig.axes
    assert (before.get_title() == "before: functional"
            and after.get_title() == "after FixFunctionalizationPass")
    assert _texts(before)[:3] == ["input=add", "residual=arg2", "weight=arg3"]
    assert "getitem_1 = [1]" in _texts(before) and "getitem_2 = [2]" in _texts(before)
    assert "fused_add_rms_norm\nwrites input, residual in place" in _texts(after)
    assert not any("getitem" in t for t in _texts(after))  # the getitems are gone

    def arrows(ax):
        return sum(isinstance(t, Annotation) for t in ax.texts)

    # before: 3 args -> op, op -> 2 getitems, getitems -> 3 readers; after: 3 args ->
    # call, 2 args -> 3 readers
    assert arrows(before) == 3 + 2 + 3 and arrows(after) == 3 + 3


def test_pass_effect_pairs():
    off = {"buffers": 12, "fused kernels": 3, "copy/clone kernels": 1}
    on = {"buffers": 6, "fused kernels": 1, "copy/clone kernels": 0}
    (ax,) = plot_pass_effect(off, on, title="generated call()").axes
    assert [b.get_height() for b in ax.containers[0]] == [12, 3, 1]
    assert [b.get_height() for b in ax.containers[1]] == [6, 1, 0]
    assert [t.get_text() for t in ax.get_xticklabels()] == list(off)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["pass off", "pass on"]
    assert ax.get_title() == "generated call()"


def test_dispatch_counts_a_missing_op_counts_zero():
    seen = {"eager": {"aten.linear.default": 8, "minivllm.rms_norm.default": 1},
            "compiled": {"aten.mm.out": 8, "minivllm.rms_norm.default": 1}}
    ops = ["aten.linear.default", "aten.mm.out", "minivllm.rms_norm.default"]
    (ax,) = plot_dispatch_counts(seen, ops, xlabel="calls").axes
    assert [b.get_width() for b in ax.containers[0]] == [8, 0, 1]
    assert [b.get_width() for b in ax.containers[1]] == [0, 8, 1]
    assert [t.get_text() for t in ax.get_yticklabels()] == ops
    assert ax.yaxis_inverted() and ax.get_xlabel() == "calls"
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["eager", "compiled"]


def test_timeline_rows_labels_and_colours():
    spans = [("model.layers.0", 100, 600, 1), ("minivllm::rms_norm", 120, 300, 2),
             ("aten::mm", 130, 140, 3),
             ("aten::deep", 131, 132, 4), ("model.layers.1", 600, 1100, 1),
             ("minivllm::unified_attention_with_output", 650, 1000, 2)]
    fig = draw_timeline(spans, "eager")
    (ax,) = fig.axes
    assert len(_bars(ax)) == 5  # depth 4 is below the 3 rows
    assert [t.get_text() for t in ax.get_yticklabels()] == ["ranges", "ops in a range",
                                                            "ops inside those"]
    assert {"layer 0", "layer 1", "norm", "attn"} <= set(_texts(ax))
    assert ax.get_title() == "eager" and ax.get_xlabel() == "ms since the step began"
    assert ax.get_xlim() == pytest.approx((0.1 - 0.04, 1.1 + 0.04))
    assert len(ax.get_legend().get_texts()) == 6
    # on an axes of a bigger figure, with objects for spans
    class Span:
        def __init__(self, name, start, end, depth):
            self.name, self.start, self.end, self.depth = name, start, end, depth
    fig2, axes = plt.subplots(2, 1)
    assert draw_timeline([Span(*s) for s in spans], "again", rows=("a", "b"), ax=axes[1]) is fig2
    assert len(_bars(axes[1])) == 4 and not axes[0].patches
    with pytest.raises(ValueError, match="no range"):
        draw_timeline([("aten::mm", 0, 1, 1)])


def test_timeline_names():
    assert timeline_label("model.layers.2") == "layer 2"
    assert timeline_label("model.layers.2.self_attn.attn") == "attn 2"
    assert timeline_label("minivllm::fused_add_rms_norm") == "add+norm"
    assert timeline_label("piece 1 (compiled)") == "piece 1"
    assert timeline_label("## Call CompiledFxGraph fabc ##") == "Inductor graph"
    assert timeline_label("aten::mm") == "mm"
    assert timeline_colour("model.layers.0.self_attn.attn") == "tab:red"
    assert timeline_colour("piece 0 (compiled)") == "tab:blue"
    assert timeline_colour("minivllm::unified_attention_with_output") == "salmon"


def test_conv_states_boxes_markers_and_legend():
    fig = draw_conv_states([{"title": "after prefill", "slots": [3, 4, 5, 0, 0], "window": (0, 3)},
                            {"title": "after step 1", "slots": [4, 5, 6, 7, 99], "val": 2,
                             "new": {2, 3, 4},
                             "window": (1, 3), "window_colour": "green"}],
                           windows=[("black", "read by step 1"), ("green", "read by step 2")],
                           notes=[(1, 4, "rejected")])
    (ax,) = fig.axes
    boxes = [p for p in ax.patches if p.get_fill()]
    frames = [p for p in ax.patches if not p.get_fill()]
    assert len(boxes) == 10 and len(frames) == 2
    # new tokens
    assert sum(p.get_facecolor()[:3] == matplotlib.colors.to_rgb("#f6c85f") for p in boxes) == 3
    texts = _texts(ax)
    assert texts[:5] == ["t3", "t4", "t5", "0", "0"] and "t99" in texts
    assert {"after prefill", "after step 1", "VAL=2", "rejected"} <= set(texts)
    assert len(ax.lines) == 1  # one VAL line
    assert [t.get_text() for t in ax.get_legend().get_texts()] == [
        "old history", "new tokens (from x)", "read by step 1", "read by step 2"]


def test_modes_two_panels():
    results = {"NONE": {"latency_s": {"decode": 0.002, "prefill": 0.004}, "first_call_s": 0.1},
               "VLLM_COMPILE, AOT off": {"latency_s": {"decode": 0.001, "prefill": 0.002},
                                         "first_call_s": 20.0}}
    fig = plot_modes(results, title="tiny-llama")
    left, right = fig.axes
    assert len(_bars(left)) == 4 and len(_bars(right)) == 2
    assert [b.get_width() for b in left.containers[0]] == pytest.approx([2.0, 1.0])  # decode, ms
    assert [t.get_text() for t in left.get_yticklabels()] == ["NONE", "VLLM\nAOT off"]
    assert _texts(right) == ["0.1 s", "20.0 s"]
    assert right.get_xlim()[1] == pytest.approx(25.0)
    assert fig._suptitle.get_text() == "tiny-llama"
    assert [t.get_text() for t in left.get_legend().get_texts()] == ["decode: 4 seqs x 1 token",
                                                                     "prefill: 32 tokens"]


def test_plot_startups_one_labelled_bar_per_start_in_order():
    from minivllm_compile.viz.plots import plot_startups

    fig = plot_startups({"cold": 12.0, "aot_load": 1.0}, {"cold": "cold", "aot_load": "AOT load"},
                        title="t")
    ax = fig.axes[0]
    assert [b.get_width() for b in ax.patches] == [12.0, 1.0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["cold", "AOT load"]
    assert [t.get_text() for t in ax.texts] == ["12.0 s", "1.0 s"] and ax.get_title() == "t"

