"""Notebook views: they read what the core records (graphs, split items, compiled entries and
their generated code) and draw or tabulate it. The core never imports this package."""

from minivllm_compile.viz.boxes import render_boxes
from minivllm_compile.viz.cache import describe_cache
from minivllm_compile.viz.diffs import Diff, unified_diff
from minivllm_compile.viz.dynamo_entries import count_dynamo_entries
from minivllm_compile.viz.functional import functional_graph
from minivllm_compile.viz.graphs import (
    describe,
    draw_graph,
    graph_table,
    op_label,
    piece_of_node,
    piece_summary,
    render_dot,
    short_name,
    table_text,
    to_dot,
)
from minivllm_compile.viz.kernels import (
    Buffer,
    buffers_in,
    call_stats,
    calls_in,
    kernel_signatures,
    kernel_sources,
    triton_source_codegen_only,
)
from minivllm_compile.viz.pipeline import Stage, draw_pipeline, pipeline_facts
from minivllm_compile.viz.plots import (
    draw_conv_states,
    draw_rewrite,
    draw_timeline,
    plot_call_times,
    plot_dispatch_counts,
    plot_modes,
    plot_pass_effect,
    plot_startups,
    timeline_colour,
    timeline_label,
)

__all__ = [
    "Buffer", "Diff", "Stage", "buffers_in", "call_stats", "calls_in", "count_dynamo_entries",
    "describe", "describe_cache", "draw_graph", "draw_pipeline", "functional_graph", "graph_table",
    "kernel_signatures",
    "kernel_sources", "op_label", "pipeline_facts", "piece_of_node", "piece_summary",
    "render_boxes", "render_dot", "short_name",
    "table_text", "to_dot", "triton_source_codegen_only", "unified_diff",
    # notebook plots (viz/plots.py)
    "draw_conv_states", "draw_rewrite", "draw_timeline", "plot_call_times",
    "plot_dispatch_counts", "plot_modes",
    "plot_pass_effect", "plot_startups", "timeline_colour", "timeline_label",
]
