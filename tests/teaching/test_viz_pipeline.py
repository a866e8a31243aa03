"""viz/pipeline.py: the pipeline picture's numbers come from the compile (they agree with
compilation_counter), and it draws without Graphviz."""

import pytest
import torch

from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter
from minivllm_compile.config import Range
from minivllm_compile.models import build_model
from minivllm_compile.viz.pipeline import draw_pipeline, pipeline_facts


@pytest.fixture
def no_cache(monkeypatch):
    # every stage runs: nothing loaded from disk
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")


def _compiled(backend: str, num_layers: int, **cc_kwargs):
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend=backend, **cc_kwargs)
    lm = build_model("llama", num_layers=num_layers, compilation_config=cc)
    before = compilation_counter.clone()
    lm(torch.arange(5), torch.arange(5))
    deltas = compilation_counter.since(before)
    lm(torch.arange(2), torch.arange(2))
    return lm, before, deltas


def _stage(stages, prefix):
    (stage,) = [s for s in stages if s.name.startswith(prefix)]
    return stage


@pytest.mark.compiles
def test_the_boxes_hold_the_compiles_numbers(no_cache):
    lm, before, deltas = _compiled("eager", 2, compile_sizes=[2], compile_ranges_endpoints=[4],
                                   max_num_batched_tokens=16)
    stages = pipeline_facts(lm, before)  # the counter's clone: deltas taken against it
    assert [s.name for s in stages][:5] == ["@support_torch_compile",
                                            "TorchCompileWithNoGuardsWrapper",
                                            "Dynamo", "VllmBackend", "split_graph"]
    assert [s.column for s in stages] == [0] * 8 + [1] * 3
    text = {s.name: "\n".join(s.lines) for s in stages}
    assert "mark_dynamic: input_ids[0], positions[0]" in text["@support_torch_compile"]
    assert ("pieces: 5  (num_piecewise_graphs_seen "
            f"+{deltas['num_piecewise_graphs_seen']})" in text["split_graph"])
    assert (deltas["num_piecewise_graphs_seen"] == 5
            and deltas["num_piecewise_capturable_graphs_seen"] == 3)
    assert ("to compile: 3" in text["split_graph"]
            and "unified_attention_with_output" in text["split_graph"])
    pieces = _stage(stages, "PiecewiseBackend")
    assert pieces.name == "PiecewiseBackend x 3"
    assert pieces.lines[0].startswith(
        "compile sizes: 2 ") and pieces.lines[1].startswith("compile ranges: 1-4, 5-16")
    assert ("3 x 3 = 9  (num_backend_compilations "
            f"+{deltas['num_backend_compilations']})" in pieces.lines[2])
    assert deltas["num_backend_compilations"] == 9
    assert ("guards offered" in text["TorchCompileWithNoGuardsWrapper"]
            and "kept 0" in text["TorchCompileWithNoGuardsWrapper"])
    assert "none: backend 'eager'" in text["post-grad passes"]
    dispatch = _stage(stages, "dispatch by num_tokens")
    # the calls made, their entries
    assert "2->2" in dispatch.lines[0] and "5->5-16" in dispatch.lines[0]
    # the same facts with the deltas given as a dict
    assert [s.lines for s in pipeline_facts(lm.model, deltas)] == [s.lines for s in stages]


@pytest.mark.compiles
def test_inductor_and_its_passes_are_drawn_as_png_and_svg(no_cache):
    lm, _, deltas = _compiled("inductor", 1, compile_sizes=[], compile_ranges_endpoints=[],
                                   max_num_batched_tokens=16,
                                   # the passes run
                                   inductor_compile_config={"fx_graph_cache": False})
    stages = pipeline_facts(lm, deltas)
    assert list(lm.model.backend.piecewise_backends[0].range_entries) == [Range(1, 16)]
    inductor = _stage(stages, "Inductor")
    assert (inductor.lines[0] == "compiles run: 2  (num_unique_compiles "
                                 f"+{deltas['num_unique_compiles']})")
    passes = _stage(stages, "post-grad passes")
    assert passes.lines[0].endswith("FixFunctionalization")  # always last
    assert passes.lines[1].startswith("ran on 2 graphs")
    assert passes.lines[2].endswith("-> 0")  # every auto_functionalized rewritten in place
    png = draw_pipeline(lm, deltas)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert draw_pipeline(lm, deltas, fmt="svg").lstrip().startswith(b"<?xml")


def test_a_model_that_did_not_compile_here_is_refused(no_cache):
    eager = build_model("llama", num_layers=1)
    with pytest.raises(ValueError, match="VLLM_COMPILE"):
        pipeline_facts(eager)
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="eager",
                           max_num_batched_tokens=16)
    with pytest.raises(ValueError, match="call it once first"):
        pipeline_facts(build_model("llama", num_layers=1, compilation_config=cc))
