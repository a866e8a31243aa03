"""CUDA-graph modes (cuda_graph.py, config.CUDAGraphMode). On a CPU every graph is the
StaticBufferReplay stand-in, which keeps a graph's contract: static inputs, static outputs."""

import contextlib

import pytest
import torch
from torch import nn

from minivllm_compile import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    compilation_counter,
    support_torch_compile,
)
from minivllm_compile.compilation.cuda_graph import (
    BatchDescriptor,
    CudagraphDispatcher,
    CUDAGraphWrapper,
    StaticBufferReplay,
)
from minivllm_compile.compilation.monitor import set_cudagraph_capturing_enabled
from minivllm_compile.config.compilation import AttentionCGSupport
from minivllm_compile.forward_context import set_forward_context
from minivllm_compile.models import build_model

# every test here compiles, or shares a module fixture that does: whole suite only
pytestmark = pytest.mark.compiles

VLLM = CompilationMode.VLLM_COMPILE
# padding changes the matmuls' shapes, so the sums may associate differently: float32 rounding only
TOL = dict(atol=1e-5, rtol=1e-5)
SIZES = [1, 2, 4, 8, 16]


@contextlib.contextmanager
def capturing():
    """As the model runner does around its capture at start-up."""
    set_cudagraph_capturing_enabled(True)
    try:
        yield
    finally:
        set_cudagraph_capturing_enabled(False)


def cfg(cg_mode="PIECEWISE", **kw):
    kw.setdefault("mode", VLLM)
    return CompilationConfig(backend="eager", max_num_batched_tokens=24, cudagraph_mode=cg_mode,
                             cudagraph_capture_sizes=kw.pop("sizes", SIZES), **kw)


@pytest.fixture(scope="module")
def eager():
    return build_model("llama", num_layers=2)


@pytest.mark.parametrize("mode", ["NONE", "PIECEWISE", "FULL", "FULL_AND_PIECEWISE"])
def test_every_num_tokens_matches_eager_and_captures_only_at_start_up(mode, eager):
    lm = build_model("llama", num_layers=2, compilation_config=cfg(mode))
    before = compilation_counter.clone()
    lm.warmup()
    captured = compilation_counter.num_cudagraph_captured - before.num_cudagraph_captured
    pieces = (compilation_counter.num_piecewise_capturable_graphs_seen
              - before.num_piecewise_capturable_graphs_seen)
    want = {"NONE": 0, "PIECEWISE": len(SIZES) * pieces, "FULL": len(SIZES),
            "FULL_AND_PIECEWISE": len(SIZES) * pieces + len(SIZES)}[mode]
    assert pieces == 3 and captured == want  # 2 layers: 3 compiled pieces between 2 attentions
    with compilation_counter.expect(num_cudagraph_captured=0):
        for n in range(1, 25):  # 17..24: above the largest capture size, no graph
            ids, pos = torch.randint(0, 200, (n,),
                                     generator=torch.Generator().manual_seed(n)), torch.arange(n)
            torch.testing.assert_close(lm(ids, pos), eager(ids, pos), **TOL)
        assert lm.generate(["hello world", "ab"], 6) == eager.generate(["hello world", "ab"], 6)


def test_the_dispatcher_pads_to_the_next_capture_size():
    cc = cfg("FULL_AND_PIECEWISE", sizes=[1, 2, 4, 8])
    d = CudagraphDispatcher(cc)
    table = {n: (d.dispatch(n)[0].name, d.dispatch(n)[1].num_tokens) for n in range(1, 11)}
    assert table == {1: ("PIECEWISE", 1), 2: ("PIECEWISE", 2), 3: ("PIECEWISE", 4),
                     4: ("PIECEWISE", 4),
                     5: ("PIECEWISE", 8), 6: ("PIECEWISE", 8), 7: ("PIECEWISE", 8),
                     8: ("PIECEWISE", 8),
                     9: ("NONE", 9), 10: ("NONE", 10)}
    # a uniform decode batch takes the FULL graph, keyed with its (padded) request count
    assert d.dispatch(3, uniform_decode=True) == (CUDAGraphMode.FULL,
                                                  BatchDescriptor(4, num_reqs=4, uniform=True))
    assert CudagraphDispatcher(cfg("FULL", sizes=[2, 8])).dispatch(3) == (
        CUDAGraphMode.FULL, BatchDescriptor(8, num_reqs=8))
    assert CudagraphDispatcher(cfg("FULL_DECODE_ONLY",
                                   sizes=[2, 8])).dispatch(3)[0] == CUDAGraphMode.NONE
    assert [(m.name, [x.num_tokens for x in ds]) for m, ds in d.get_capture_descs()] == [
        ("PIECEWISE", [8, 4, 2, 1]), ("FULL", [8, 4, 2, 1])]


def test_default_sizes_follow_vllms_list_capped_at_max_num_batched_tokens():
    cc = CompilationConfig(cudagraph_mode="PIECEWISE", max_num_batched_tokens=300)
    assert cc.cudagraph_capture_sizes == [1, 2, 4, *range(8, 256, 8), 256, 272, 288, 300]
    assert cc.max_cudagraph_capture_size == 300
    cc = CompilationConfig(cudagraph_mode="FULL", max_num_batched_tokens=2048,
                           max_cudagraph_capture_size=40)
    assert cc.cudagraph_capture_sizes == [1, 2, 4, 8, 16, 24, 32, 40]
    assert CompilationConfig(cudagraph_mode="full",
                             max_num_batched_tokens=1024).max_cudagraph_capture_size == 512


def test_the_default_is_no_cuda_graphs():
    cc = CompilationConfig()
    assert cc.cudagraph_mode == CUDAGraphMode.NONE and cc.cudagraph_capture_sizes == []
    assert cc.max_cudagraph_capture_size == 0 and cc.cudagraph_copy_inputs is False


@pytest.mark.parametrize("kw, field", [
    (dict(cudagraph_mode="SOMETIMES"), "cudagraph_mode"),
    (dict(cudagraph_mode=5), "cudagraph_mode"),
    (dict(cudagraph_mode="FULL", cudagraph_capture_sizes=[0, 4]), "cudagraph_capture_sizes"),
    (dict(cudagraph_mode="FULL", cudagraph_capture_sizes=[2.0]), "cudagraph_capture_sizes"),
    (dict(cudagraph_mode="FULL", cudagraph_capture_sizes=8), "cudagraph_capture_sizes"),
    (dict(cudagraph_mode="FULL", cudagraph_capture_sizes=[]), "cudagraph_capture_sizes"),
    (dict(cudagraph_mode="FULL", cudagraph_capture_sizes=[4, 512]), "cudagraph_capture_sizes"),
    (dict(cudagraph_mode="FULL", cudagraph_capture_sizes=[4, 8], max_cudagraph_capture_size=16),
     "max_cudagraph_capture_size"),
    (dict(cudagraph_mode="FULL", max_cudagraph_capture_size=0), "max_cudagraph_capture_size"),
    (dict(cudagraph_mode="PIECEWISE", mode=CompilationMode.DYNAMO_TRACE_ONCE), "cudagraph_mode"),
    (dict(cudagraph_mode="FULL_AND_PIECEWISE", mode=CompilationMode.NONE), "cudagraph_mode"),
    (dict(cudagraph_copy_inputs=1), "cudagraph_copy_inputs"),
])
def test_bad_values_fail_at_construction_naming_the_field(kw, field):
    with pytest.raises(ValueError, match=f"CompilationConfig.{field}"):
        CompilationConfig(max_num_batched_tokens=256, **kw)


def test_a_compile_size_that_padding_changes_is_refused():
    with pytest.raises(ValueError, match="compile_sizes contains 3"):
        CudagraphDispatcher(cfg("PIECEWISE", sizes=[2, 4], compile_sizes=[3]))


def test_piecewise_without_splitting_ops_resolves_as_vllm():
    assert cfg("PIECEWISE", splitting_ops=[]).cudagraph_mode == CUDAGraphMode.NONE
    assert cfg("FULL_AND_PIECEWISE", splitting_ops=[]).cudagraph_mode == CUDAGraphMode.FULL


@pytest.mark.parametrize("mode, support, want", [
    ("FULL", AttentionCGSupport.ALWAYS, "FULL"),
    ("FULL", AttentionCGSupport.UNIFORM_BATCH, "FULL_AND_PIECEWISE"),
    ("FULL", AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE, "FULL_AND_PIECEWISE"),
    ("FULL_AND_PIECEWISE", AttentionCGSupport.NEVER, "PIECEWISE"),
    ("FULL_DECODE_ONLY", AttentionCGSupport.NEVER, "PIECEWISE"),
    ("PIECEWISE", AttentionCGSupport.NEVER, "PIECEWISE"),
])
def test_a_mode_the_attention_op_cannot_hold_is_resolved_down(mode, support, want):
    cc = cfg(mode)
    cc.resolve_cudagraph_mode(support)
    assert cc.cudagraph_mode.name == want


def test_resolution_without_attention_in_the_splitting_ops_and_the_refusal():
    cc = cfg("FULL", splitting_ops=["minivllm::short_conv"])
    cc.resolve_cudagraph_mode(AttentionCGSupport.UNIFORM_BATCH)
    assert cc.cudagraph_mode == CUDAGraphMode.FULL_DECODE_ONLY
    cc = cfg("FULL_DECODE_ONLY", mode=CompilationMode.DYNAMO_TRACE_ONCE)
    cc.resolve_cudagraph_mode(AttentionCGSupport.NEVER)
    assert cc.cudagraph_mode == CUDAGraphMode.NONE and cc.cudagraph_capture_sizes == []
    with pytest.raises(ValueError, match="cudagraph_mode=FULL is not supported"):
        cfg("FULL").resolve_cudagraph_mode(AttentionCGSupport.NEVER)


def test_mode_methods_as_vllm():
    M = CUDAGraphMode
    assert (M.FULL_AND_PIECEWISE.decode_mode() == M.FULL and M.FULL_AND_PIECEWISE.mixed_mode()
            == M.PIECEWISE)
    assert (M.FULL_DECODE_ONLY.mixed_mode() == M.NONE
            and not M.FULL_DECODE_ONLY.requires_piecewise_compilation())
    assert (M.FULL_AND_PIECEWISE.without_piecewise() == M.FULL_DECODE_ONLY
            and M.PIECEWISE.without_piecewise() == M.NONE)
    assert M.FULL_AND_PIECEWISE.has_full_cudagraphs() and not M.PIECEWISE.has_full_cudagraphs()
    assert M.valid_runtime_modes() == {M.NONE, M.PIECEWISE, M.FULL} and not M.NONE


# --- the wrapper's contract, on the stand-in ------------------------------------------------------

def _wrapper(copy_inputs=False):
    cc = cfg("FULL", cudagraph_copy_inputs=copy_inputs)
    return CUDAGraphWrapper(lambda x: x * 2, cc, CUDAGraphMode.FULL)


D4 = BatchDescriptor(4, num_reqs=4)


def _step(w, x, desc=D4):
    with set_forward_context(None, {}, CUDAGraphMode.FULL, desc):
        return w(x)


def test_a_kept_output_is_overwritten_by_the_next_replay():
    w, x = _wrapper(), torch.ones(4)
    with capturing():
        first = _step(w, x)
    assert isinstance(w.concrete_cudagraph_entries[BatchDescriptor(4, 4)].cudagraph,
                      StaticBufferReplay)
    kept = first
    x.fill_(5)  # the same buffer, new values
    second = _step(w, x)
    # the kept "step 1" output changed
    assert second is kept and torch.equal(kept, torch.full((4,), 10.0))


def test_without_copy_inputs_a_fresh_input_tensor_is_not_seen():
    w, x = _wrapper(copy_inputs=False), torch.ones(4)
    with capturing():
        _step(w, x)
    out = _step(w, torch.full((4,), 3.0))  # a new tensor: the graph still reads the captured one
    assert torch.equal(out, torch.full((4,), 2.0))


def test_with_copy_inputs_a_fresh_input_tensor_is_copied_in():
    w, x = _wrapper(copy_inputs=True), torch.ones(4)
    with capturing():
        _step(w, x)
    assert torch.equal(_step(w, torch.full((4,), 3.0)), torch.full((4,), 6.0))


def test_capture_outside_start_up_is_refused_and_other_modes_pass_through():
    w = _wrapper()
    with pytest.raises(RuntimeError, match="capture is only allowed at start-up"):
        _step(w, torch.ones(4))
    with set_forward_context(None, {}, CUDAGraphMode.PIECEWISE, BatchDescriptor(4)):
        out = w(torch.ones(4))
    assert not w.concrete_cudagraph_entries
    assert torch.equal(out, torch.full((4,), 2.0))


def test_hybrid_model_decodes_through_full_graphs():
    hybrid_eager = build_model("hybrid", num_layers=2)
    lm = build_model("hybrid", num_layers=2, compilation_config=cfg("FULL_AND_PIECEWISE"))
    lm.warmup()
    with compilation_counter.expect(num_cudagraph_captured=0):
        assert lm.generate(["abc", "hello"], 5) == hybrid_eager.generate(["abc", "hello"], 5)
        for n in (3, 7, 16, 20):
            ids, pos = torch.arange(n) + 30, torch.arange(n)
            torch.testing.assert_close(lm(ids, pos), hybrid_eager(ids, pos), **TOL)


class Counting(nn.Module):
    def __init__(self, *, compilation_config=None):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return x * 2


def test_buffer_mutation_is_allowed_without_cuda_graphs():
    """vLLM refuses Dynamo's `update` only under a CUDA-graph mode: without a graph it just runs."""
    m = support_torch_compile(type("CountingCG", (Counting,), {}))(
        compilation_config=CompilationConfig(mode=CompilationMode.DYNAMO_TRACE_ONCE,
                                             backend="eager"))
    for _ in range(2):
        m(torch.randn(4, 8))
    assert m.calls.item() == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a real torch.cuda.CUDAGraph needs CUDA")
def test_real_cuda_graph_capture_and_replay():
    w = CUDAGraphWrapper(lambda x: x * 2, cfg("FULL"), CUDAGraphMode.FULL)
    x = torch.ones(4, device="cuda")
    with capturing():
        out = _step(w, x)
    assert isinstance(w.concrete_cudagraph_entries[BatchDescriptor(4, 4)].cudagraph,
                      torch.cuda.CUDAGraph)
    x.fill_(5)
    assert _step(w, x) is out and torch.equal(out, torch.full((4,), 10.0, device="cuda"))


LOAD_CHILD = r"""
import json, sys, torch
from minivllm_compile import CompilationConfig, CompilationMode, CUDAGraphMode, compilation_counter
from minivllm_compile.models import build_model
cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, max_num_batched_tokens=8,
                       cudagraph_mode=CUDAGraphMode[sys.argv[1]], cudagraph_capture_sizes=[1, 2, 4])
lm, eager = (build_model("llama", num_layers=1, compilation_config=cc),
             build_model("llama", num_layers=1))
lm.warmup()
at_start = vars(compilation_counter).copy()
diff = 0.0
for n in range(1, 9):  # 5..8: above the largest capture size, no graph
    ids = torch.randint(0, 200, (n,), generator=torch.Generator().manual_seed(n))
    diff = max(diff, (lm(ids, torch.arange(n)) - eager(ids, torch.arange(n))).abs().max().item())
print("RESULT " + json.dumps({"at_start": at_start,
                              "captured_later": compilation_counter.num_cudagraph_captured
                              - at_start["num_cudagraph_captured"], "diff": diff}))
"""


@pytest.mark.parametrize("mega", ["1", "0"])
def test_an_aot_loaded_model_is_wrapped_and_captured_as_a_compiled_one(mega, tmp_path):
    """A warm start builds the pieces without running the compiler (mega: from the AOT file; not
    mega: VllmBackend again over the saved graph): their wrappers must exist there too, capture at
    start-up and replay the loaded kernels. The cache key holds cudagraph_mode (as vLLM 0.34's), so
    the artifact a PIECEWISE start loads was compiled under PIECEWISE."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "VLLM_DISABLE_COMPILE_CACHE": "0",
           "VLLM_CACHE_ROOT": str(tmp_path / "cache"),
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "VLLM_USE_MEGA_AOT_ARTIFACT": mega}

    def run(mode: str) -> dict:
        out = subprocess.run([sys.executable, "-c", LOAD_CHILD, mode], env=env,
                             capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(next(line for line in out.stdout.splitlines()
                               if line.startswith("RESULT "))[7:])

    cold, warm = run("PIECEWISE"), run("PIECEWISE")
    assert (cold["at_start"]["num_aot_artifacts_saved"] == 1
            and cold["at_start"]["num_cudagraph_captured"] == 2 * 3)
    s = warm["at_start"]
    # loaded, not compiled
    assert s["num_aot_artifacts_loaded"] == 1 and s["num_inductor_compiles"] == 0
    # not mega: the backend runs again over the saved graph, each piece
    # through CompilerManager.compile
    assert (s["num_graphs_seen"], s["num_backend_compilations"]) == (
        (0, 0) if mega == "1" else (1, 2))
    # 1 layer: 2 compiled pieces x capture sizes 1, 2, 4
    assert s["num_cudagraph_captured"] == 2 * 3
    assert warm["captured_later"] == 0 and warm["diff"] <= 1e-4 and cold["diff"] <= 1e-4
