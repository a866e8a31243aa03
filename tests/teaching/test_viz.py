"""viz/: tables and pictures of graphs and pieces, and readers of Inductor's generated code."""

import importlib.util
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch
import torch.fx as fx

import minivllm_compile
from minivllm_compile import CompilationConfig, CompilationMode, viz
from minivllm_compile.models import build_model

# every test here compiles, or shares a module fixture that does: whole suite only
pytestmark = pytest.mark.compiles

PNG = b"\x89PNG\r\n\x1a\n"
REAL_DOT = shutil.which("dot")


@pytest.fixture(scope="module")
def backend():
    """The VllmBackend of a 1-layer Llama split at attention (eager pieces: the
    split is the subject)."""
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="eager", compile_sizes=[4],
                           compile_ranges_endpoints=[8], max_num_batched_tokens=16)
    lm = build_model("llama", num_layers=1, compilation_config=cc)
    lm(torch.arange(6), torch.arange(6))
    return lm.model.backend


def test_the_core_never_imports_viz():
    """DESIGN: viz/ reads what the core records; the core never imports it."""
    imports_viz = re.compile(r"^\s*(from\s+minivllm_compile\.viz\b|"
                             r"import\s+minivllm_compile\.viz\b|"
                             r"from\s+(minivllm_compile|\.+)\s+import\s+[^\n]*\bviz\b)",
                             re.MULTILINE)
    root = Path(minivllm_compile.__file__).parent
    # the benchmarks are users of the core, like a notebook; so are the exercises' graders
    # (notebook 17's rerun its models through viz/debugging.py)
    core = [p for p in root.rglob("*.py") if not {"viz", "exercises", "bench"}
            & set(p.relative_to(root).parts)]
    assert len(core) > 10
    for path in core:
        assert not imports_viz.search(path.read_text()), f"{path} imports viz"
    assert imports_viz.search("from minivllm_compile import CompilationConfig, viz")


def test_graph_table_shows_symbolic_and_static_dims(backend):
    rows = viz.graph_table(backend.graphs[0])
    by_node = {r["node"]: r for r in rows}
    assert by_node["embed_tokens.weight"]["shape"] == "f32[258, 96]"  # inputs get short names
    assert any(re.fullmatch(r"Sym\(s\d+\)", r["shape"]) for r in rows)
    attention = [r for r in rows if r["target"] == "minivllm.unified_attention_with_output"]
    assert len(attention) == 1 and attention[0]["op"] == "call_function"
    text = viz.table_text(rows)
    assert text.splitlines()[0].split() == ["node", "op", "target", "shape"]
    assert len(text.splitlines()) == len(rows) + 1
    dynamo_name = (
        "l_self_modules_layers_modules_0_modules_mlp_modules_gate_up_proj_parameters_weight_")
    assert viz.short_name(dynamo_name) == "layers.0.mlp.gate_up_proj.weight"


def test_piece_summary_and_piece_of_node(backend):
    rows = viz.piece_summary(backend)
    assert [r["splitting"] for r in rows] == [False, True, False]
    assert rows[1]["ops"] == ["minivllm.unified_attention_with_output"]
    assert rows[0]["entries"] == ["Range(4, 4)", "Range(1, 8)",
                                  "Range(9, 16)"] and "entries" not in rows[1]
    where = viz.piece_of_node(backend.graphs[0], backend)
    calls = [n for n in backend.graphs[0].graph.nodes if n.op not in ("placeholder", "output")]
    assert set(where) == set(calls)
    attention = next(n for n in calls if "unified_attention" in str(n.target))
    assert where[attention].is_splitting_graph and where[calls[0]].submod_name == "submod_0"
    # not the graph's pieces
    assert viz.piece_of_node(backend.graphs[0], backend.piecewise_graphs[:1]) == {}


def test_dot_text_for_pieces_and_nodes(backend):
    dot = viz.to_dot(backend)
    assert dot.startswith("digraph G {") and dot.endswith("}") and dot.count("{") == dot.count("}")
    for name in ("submod_0", "submod_1", "submod_2"):
        assert f'"{name}" [label="{name} · ' in dot
    fill = viz.boxes.COLOURS["splitting"][0]
    assert re.search(rf'"submod_1" \[label="submod_1 · splitting[^\]]*fillcolor="{fill}"', dot)
    assert '"submod_0" -> "submod_2";' in dot  # data: the residual and the attention output buffer
    # attention writes in place: order only
    assert '"submod_1" -> "submod_2" [style=dashed];' in dot
    nodes = viz.to_dot(backend.graphs[0], backend, title='a "quoted" title')
    assert nodes.count("subgraph cluster_") == 3 and 'label="a \\"quoted\\" title"' in nodes


def test_matplotlib_fallback_draws_pieces_and_nodes(backend, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    pieces = viz.draw_graph(backend)
    assert pieces.data.startswith(PNG) and len(pieces.data) > 5000
    nodes = viz.draw_graph(backend.graphs[0], backend, fmt="svg")
    assert "<svg" in nodes.data and "minivllm.unified_attention_with_output" in nodes.data
    assert viz.draw_graph(backend.piecewise_graphs[0].graph,
                          renderer="matplotlib").data.startswith(PNG)
    with pytest.raises(FileNotFoundError, match="dot"):
        viz.draw_graph(backend, renderer="dot")
    with pytest.raises(ValueError, match="fmt"):
        viz.draw_graph(backend, fmt="jpg")


def test_dot_renderer_pipes_the_dot_text(backend, monkeypatch, tmp_path):
    """A stand-in `dot` records its arguments and input; with Graphviz
    installed, the real one too."""
    fake = tmp_path / "dot"
    fake.write_text(f'#!/bin/sh\necho "$@" > {tmp_path}/args\ncat > '
                    f'{tmp_path}/input\nprintf "PNGDATA"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: str(fake) if name == "dot" else None)
    out = viz.draw_graph(backend)
    assert out.data == b"PNGDATA"
    assert (tmp_path / "args").read_text().split() == ["-Tpng"]
    assert (tmp_path / "input").read_text() == viz.to_dot(backend)
    if REAL_DOT is not None:
        monkeypatch.setattr(shutil, "which", lambda name, *a, **k: REAL_DOT
                            if name == "dot" else None)
        assert viz.draw_graph(backend).data.startswith(PNG)
        assert b"<svg" in viz.render_dot(viz.to_dot(backend.graphs[0], backend), "svg")


CODE = """
cpp_fused_add_0 = async_compile.cpp_pybinding(['const float*', 'float*', 'const int64_t'], r'''
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const float* in_ptr0,
                       float* out_ptr0,
                       const int64_t ks0)
{
    for(int64_t x0=0; x0<ks0; x0++) { out_ptr0[x0] = in_ptr0[x0] + 1; }
}
''')
triton_poi_fused_mul_1 = async_compile.triton('triton_poi_fused_mul_1', '''
import triton
@triton_heuristics.pointwise(size_hints={'x': 16})
@triton.jit
def triton_poi_fused_mul_1(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xnumel = 384
''', device_str='cpu')

class Runner:
    def call(self, args):
        cpp_fused_add_0(arg0_1, buf0, s72)
        extern_kernels.mm(buf0, arg1_1, out=buf1)
        torch.ops.minivllm.rms_norm.default(buf2, buf1, arg2_1, 1e-05)
        extern_kernels.mm(buf2, arg1_1, out=buf3)
        triton_poi_fused_mul_1.run(buf3, buf4, 384, stream=stream0)
        return (buf4, )

runner = Runner(partitions=[])
"""


def test_reading_generated_code():
    assert viz.kernel_signatures(CODE) == [
        "cpp_fused_add_0(const float* in_ptr0, float* out_ptr0, const int64_t ks0)",
        "triton_poi_fused_mul_1(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr)"]
    sources = viz.kernel_sources(CODE)
    assert sources["cpp_fused_add_0"].startswith('extern "C"')
    triton = sources["triton_poi_fused_mul_1"]
    assert triton.startswith("@triton.jit") and "xnumel = 384" in triton
    calls = viz.calls_in(CODE)
    assert calls["fused"] == {"cpp_fused_add_0": 1, "triton_poi_fused_mul_1": 1}
    assert calls["extern"] == {"extern_kernels.mm": 2}
    assert calls["ops"] == {"torch.ops.minivllm.rms_norm.default": 1}


def test_reading_code_inductor_really_wrote():
    """The readers against this torch's own output: an Inductor compile of a norm + matmul, its
    source captured as CompilerManager captures it."""
    from torch._inductor.compile_fx import compile_fx

    from minivllm_compile.compilation.compiler_interface import capture_output_code

    def f(x, w, m):
        return torch.relu(x * w).sum(-1, keepdim=True) * (x @ m)

    args = [torch.randn(8, 32), torch.randn(32), torch.randn(32, 16)]
    code: list[str] = []
    with capture_output_code(code), torch._inductor.config.patch(fx_graph_cache=False):
        compiled = compile_fx(fx.symbolic_trace(f), args)
    torch.testing.assert_close(compiled(*args), f(*args), rtol=1e-5, atol=1e-5)
    src = "\n".join(code)
    (name, kernel), = viz.kernel_sources(src).items()
    assert name.startswith("cpp_fused_") and kernel.startswith('extern "C"')
    sig, = viz.kernel_signatures(src)
    # no ks0: static
    assert re.fullmatch(rf"{name}\((const )?float\* \w+(, (const )?float\* \w+)*\)", sig)
    calls = viz.calls_in(src)
    assert calls["fused"] == {name: 1} and calls["extern"] == {
        "extern_kernels.mm": 1} and not calls["ops"]
    # the matmul's output and the fused kernel's at least; every one a static float32 buffer
    buffers = viz.buffers_in(src)
    assert len(buffers) >= 2
    assert all(b.dtype == "float32" and b.name.startswith("buf") for b in buffers)
    assert ("8", "16") in [b.sizes for b in buffers]  # x @ m
    stats = viz.call_stats(src)
    assert stats["buffers"] == len(buffers) == src.count("= empty_strided_cpu(")
    assert stats["buffer_bytes"] == sum(4 * eval("*".join(b.sizes)) for b in buffers)
    assert (stats["generated_kernels"], stats["extern_calls"], stats["op_calls"]) == (1, 1, 0)


# what one compiled entry writes for a piece with a dynamic size, a clone fused into a kernel, a
# reused buffer and a copy back into an input (the shapes of FixFunctionalization's notebook 05)
ENTRY_CODE = """
cpp_fused_clone_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r'''
extern "C" void kernel(const float* in_ptr0, float* out_ptr0) { }
''')

class Runner:
    def call(self, args):
        arg0_1, arg1_1, arg2_1 = args
        args.clear()
        s72 = arg0_1
        buf0 = empty_strided_cpu((s72, 96), (96, 1), torch.float32)
        cpp_fused_clone_0(arg1_1, buf0, s72)
        buf1 = empty_strided_cpu((2*s72, 8), (8, 1), torch.bfloat16)
        torch.ops.minivllm.rms_norm.default(buf1, buf0, arg2_1, 1e-05)
        buf2 = buf0; del buf0  # reuse
        extern_kernels.mm(buf1, arg2_1, out=buf2)
        buf3 = empty_strided_cpu((4, ), (1, ), torch.int64)
        torch.ops.aten.copy_.default(arg1_1, buf2)
        arg1_1.copy_(buf2)
        return (buf2, buf3, )

runner = Runner(partitions=[])
call = runner.call


def benchmark_compiled_module(args, times=10, repeat=10):
    buf9 = empty_strided_cpu((99, ), (1, ), torch.float32)
    cpp_fused_clone_0(buf9)
"""


def test_call_stats_counts_what_call_allocates_and_runs():
    # the reused buf2 is no new buffer; benchmark_compiled_module is not call()
    assert viz.buffers_in(ENTRY_CODE) == [viz.Buffer("buf0", ("s72", "96"), "float32"),
                                          viz.Buffer("buf1", ("2*s72", "8"), "bfloat16"),
                                          viz.Buffer("buf3", ("4",), "int64")]
    stats = viz.call_stats(ENTRY_CODE, num_tokens=16)
    assert stats == {"buffers": 3, "buffer_bytes": 16 * 96 * 4 + 32 * 8 * 2 + 4 * 8,
                     "generated_kernels": 1, "copy_kernels": 1, "extern_calls": 1, "op_calls": 2,
                     "copy_calls": 2}
    # two sources joined (an entry's code is a list of them): their counts add up
    both = viz.call_stats(ENTRY_CODE + "\n" + ENTRY_CODE, 16)
    assert both == {k: 2 * v for k, v in stats.items()}
    # an older torch's module-level `def call(args):`, which ends at the next top-level line
    older = ENTRY_CODE.replace("class Runner:\n", "").replace("\n    ", "\n")
    assert viz.call_stats(older.replace("def call(self, args)", "def call(args)"), 16) == stats
    with pytest.raises(ValueError, match=r"buf0's size \(s72, 96\) depends on the number of "
                                         r"tokens \(s72\): pass num_tokens="):
        viz.call_stats(ENTRY_CODE)


# what a GPU writes (torch 2.13 style: a dynamic kernel's size computed on its own line first),
# verbatim: the launch line stays as long as Inductor writes it (hence the noqa)
CUDA_CODE = """
triton_poi_fused_embedding_0 = async_compile.triton('triton_poi_fused_embedding_0', '''
import triton
@triton_heuristics.pointwise(size_hints={'x': 1024}, filename=__file__)
@triton.jit
def triton_poi_fused_embedding_0(in_ptr0, in_ptr1, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xoffset = tl.program_id(0) * XBLOCK
''', device_str='cuda')

class Runner:
    def call(self, args):
        arg0_1, arg1_1, arg2_1, arg3_1 = args
        args.clear()
        s72 = arg1_1
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            buf1 = empty_strided_cuda((s72, 96), (96, 1), torch.float32)
            stream0 = get_raw_stream(0)
            triton_poi_fused_embedding_0_xnumel = 96*s72
            triton_poi_fused_embedding_0.run(arg0_1, arg2_1, buf1, triton_poi_fused_embedding_0_xnumel, stream=stream0)
            buf0 = empty_strided_cuda((s72, 96), (96, 1), torch.float32)
            torch.ops.minivllm.rms_norm.default(buf0, buf1, arg3_1, 1e-05)
            buf4 = empty_strided_cuda((s72, 192), (192, 1), torch.float32)
            extern_kernels.mm(buf0, reinterpret_tensor(arg2_1, (96, 192), (1, 96), 0), out=buf4)
        return (buf4, )

runner = Runner(partitions=[])
"""  # noqa: E501


def test_reading_triton_code_as_a_gpu_writes_it():
    """Notebooks 05, 07 and 08 read a GPU's code with these: a launch is `name.run(...)`, and the
    `name_xnumel = ...` line before it (or torch 2.11's plain `s72`
    argument) is no second launch."""
    (name, kernel), = viz.kernel_sources(CUDA_CODE).items()
    assert name == "triton_poi_fused_embedding_0" and kernel.startswith("@triton.jit")
    assert viz.kernel_signatures(CUDA_CODE) == [f"{name}(in_ptr0, in_ptr1, out_ptr0, "
                                                "xnumel, XBLOCK : tl.constexpr)"]
    calls = viz.calls_in(CUDA_CODE)
    assert calls["fused"] == {name: 1} and calls["extern"] == {"extern_kernels.mm": 1}
    assert calls["ops"] == {"torch.ops.minivllm.rms_norm.default": 1}
    assert [(b.name, b.sizes) for b in viz.buffers_in(CUDA_CODE)] == [
        ("buf1", ("s72", "96")), ("buf0", ("s72", "96")), ("buf4", ("s72", "192"))]
    assert viz.call_stats(CUDA_CODE, num_tokens=2)["buffer_bytes"] == 2 * (96 + 96 + 192) * 4
    older = CUDA_CODE.replace(f"            {name}_xnumel = 96*s72\n", "").replace(
        f"{name}_xnumel,", "s72, 96,")
    assert viz.calls_in(older) == calls


@pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                    reason="needs triton (codegen only, no GPU)")
def test_reading_triton_code_inductor_really_wrote():
    """The same readers against the Triton this torch's Inductor writes for a dynamic graph (its
    launch sized by a symbol, on a line of its own in newer torch)."""
    from minivllm_compile.compilation.piecewise_backend import get_fake_args_from_graph
    from minivllm_compile.viz.kernels import triton_source_codegen_only

    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(lambda x, w: torch.relu(x * w) + 1, backend=capture, dynamic=True)(
        torch.randn(8, 32), torch.randn(32))
    torch._dynamo.reset()
    gm, = graphs
    src = triton_source_codegen_only(gm, get_fake_args_from_graph(gm), dynamic=True)
    (name, kernel), = viz.kernel_sources(src).items()
    assert re.fullmatch(r"triton_poi_fused_\w+_0", name) and kernel.startswith("@triton.jit")
    launch = src[src.index(f"{name}.run("):].splitlines()[0]
    assert re.search(r"\bs\d+\b", launch) or f"{name}_xnumel = " in src  # sized at run time
    calls = viz.calls_in(src)
    assert calls["fused"] == {name: 1} and not calls["extern"] and not calls["ops"]


def test_describe_cache_reports_a_bad_entry_and_goes_on(tmp_path):
    """A truncated cache_key_factors.json, a dangling symlink and an unreadable folder each get a
    line saying what is wrong with them; the entries after them are still described."""
    import os

    from minivllm_compile.viz.cache import describe_cache

    root = tmp_path / "torch_compile_cache"
    bad = root / "aaa" / "rank_0_0" / "backbone"
    bad.mkdir(parents=True)
    (bad / "cache_key_factors.json").write_text('{"config": "abc", "env"')  # cut mid-write
    (root / "bbb").mkdir()
    (root / "bbb" / "gone").symlink_to(tmp_path / "nowhere")
    good = root / "ccc" / "rank_0_0" / "backbone"
    good.mkdir(parents=True)
    (good / "cache_key_factors.json").write_text(
        '{"config": {"version": "c0ffee"}, "code": {"files": [{"path": "a"}]}}')
    locked = root / "ddd"
    locked.mkdir()
    (locked / "inside").write_text("x")
    locked.chmod(0)
    try:
        text = describe_cache(root)
    finally:
        locked.chmod(0o755)
    assert "cache_key_factors.json" in text and "unreadable" in text, text
    assert "gone" in text and f"dangling symlink to {tmp_path / 'nowhere'}" in text, text
    assert "· config.version: c0ffee" in text and "· code: 1 files" in text, text  # went on
    if os.geteuid() != 0:  # root reads any folder
        assert "ddd/" in text and "cannot list" in text, text
