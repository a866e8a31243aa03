"""Notebook 15's views (viz/ir.py), on a real pass manager and a small traced graph, and the step
plot on made-up figures. Nothing compiles."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import torch  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from minivllm_compile import CompilationConfig, ir  # noqa: E402
from minivllm_compile.compilation.passes import make_pass_manager  # noqa: E402
from minivllm_compile.viz.ir import draw_pass_order, ir_nodes, pass_order, plot_step_times  # noqa: E402


def test_the_pass_order_starts_before_aotautograd_and_ends_with_fix_functionalization():
    manager = make_pass_manager(CompilationConfig())
    rows = pass_order(manager)
    assert rows[:2] == [("before AOTAutograd", "VllmIRInplaceFunctionalizationPass"),
                        ("AOTAutograd", "functionalize, decompose")]
    assert [name for _, name in rows[2:]] == [type(p).__name__ for p in manager.all_passes()]
    assert rows[-1] == ("post-grad", "FixFunctionalizationPass")
    image = draw_pass_order(manager)
    assert image.data[:4] == b"\x89PNG"


def test_ir_nodes_lists_each_ir_call_with_its_overload_and_input_shape():
    def f(h, r, w):
        x = ir.ops.rms_norm(h, w, 1e-6)
        return ir.ops.fused_add_rms_norm.maybe_inplace(x * 2, r, w, 1e-6)

    with ir.enable_torch_wrap(True):  # the IR ops as torch ops, whatever the process's default
        gm = make_fx(f, tracing_mode="fake")(torch.randn(3, 8), torch.randn(3, 8), torch.ones(8))
    rows = ir_nodes(gm.graph)
    assert [(r["op"], r["overload"], r["x"]) for r in rows] == [
        ("rms_norm", "default", "[3, 8]"), ("fused_add_rms_norm", "maybe_inplace", "[3, 8]")]


def test_plot_step_times_draws_one_bar_per_label():
    stats = {"native": {"median": 2.0, "min": 1.0, "max": 3.0},
             "vllm_c": {"median": 4.0, "min": 3.5, "max": 5.0}}
    fig = plot_step_times(stats, title="made up")
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["native", "vllm_c"]
    assert [p.get_height() for p in ax.patches] == [2.0, 4.0] and ax.get_title() == "made up"
