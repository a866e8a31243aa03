"""Layerwise profiler ranges (seed §12): per layer when eager, per piece and
splitting op when compiled."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from minivllm_compile import CompilationConfig, CompilationMode
from minivllm_compile.models import build_model


def _ranges(lm, n=6):
    ids = torch.arange(n)
    lm(ids, ids)  # compile (if compiled) outside the profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        lm(ids, ids)
    return [e.name for e in prof.events() if e.name.startswith(("model.layers", "piece"))]


def test_eager_model_gets_one_range_per_decoder_layer():
    cc = CompilationConfig(mode=CompilationMode.NONE, enable_layerwise_nvtx_tracing=True)
    names = _ranges(build_model("llama", num_layers=3, compilation_config=cc))
    assert names == ["model.layers.0", "model.layers.1", "model.layers.2"]
    assert _ranges(build_model("llama", num_layers=3)) == []  # off by default


@pytest.mark.compiles
def test_piecewise_model_gets_ranges_around_pieces_and_splitting_ops():
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="eager",
                           enable_layerwise_nvtx_tracing=True, max_num_batched_tokens=16)
    names = _ranges(build_model("llama", num_layers=2, compilation_config=cc))
    assert names == ["piece 0 (compiled)", "model.layers.0.self_attn.attn", "piece 1 (compiled)",
                     "model.layers.1.self_attn.attn", "piece 2 (compiled)"]


@pytest.mark.compiles
def test_a_model_loaded_from_the_cache_keeps_its_ranges(tmp_path, monkeypatch):
    from minivllm_compile import compilation_counter

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "0")
    cc = lambda: CompilationConfig(mode=CompilationMode.VLLM_COMPILE, max_num_batched_tokens=16,  # noqa: E731
                                   enable_layerwise_nvtx_tracing=True)
    first = _ranges(build_model("llama", num_layers=1, compilation_config=cc()))
    with compilation_counter.expect(num_aot_artifacts_loaded=1, num_inductor_compiles=0):
        loaded = _ranges(build_model("llama", num_layers=1, compilation_config=cc()))
    assert first == loaded == ["piece 0 (compiled)", "model.layers.0.self_attn.attn",
                               "piece 1 (compiled)"]


def test_profiler_sees_tells_which_custom_op_calls_a_profile_shows():
    from minivllm_compile.compilation.nvtx import profiler_sees

    x, w = torch.randn(3, 8), torch.ones(8)
    # registered as vLLM's ops are (not torch.library.custom_op, which torch 2.14 may dispatch in
    # Python, unseen): every call goes through the C++ dispatcher, which records the event
    assert profiler_sees(torch.ops.minivllm.rms_norm.default, torch.empty_like(x), x, w, 1e-5)
    assert profiler_sees(torch.ops.minivllm.silu_and_mul.default, torch.empty(3, 4), x)

    @torch.library.custom_op("minivllm_test::seen", mutates_args=())
    def seen(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    python_dispatched = getattr(torch.ops.minivllm_test.seen.default, "_pyobj_dispatcher",
                                None) is not None
    assert profiler_sees(torch.ops.minivllm_test.seen.default, x) is not python_dispatched


def test_eager_layerwise_tracing_invokes_the_decorated_models_hooks():
    """vLLM's test_decorator (test_eager_layerwise_nvtx_invokes_module_hooks and
    test_non_eager_layerwise_nvtx_skips_module_hooks): with layerwise tracing on, mode NONE and no
    CUDA graphs, a decorated model is called as a module, so its forward hooks run; otherwise its
    calls go straight to forward, hooks skipped."""
    from torch import nn

    from minivllm_compile import CUDAGraphMode, support_torch_compile

    @support_torch_compile
    class Probe(nn.Module):
        def __init__(self, *, compilation_config=None):
            super().__init__()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    def calls(**kw) -> int:
        model = Probe(compilation_config=CompilationConfig(**kw)).eval()
        seen = []
        model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(args),
                                        with_kwargs=True)
        assert torch.equal(model(torch.tensor([1.0])), torch.tensor([2.0]))
        return len(seen)

    assert calls(mode=CompilationMode.NONE, enable_layerwise_nvtx_tracing=True) == 1
    assert calls(mode=CompilationMode.NONE) == 0
    assert calls(mode=CompilationMode.STOCK_TORCH_COMPILE, enable_layerwise_nvtx_tracing=True) == 0
    assert calls(mode=CompilationMode.NONE, enable_layerwise_nvtx_tracing=True,
                 cudagraph_mode=CUDAGraphMode.FULL, cudagraph_capture_sizes=[1],
                 max_num_batched_tokens=8) == 0


@pytest.mark.compiles
def test_the_backends_record_names_each_piece_under_every_wrapper():
    """compilation/piecewise_backend.StitchingRecord: with piecewise CUDA graphs (the CPU stand-in)
    and layerwise ranges both on, the stitching graph calls RangeWrapper(CUDAGraphWrapper(
    PiecewiseBackend)) for a compiled piece and RangeWrapper(submodule) for an attention op. The
    record names each layer, so the piece table lists every compiled piece's entries (read from
    split_gm's attribute, a RangeWrapper, it listed none)."""
    from minivllm_compile import viz
    from minivllm_compile.compilation.cuda_graph import CUDAGraphWrapper
    from minivllm_compile.compilation.nvtx import RangeWrapper
    from minivllm_compile.compilation.piecewise_backend import PiecewiseBackend

    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="eager",
                           enable_layerwise_nvtx_tracing=True, max_num_batched_tokens=16,
                           compile_sizes=[4], cudagraph_mode="PIECEWISE",
                           cudagraph_capture_sizes=[4])
    lm = build_model("llama", num_layers=2, compilation_config=cc)
    lm.warmup()
    backend = lm.model.backend
    record = backend.record
    assert record.split_gm is backend.split_gm
    compiled = [it.submod_name for it in backend.piecewise_graphs if not it.is_splitting_graph]
    assert list(record.backends) == compiled and len(compiled) == 3
    for it in backend.piecewise_graphs:
        called = record.called_for(it.submod_name)
        assert isinstance(called, RangeWrapper)
        assert getattr(backend.split_gm, it.submod_name) is called  # what forward really calls
        if it.is_splitting_graph:
            assert called.runnable is it.graph
        else:
            assert isinstance(called.runnable, CUDAGraphWrapper)
            assert called.runnable.runnable is record.backends[it.submod_name]
            assert isinstance(record.backends[it.submod_name], PiecewiseBackend)
    rows = {r["name"]: r for r in viz.piece_summary(backend)}
    assert all(rows[name]["entries"] == ["Range(4, 4)", "Range(1, 16)"] for name in compiled)
