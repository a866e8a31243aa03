"""Piecewise compilation (seed §5, §6, §9, §14, §15): split at the splitting ops, every size and
range compiled up front, dispatch by num_tokens, nothing compiled afterwards."""

import collections
import operator
import re

import pytest
import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from minivllm_compile import CompilationConfig, CompilationMode, Range, compilation_counter
from minivllm_compile.compilation.backends import split_graph
from minivllm_compile.compilation.partition_rules import should_split, warn_unknown_splitting_ops
from minivllm_compile.compilation.piecewise_backend import (
    create_concrete_args,
    get_fake_args_from_graph,
)
from minivllm_compile.forward_context import set_forward_context
from minivllm_compile.models import build_model

# every test here compiles, or shares a module fixture that does: whole suite only
pytestmark = pytest.mark.compiles

L = 2
SIZES, ENDPOINTS, MAX = [4, 8], [8], 24  # 8 is also a range end: a size wins over its range


def vllm_cfg(backend="inductor", **kw):
    kw.setdefault("compile_sizes", SIZES)
    kw.setdefault("compile_ranges_endpoints", ENDPOINTS)
    kw.setdefault("max_num_batched_tokens", MAX)
    return CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend=backend, **kw)


@pytest.fixture(scope="module")
def compiled():
    """The L-layer tiny Llama under VLLM_COMPILE with Inductor, and the counter deltas of its
    first call."""
    lm = build_model("llama", num_layers=L, compilation_config=vllm_cfg())
    before = compilation_counter.clone()
    lm(torch.arange(10), torch.arange(10))
    after = compilation_counter.clone()
    deltas = {f: getattr(after, f) - getattr(before, f) for f in vars(after)}
    return lm, deltas


@pytest.fixture(scope="module")
def eager():
    return build_model("llama", num_layers=L)


def test_counts_follow_the_formula(compiled):
    lm, d = compiled
    cc = lm.model.compilation_config
    ranges = cc.get_compile_ranges()
    sizes_not_ranges = [s for s in cc.compile_sizes if Range(s, s) not in ranges]
    assert d["num_graphs_seen"] == 1
    assert d["num_piecewise_graphs_seen"] == 2 * L + 1
    assert d["num_piecewise_capturable_graphs_seen"] == L + 1
    assert d["num_backend_compilations"] == (L + 1) * (len(sizes_not_ranges) + len(ranges))
    assert ([it.is_splitting_graph for it in lm.model.backend.piecewise_graphs]
            == [False, True] * L + [False])


def test_every_num_tokens_runs_without_compiling_and_matches_eager(compiled, eager):
    lm, _ = compiled
    g = torch.Generator().manual_seed(0)
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=0,
                                    num_inductor_compiles=0):
        for n in range(1, MAX + 1):
            ids = torch.randint(0, 258, (n,), generator=g)
            torch.testing.assert_close(lm(ids, torch.arange(n)), eager(ids, torch.arange(n)),
                                       atol=1e-4, rtol=1e-4)


def test_generate_gives_the_eager_tokens(compiled, eager):
    lm, _ = compiled
    prompts = ["def add(a, b):", "for i in"]  # a prefill of 24 tokens: MAX exactly
    with compilation_counter.expect(num_backend_compilations=0):
        assert lm.generate(prompts, 6) == eager.generate(prompts, 6)


def test_a_num_tokens_outside_every_entry_names_the_entries(compiled):
    lm, _ = compiled
    with pytest.raises(ValueError, match=r"num_tokens=25 is outside every compiled entry \(sizes "
                                         r"\[4, 8\], ranges \[Range\(1, 8\), Range\(9, 24\)\]\)"):
        lm(torch.arange(25), torch.arange(25))


def test_dispatch_by_num_tokens(compiled):
    lm, _ = compiled
    piece = lm.model.backend.piecewise_backends[0]
    assert piece._find_range_for_shape(4).compile_range == Range(4, 4)
    assert piece._find_range_for_shape(8).compile_range == Range(8, 8)  # the size wins
    assert piece._find_range_for_shape(7).compile_range == Range(1, 8)
    assert piece._find_range_for_shape(9).compile_range == Range(9, 24)
    assert piece._find_range_for_shape(99) is None


def test_size_entries_run_static_kernels_range_entries_symbolic_ones(compiled):
    """Seed §6: a size is compiled from concrete args (no symbol in the generated code), a range
    from the graph's fake args (num_tokens is a kernel argument)."""
    lm, _ = compiled
    symbol = re.compile(r"\bk?s\d+\b")
    entries = lm.model.backend.compiler_manager.entries
    for e in entries:
        code = "\n".join(e.code)
        assert code, "Inductor's generated code was recorded"
        if e.compile_range.is_single_size():
            assert not symbol.search(code), e.compile_range
        else:
            assert symbol.search(code), e.compile_range


def test_concrete_vs_fake_args():
    lm = build_model("llama", num_layers=1, compilation_config=vllm_cfg(backend="eager"))
    lm(torch.arange(6), torch.arange(6))
    piece = lm.model.backend.piecewise_backends[0].graph
    fake = get_fake_args_from_graph(piece)
    concrete = create_concrete_args(piece, 512)
    assert any(isinstance(a, torch.SymInt) for a in fake)
    assert not any(isinstance(a, torch.SymInt) for a in concrete)
    for f, c in zip(fake, concrete):
        if isinstance(f, torch.Tensor) and f.dim() and isinstance(f.shape[0], torch.SymInt):
            assert c.shape[0] == 512 and all(isinstance(s, int) for s in c.shape)


def test_compile_sizes_none_still_finds_the_range():
    """Seed §5: `if self.compile_sizes is None: return None` skipped the ranges. Here None is []."""
    lm = build_model("llama", num_layers=1, compilation_config=vllm_cfg(backend="eager",
                                                                        compile_sizes=None))
    lm(torch.arange(6), torch.arange(6))
    piece = lm.model.backend.piecewise_backends[0]
    assert piece.compile_sizes == []
    assert piece._find_range_for_shape(3).compile_range == Range(1, 8)


def test_identical_layers_compile_once():
    """1 layer: 2 pieces to compile; 4 layers: 5 pieces, but the 3 middle ones are identical and
    share one artifact per entry. num_inductor_compiles counts every adaptor call as vLLM's does
    (L + 1: its adaptor counts before AOTAutograd's cache key finds the earlier artifact); our
    num_unique_compiles counts the compiles that ran."""
    counts = {}
    for layers in (1, 4):
        cc = vllm_cfg(compile_sizes=[], compile_ranges_endpoints=[], max_num_batched_tokens=16)
        lm = build_model("llama", num_layers=layers, compilation_config=cc)
        with compilation_counter.expect(num_piecewise_capturable_graphs_seen=layers + 1,
                                        num_backend_compilations=layers + 1,
                                        num_inductor_compiles=layers + 1):
            before = compilation_counter.num_unique_compiles
            lm(torch.arange(5), torch.arange(5))
            counts[layers] = compilation_counter.num_unique_compiles - before
    assert counts == {1: 2, 4: 3}


def test_hybrid_splits_on_attention_and_the_conv_mixer():
    lm = build_model("hybrid", num_layers=4, compilation_config=vllm_cfg(backend="eager"))
    eager = build_model("hybrid", num_layers=4)
    with compilation_counter.expect(num_piecewise_graphs_seen=9,
                                    num_piecewise_capturable_graphs_seen=5):
        assert lm.generate(["def f(", "import"], 5) == eager.generate(["def f(", "import"], 5)
    split_nodes = [str(n.target) for it in lm.model.backend.piecewise_graphs
                   if it.is_splitting_graph
                   for n in it.graph.graph.nodes if n.op == "call_function"]
    assert split_nodes == ["minivllm.short_conv", "minivllm.unified_attention_with_output"] * 2


class LogDispatch(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def test_what_still_reaches_the_dispatcher(compiled, eager):
    """Seed §9, checked: Inductor's fused C++/Triton kernels never enter the dispatcher. What does:
    the splitting ops (run eagerly between pieces), the custom ops Inductor calls as fallbacks, and
    its extern matmuls. The seed's "compiled pieces skip the dispatcher" holds for fused kernels."""
    seen = {}
    for name, lm in (("compiled", compiled[0]), ("eager", eager)):
        md = lm.metadata([6], [6], [0], lm.allocate_caches([6]))
        ids = pos = torch.arange(6)
        with torch.inference_mode(), set_forward_context(
            md, lm.model.static_forward_context), LogDispatch() as log:
            lm.model(ids, pos)
        seen[name] = log.ops
    # the decorator checks the ids and positions (check_input_values) before the compiled code runs
    with torch.inference_mode(), LogDispatch() as checks:
        compiled[0].model.check_input_values(ids, pos)
    assert checks.ops and all(seen["compiled"][op] >= n for op, n in checks.ops.items())
    aten_compiled = {op for op in seen["compiled"] if op.startswith("aten.")
                     and op not in checks.ops}
    assert aten_compiled <= {"aten.mm.out", "aten.addmm.out", "aten.bmm.out"}, aten_compiled
    assert seen["compiled"]["minivllm.unified_attention_with_output.default"] == L
    for op in ("aten.embedding.default", "aten.empty_like.default",
               "aten.split_with_sizes.default"):
        assert seen["eager"][op] >= 1 and op not in seen["compiled"]
    assert sum(seen["compiled"].values()) < sum(seen["eager"].values())


def _toy_graph() -> fx.GraphModule:
    """A graph with two splitting ops in a row, a getitem and an allocation-only stretch."""
    def f(x, out):
        y = x.sin()
        torch.ops.minivllm.short_conv(y, out, "a")
        torch.ops.minivllm.short_conv(out, y, "b")  # consecutive: same piece as the one above
        z = torch.empty_like(y)  # allocation only, before the next splitting op
        torch.ops.minivllm.short_conv(y, z, "c")
        parts = z.split([2, 2], dim=-1)
        return parts[0] + parts[1].cos()

    return fx.symbolic_trace(f)


def test_split_graph_rules():
    gm = _toy_graph()
    split_gm, items = split_graph(gm, ["minivllm::short_conv"])
    kinds = [(it.is_splitting_graph, sum(n.op == "call_function" for n in it.graph.graph.nodes))
             for it in items]
    # [sin + the allocation] [conv, conv] [conv] [split, ...]: as in vLLM, the allocation-only
    # piece joined the last compiled piece before it, not the splitting piece next to it
    assert [k for k, _ in kinds] == [False, True, True, False]
    assert kinds[1][1] == 2  # the two consecutive convs
    assert [n.target for n in items[0].graph.graph.nodes
            if n.op in ("call_function", "call_method")] == [
        "sin", torch.empty_like]
    last = [n.target for n in items[3].graph.graph.nodes if n.op == "call_function"]
    assert last.count(operator.getitem) == 2  # the getitems stayed with the split that makes them


def test_an_allocation_stays_where_its_input_is_not_yet_computed():
    def f(x, out):
        torch.ops.minivllm.short_conv(x, out, "a")
        z = torch.empty_like(out)  # reads the conv's output: it cannot move before the conv
        torch.ops.minivllm.short_conv(out, z, "b")
        return z.cos()

    items = split_graph(fx.symbolic_trace(f), ["minivllm::short_conv"])[1]
    ops = [[n.target for n in it.graph.graph.nodes if n.op == "call_function"] for it in items]
    assert [it.is_splitting_graph for it in items] == [True, False, True, False]
    assert ops[1] == [torch.empty_like]  # no compiled piece before it: it stays a piece of its own


def _sigmoid_sandwich(x: torch.Tensor) -> torch.Tensor:
    """vLLM's test_sym_size_with_torch_compile_and_mark_dynamic's shape: sizes read before three
    splitting ops and used after each; here as a whole x.size(), so that it must be decomposed."""
    n = x.size()
    x = torch.ops.aten.sigmoid.default(x)
    x = x.clone().view(n)
    x = torch.ops.aten.sigmoid.default(x)
    x = x.clone().view(n[0], -1)
    x = torch.ops.aten.sigmoid.default(x)
    return torch.full(n, 0.5) + x.clone().view(n)


def test_a_size_read_before_a_split_crosses_it_as_a_symint_only():
    """As vLLM's _decompose_size_nodes: x.size() on a mark_dynamic input becomes sym_size.int for
    the dynamic dim and a literal for the static one, so no piece takes a torch.Size or a plain int,
    and the split graph runs at every size; through the backend and Inductor too."""
    from minivllm_compile.compilation.backends import VllmBackend

    graphs = []
    x = torch.randn(4, 8)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.reset()
    capture = lambda gm, ex: graphs.append(gm) or gm  # noqa: E731
    torch.compile(_sigmoid_sandwich, backend=capture, fullgraph=True)(x)
    split_gm, items = split_graph(graphs[0], ["aten::sigmoid"])
    assert sum(it.is_splitting_graph for it in items) == 3 and len(items) >= 6
    for it in items:
        inputs = [n.meta["example_value"] for n in it.graph.graph.find_nodes(op="placeholder")]
        assert all(isinstance(v, (torch.Tensor, torch.SymInt)) for v in inputs), it.submod_name
    nodes = [n for it in items for n in it.graph.graph.nodes]
    assert any(n.target is torch.ops.aten.sym_size.int for n in nodes)
    for n in (4, 9):
        y = torch.randn(n, 8)
        torch.testing.assert_close(split_gm(n, y)[0], _sigmoid_sandwich(y))
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, splitting_ops=["aten::sigmoid"],
                           compile_sizes=[], max_num_batched_tokens=16,
                           inductor_compile_config={"fx_graph_cache": False})
    compiled = torch.compile(_sigmoid_sandwich, backend=VllmBackend(cc), fullgraph=True)
    for n in (4, 9):
        y = torch.randn(n, 8)
        torch.testing.assert_close(compiled(y), _sigmoid_sandwich(y))
    torch._dynamo.reset()


def test_should_split_formats_and_unknown_names(caplog):
    gm = _toy_graph()
    node = next(n for n in gm.graph.nodes if n.op == "call_function"
                and "short_conv" in str(n.target))
    assert should_split(node, ["minivllm::short_conv"])
    # the traced node is the packet: as in vLLM, only the bare name splits it
    assert not should_split(node, ["minivllm::short_conv.default"])
    assert not should_split(node, ["minivllm::short_conv.other"])
    overload = fx.Graph().call_function(torch.ops.minivllm.short_conv.default, ())
    assert should_split(overload, ["minivllm::short_conv"]) and should_split(
        overload, ["minivllm::short_conv.default"])
    with caplog.at_level("WARNING", logger="minivllm_compile"):
        assert warn_unknown_splitting_ops(
            ["minivllm::short_comv", "minivllm::short_conv"]) == ["minivllm::short_comv"]
        warn_unknown_splitting_ops(["minivllm::short_comv"])
    assert sum("short_comv" in r.message for r in caplog.records) == 1  # warned once


def test_triton_source_is_written_on_cpu_without_a_gpu():
    """Inductor writes Triton for a CPU graph in codegen-only mode; static for a size (the
    element count is a constant), symbolic for a range (it is computed from num_tokens)."""
    from minivllm_compile.config.kernel import IrOpPriorityConfig, KernelConfig
    from minivllm_compile.viz.kernels import triton_source_codegen_only

    # the norms as the vllm_c custom op: an extern call, so the piece's one Triton kernel is the
    # embedding lookup (with native norms Inductor fuses the lookup into the first norm's reduction)
    vllm_c = KernelConfig(IrOpPriorityConfig.with_default(["vllm_c"]))
    lm = build_model("llama", num_layers=1, compilation_config=vllm_cfg(backend="eager",
                                                                        kernel_config=vllm_c))
    lm(torch.arange(6), torch.arange(6))
    piece = lm.model.backend.piecewise_backends[0].graph  # holds the embedding lookup
    static = triton_source_codegen_only(piece, create_concrete_args(piece, 8))
    dynamic = triton_source_codegen_only(piece, get_fake_args_from_graph(piece), dynamic=True)
    assert "@triton.jit" in static and "@triton.jit" in dynamic
    assert "xnumel = 768" in static  # 8 tokens x hidden 96
    assert re.search(r"xnumel = 96\*s\d+", dynamic)


def test_the_compile_fx_adaptor_gives_the_same_model(monkeypatch, eager):
    """VLLM_USE_STANDALONE_COMPILE=0: pieces through compile_fx, whose FX-graph-cache guards are
    answered by AlwaysHitShapeEnv (there is no Dynamo ShapeEnv out here)."""
    from minivllm_compile.compilation.compiler_interface import InductorAdaptor

    monkeypatch.setenv("VLLM_USE_STANDALONE_COMPILE", "0")
    lm = build_model("llama", num_layers=L,
                     compilation_config=vllm_cfg(compile_sizes=[4], compile_ranges_endpoints=[]))
    with compilation_counter.expect(num_inductor_compiles=(L + 1) * 2):
        for n in (4, 9, 1):
            ids = torch.randint(0, 258, (n,))
            torch.testing.assert_close(lm(ids, torch.arange(n)), eager(ids, torch.arange(n)),
                                       atol=1e-4, rtol=1e-4)
    assert isinstance(lm.model.backend.compiler_manager.compiler, InductorAdaptor)


@pytest.mark.parametrize("arch", ["llama", "hybrid"])
def test_custom_ops_none_gives_inductor_plain_torch_to_fuse(arch):
    """vLLM's default with Inductor: the layers run their plain-torch forward_native, so the
    compiled pieces hold aten ops Inductor fuses instead of opaque custom ops."""
    eager = build_model(arch, num_layers=2)
    cc = vllm_cfg(custom_ops=["none"], compile_sizes=[4], compile_ranges_endpoints=[])
    lm = build_model(arch, num_layers=2, compilation_config=cc)
    for n in (4, 11):
        ids = torch.randint(0, 258, (n,))
        torch.testing.assert_close(lm(ids, torch.arange(n)), eager(ids, torch.arange(n)),
                                   atol=1e-4, rtol=1e-4)
    code = lm.model.backend.graphs[0].code
    for op in ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rotary_embedding",
               "fused_qk_norm_rope"):
        assert f"minivllm.{op}" not in code, op
    generated = "\n".join(c for e in lm.model.backend.compiler_manager.entries for c in e.code)
    assert "torch.ops.minivllm." not in generated.replace("torch.ops.minivllm.unified", "").replace(
        "torch.ops.minivllm.short_conv", "")  # no custom-op fallback left in the compiled pieces
    assert generated.count("cpp_fused") > 2 * (L + 1)  # norms, activations and RoPE fused


def test_concrete_args_keep_strides_and_storage_offsets():
    from torch._subclasses.fake_tensor import FakeTensorMode

    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.sin, (x,)))
    with FakeTensorMode():
        x.meta["example_value"] = torch.empty(4, 10)[1:, 2:7]  # a strided view, offset 12
    (concrete,) = create_concrete_args(fx.GraphModule(torch.nn.Module(), g), 8)
    assert (tuple(concrete.shape), concrete.stride(),
            concrete.storage_offset()) == ((3, 5), (10, 1), 12)
