"""Tracing once (seed §2-§4, §7, §8, §11, §13): one Dynamo trace, guards
dropped, the bytecode hook."""

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import minivllm_compile.distributed.linear as linear_module
import minivllm_compile.models.layers as layers_module
import minivllm_compile.models.llama as llama_module
from minivllm_compile import (
    CompilationConfig,
    CompilationMode,
    DynamicShapesConfig,
    DynamicShapesType,
    compilation_counter,
    ignore_torch_compile,
    support_torch_compile,
)
from minivllm_compile.compilation.wrapper import (
    TorchCompileWithNoGuardsWrapper,
    compile_model_with_stock_torch,
)
from minivllm_compile.models import build_model
from minivllm_compile.viz.dynamo_entries import count_dynamo_entries

ONCE = CompilationMode.DYNAMO_TRACE_ONCE


@pytest.fixture
def hook_off(monkeypatch):
    monkeypatch.setenv("VLLM_USE_BYTECODE_HOOK", "0")


@support_torch_compile
class Branchy(nn.Module):
    """Takes a different path above 4 tokens: what a guard would notice and
    we deliberately don't."""

    def __init__(self, *, compilation_config=None):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > 4:
            return self.lin(x) * 2
        return self.lin(x)


def cfg(mode=ONCE, **kw):
    return CompilationConfig(mode=mode, backend=kw.pop("backend", "eager"), **kw)


@pytest.mark.compiles
def test_one_trace_serves_every_num_tokens_with_inductor():
    """The tiny Llama, traced once and compiled whole by Inductor, runs 1..64 tokens with no new
    trace and matches eager."""
    with compilation_counter.expect(num_models_seen=1, num_dynamo_traces=0):
        lm = build_model("llama", num_layers=2, compilation_config=cfg(backend="inductor"))
    eager = build_model("llama", num_layers=2)
    assert not lm.model.compiled  # torch.compile is lazy (§13)
    g = torch.Generator().manual_seed(0)
    # vLLM hands "inductor" by name to torch.compile in this mode: its counters do not move
    with compilation_counter.expect(num_dynamo_traces=1, num_graphs_seen=0, num_inductor_compiles=0,
                                    num_backend_compilations=0):
        for n in [8, *range(1, 65)]:
            ids = torch.randint(0, 258, (n,), generator=g)
            torch.testing.assert_close(lm(ids, torch.arange(n)), eager(ids, torch.arange(n)),
                                       atol=1e-4, rtol=1e-4)
    assert lm.model.compiled


@pytest.mark.compiles
def test_mark_dynamic_leaves_one_symint_for_num_tokens():
    """dynamic=False, yet num_tokens is a SymInt: mark_dynamic overrides it
    for the marked dims (§7)."""
    lm = build_model("llama", num_layers=1, compilation_config=cfg())
    lm(torch.arange(5), torch.arange(5))
    gm = lm.model.captured_graphs[0]
    sym = [n for n in gm.graph.nodes if n.op == "placeholder"
           and isinstance(n.meta.get("example_value"), torch.SymInt)]
    assert len(sym) == 2  # one size symbol each for input_ids and positions, nothing else
    ids = next(n for n in gm.graph.nodes if n.op == "placeholder" and "input_ids" in n.name)
    shape = ids.meta["example_value"].shape
    assert isinstance(shape[0], torch.SymInt)
    hidden = next(n for n in gm.graph.nodes if n.op == "placeholder" and "embed_tokens" in n.name)
    assert all(isinstance(s, int) for s in hidden.meta["example_value"].shape)  # the rest is static


@pytest.mark.compiles
def test_stock_recompiles_on_a_shape_branch_trace_once_does_not():
    stock_cfg = cfg(CompilationMode.STOCK_TORCH_COMPILE)
    stock_model = Branchy(compilation_config=stock_cfg)
    with compilation_counter.expect(num_models_seen=0, stock_torch_compile_count=1):
        stock = compile_model_with_stock_torch(stock_model, stock_cfg)
    x3 = torch.randn(3, 8)
    # vLLM passes STOCK's backend to torch.compile by name: none of its counters sees the traces
    with compilation_counter.expect(num_graphs_seen=0, num_backend_compilations=0,
                                    num_inductor_compiles=0):
        stock(torch.randn(8, 8))
        stock(x3)
    assert len(stock.backend.graphs) >= 2  # the guard on x.shape[0] failed: a new trace
    torch.testing.assert_close(stock(x3), stock_model.lin(x3))  # the right branch

    once = Branchy(compilation_config=cfg())
    with compilation_counter.expect(num_dynamo_traces=1):
        once(torch.randn(8, 8))
        out = once(x3)
    # no guard, no recompile: the traced branch (> 4 tokens) runs for 3 tokens too, as in vLLM
    torch.testing.assert_close(out, once.lin(x3) * 2)


@pytest.mark.compiles
def test_hook_on_never_enters_dynamo_after_the_first_call():
    m = Branchy(compilation_config=cfg())
    m(torch.randn(8, 8))
    assert m._compiled_bytecode is not None
    with count_dynamo_entries() as entries:
        for n in range(5, 12):
            m(torch.randn(n, 8))
    assert entries.count == 0


@pytest.mark.compiles
def test_hook_off_enters_dynamo_on_every_call(hook_off):
    m = Branchy(compilation_config=cfg())
    m(torch.randn(8, 8))
    assert m._compiled_bytecode is None
    with count_dynamo_entries() as entries, compilation_counter.expect(num_dynamo_traces=0):
        for n in range(5, 12):
            m(torch.randn(n, 8))
    assert entries.count == 7


@pytest.mark.compiles
def test_two_instances_each_get_their_own_trace():
    a, b = Branchy(compilation_config=cfg()), Branchy(compilation_config=cfg())
    x = torch.randn(6, 8)
    with compilation_counter.expect(num_dynamo_traces=2):
        ya, yb = a(x), b(x)
    assert a._compiled_bytecode is not None and b._compiled_bytecode is not None
    torch.testing.assert_close(a(x), a.lin(x) * 2)
    torch.testing.assert_close(b(x), b.lin(x) * 2)
    assert not torch.allclose(ya, yb)  # each ran its own weights


@pytest.mark.compiles
def test_guards_all_dropped_by_default():
    m = Branchy(compilation_config=cfg())
    m(torch.randn(8, 8))
    types = {row.guard_type for row in m.guard_table}
    assert "TENSOR_MATCH" in types and "SHAPE_ENV" in types  # what Dynamo offered
    assert not any(row.kept for row in m.guard_table)


@pytest.mark.compiles
def test_evaluate_guards_raises_on_an_unexpected_specialisation(hook_off):
    m = Branchy(compilation_config=cfg(
        dynamic_shapes_config=DynamicShapesConfig(evaluate_guards=True)))
    m(torch.randn(8, 8))
    assert {r.guard_type for r in m.guard_table if r.kept} == {"SHAPE_ENV"}
    m(torch.randn(6, 8))  # same side of the branch: no recompile
    with pytest.raises(RuntimeError, match="recompile"):
        m(torch.randn(3, 8))


def test_evaluate_guards_with_the_hook_on_is_refused_at_construction(monkeypatch):
    """vLLM's wrapper asserts it: the hook's later calls never enter Dynamo, so no guard would be
    evaluated. (UNBACKED with the hook on is not refused, as in vLLM 0.34: the test below.)"""
    monkeypatch.delenv("VLLM_USE_BYTECODE_HOOK", raising=False)
    with pytest.raises(ValueError, match="VLLM_USE_BYTECODE_HOOK=0"):
        Branchy(compilation_config=cfg(dynamic_shapes_config=DynamicShapesConfig(
            evaluate_guards=True)))


@pytest.mark.compiles
def test_user_guard_filter_fn_is_overwritten_outside_stock():
    """Seed §4: the user's guard_filter_fn is replaced unless the mode is STOCK_TORCH_COMPILE."""
    calls = []

    def mine(entries):
        calls.append(len(entries))
        return [True] * len(entries)

    m = Branchy(compilation_config=cfg(inductor_compile_config={"guard_filter_fn": mine}))
    m(torch.randn(8, 8))
    assert calls == [] and not any(r.kept for r in m.guard_table)
    stock_cfg = cfg(CompilationMode.STOCK_TORCH_COMPILE,
                    inductor_compile_config={"guard_filter_fn": mine})
    stock = compile_model_with_stock_torch(Branchy(compilation_config=stock_cfg), stock_cfg)
    stock(torch.randn(8, 8))
    assert len(calls) == 1 and calls[0] > 0


@pytest.mark.compiles
def test_traced_files_include_the_model_and_inlined_helpers():
    cc = cfg()
    lm = build_model("llama", num_layers=1, compilation_config=cc)
    lm(torch.arange(4), torch.arange(4))
    assert llama_module.__file__ in cc.traced_files  # the decorated forward
    assert layers_module.__file__ in cc.traced_files  # RMSNorm etc., inlined by Dynamo
    assert linear_module.__file__ in cc.traced_files  # the parallel linears' forward
    # nn.Embedding's, through its subclass
    assert torch.nn.modules.sparse.__file__ in cc.traced_files


@pytest.mark.compiles
@pytest.mark.parametrize("ds_type", list(DynamicShapesType))
@pytest.mark.parametrize("hook", ["1", "0"])
def test_every_dynamic_shapes_type_compiles_the_llama(ds_type, hook, monkeypatch):
    """Each type, with the bytecode hook on and off (UNBACKED with the hook on too, as vLLM 0.34
    runs it; seed §3 asks for the hook off): one trace, eager's logits at every size."""
    monkeypatch.setenv("VLLM_USE_BYTECODE_HOOK", hook)
    cc = cfg(dynamic_shapes_config=DynamicShapesConfig(type=ds_type))
    lm = build_model("llama", num_layers=2, compilation_config=cc)
    eager = build_model("llama", num_layers=2)
    with compilation_counter.expect(num_dynamo_traces=1):
        for n in (7, 1, 3, 30):
            ids = torch.randint(0, 258, (n,))
            torch.testing.assert_close(lm(ids, torch.arange(n)), eager(ids, torch.arange(n)),
                                       atol=1e-4, rtol=1e-4)


@pytest.mark.compiles
def test_hybrid_compiles_once_and_generates_like_eager():
    lm = build_model("hybrid", num_layers=2, compilation_config=cfg())
    eager = build_model("hybrid", num_layers=2)
    prompts = ["def f(x):", "import os\n"]
    with compilation_counter.expect(num_dynamo_traces=1):
        assert lm.generate(prompts, 8) == eager.generate(prompts, 8)


class Counting(nn.Module):
    def __init__(self, *, compilation_config=None):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return self.lin(x)


@pytest.mark.compiles
def test_buffer_mutation_is_refused_and_the_line_named():
    # refused only under a CUDA-graph mode, as in vLLM (tests/compilation/test_cuda_graph.py:
    # allowed without)
    model = support_torch_compile(type("CountingModel", (Counting,), {}))(
        compilation_config=cfg(cudagraph_mode="FULL"))
    with pytest.raises(RuntimeError, match=r"test_decorators.py:\d+: self.calls = self.calls \+ 1"):
        model(torch.randn(4, 8))


def test_nested_compile_is_traced_not_compiled_again():
    """is_compiling() (§13): a decorated model inside an outer torch.compile is just traced."""
    inner = Branchy(compilation_config=cfg())
    seen = []

    def backend(gm, example_inputs):
        seen.append(gm)
        return gm.forward

    outer = torch.compile(lambda x: inner(x) + 1, backend=backend, fullgraph=True)
    x = torch.randn(6, 8)
    with compilation_counter.expect(num_dynamo_traces=0):
        torch.testing.assert_close(outer(x), inner.lin(x) * 2 + 1)
    assert not inner.compiled and len(seen) == 1
    assert "linear" in seen[0].code


def test_modes_none_and_ignore_do_not_compile():
    @ignore_torch_compile
    class Ignored(Branchy):
        pass

    with compilation_counter.expect(num_models_seen=0, num_dynamo_traces=0):
        for m in (Branchy(compilation_config=cfg(CompilationMode.NONE)),
                  Ignored(compilation_config=cfg())):
            x = torch.randn(3, 8)
            torch.testing.assert_close(m(x), m.lin(x))  # eager: the real branch
            assert m.do_not_compile


@pytest.mark.compiles
def test_transformed_code_is_dumped(tmp_path):
    m = Branchy(compilation_config=cfg(debug_dump_path=str(tmp_path)))
    m(torch.randn(6, 8))
    text = (Path(tmp_path) / "transformed_code.py").read_text()
    assert "__compiled_fn" in text


@pytest.mark.compiles
def test_decorator_forms_and_their_errors():
    class Plain(nn.Module):
        def forward(self, x, n: int):
            return x

    with pytest.raises(ValueError, match="no dynamic dimensions"):
        support_torch_compile(Plain)
    with pytest.raises(ValueError, match="'y' is not a parameter"):
        support_torch_compile(dynamic_arg_dims={"y": 0})(Plain)
    Explicit = support_torch_compile(dynamic_arg_dims={"x": [0, -1]})(
        type("Explicit", (nn.Module,), {"forward": lambda self, x, n: x * n,
                                         "__init__": lambda self, **kw: nn.Module.__init__(self)}))
    m = Explicit(compilation_config=cfg())
    m(torch.randn(4, 6), 2)
    ph = [n for n in m.captured_graphs[0].graph.nodes if n.op == "placeholder"]
    x_shape = next(n for n in ph if "x" in n.name and n.meta.get("example_value") is not None
                   and isinstance(n.meta["example_value"],
                                  torch.Tensor)).meta["example_value"].shape
    assert all(isinstance(s, torch.SymInt) for s in x_shape)  # both dims marked dynamic
    assert os.path.basename(__file__) in "".join(m.compilation_config.traced_files)


def test_a_first_call_dynamo_would_specialise_is_refused_clearly():
    m = Branchy(compilation_config=cfg())
    with pytest.raises(ValueError, match="at least 2 tokens"):
        m(torch.randn(1, 8))


@pytest.mark.compiles
def test_lm_compiles_in_a_warmup_run_so_one_token_first_is_fine():
    lm = build_model("llama", num_layers=1, compilation_config=cfg())
    eager = build_model("llama", num_layers=1)
    with compilation_counter.expect(num_dynamo_traces=1):
        torch.testing.assert_close(lm(torch.tensor([7]), torch.tensor([0])),
                                   eager(torch.tensor([7]), torch.tensor([0])))
        torch.testing.assert_close(lm(torch.arange(9), torch.arange(9)),
                                   eager(torch.arange(9), torch.arange(9)))


@pytest.mark.compiles
def test_a_refused_buffer_mutation_stays_refused():
    model = support_torch_compile(type("CountingModel2", (Counting,), {}))(
        compilation_config=cfg(cudagraph_mode="FULL"))
    for _ in range(2):
        with pytest.raises(RuntimeError, match="assigns a buffer"):
            model(torch.randn(4, 8))
    assert model._compiled_bytecode is None


@pytest.mark.compiles
def test_later_calls_the_trace_does_not_fit_are_refused_naming_the_fix():
    """The guards are dropped, so only this check stands between a strided or retyped input and
    compiled code that reads it as the first call's (a non-contiguous tensor used to fail inside a
    custom op's fake kernel; int32 ids aborted the process:
    tests/compilation/test_cache_keys.py)."""
    m = Branchy(compilation_config=cfg())
    x = torch.randn(6, 8)
    eager = m.forward(x)
    torch.testing.assert_close(m(x), eager)
    with pytest.raises(ValueError, match=r"not contiguous .*pass x.contiguous\(\)"):
        m(torch.randn(8, 6).t())
    with pytest.raises(ValueError, match=r"sizes \['num_tokens', 8\], contiguous; this call passes "
                                         r"torch.float32 on cpu, 2-D, sizes \[6, 9\]"):
        m(torch.randn(6, 9))
    with pytest.raises(ValueError, match=r"pass x.to\(torch.float32\)"):
        m(x.double())
    torch.testing.assert_close(m(x[:5]), m.forward(x[:5]))  # num_tokens is free


@pytest.mark.compiles
def test_the_lm_hands_its_compiled_decoder_what_it_was_traced_for():
    lm = build_model("llama", num_layers=1, compilation_config=cfg())
    eager = build_model("llama", num_layers=1)
    ids = torch.arange(20)[::2]  # strided, int64
    torch.testing.assert_close(lm(ids, torch.arange(10)), eager(ids.contiguous(), torch.arange(10)))
    torch.testing.assert_close(lm(ids.int(), torch.arange(10).int()),
                               eager(ids.contiguous(), torch.arange(10)))


@support_torch_compile
class Plain(nn.Module):
    def __init__(self, *, compilation_config=None):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2


@pytest.mark.compiles
@pytest.mark.parametrize("mode", [CompilationMode.VLLM_COMPILE, ONCE])
def test_evaluate_guards_under_vllm_compile_lets_one_token_through(hook_off, monkeypatch, mode):
    """vLLM's VllmBackend lowers a backed size's range from [2, ...] to [0, ...] under
    evaluate_guards + BACKED, so the 0/1-specialisation guard never fires: after compiling at 8
    tokens, a 1-token call runs under VLLM_COMPILE (it used to fail with "Detected recompile"),
    while a real specialisation (Branchy's branch at 4 tokens) is still caught. DYNAMO_TRACE_ONCE
    has no VllmBackend, so there, as in vLLM, 1 token is refused."""
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    ds = DynamicShapesConfig(evaluate_guards=True)
    m = Plain(compilation_config=cfg(mode, dynamic_shapes_config=ds, max_num_batched_tokens=16))
    m(torch.randn(8, 8))
    x = torch.randn(1, 8)
    if mode == CompilationMode.VLLM_COMPILE:
        torch.testing.assert_close(m(x), m.forward(x))
        branchy = Branchy(compilation_config=cfg(mode, dynamic_shapes_config=ds,
                                                 max_num_batched_tokens=16))
        branchy(torch.randn(8, 8))
        with pytest.raises(RuntimeError, match="recompile"):
            branchy(torch.randn(3, 8))
    else:
        with pytest.raises(RuntimeError, match="recompile"):
            m(x)


def test_compilation_context_raises_the_cache_limits_only():
    """vLLM's _compilation_context (wrapper.py) only raises Dynamo's cache-size limits; the
    GLOBAL_STATE / TORCH_FUNCTION_STATE guards go with the rest, through the guard_filter_fn."""
    from minivllm_compile.compilation.wrapper import _compilation_context

    gm = torch._C._dynamo.guards.GuardManager
    before = (gm.add_global_state_guard, gm.add_torch_function_mode_stack_guard)
    with _compilation_context():
        assert torch._dynamo.config.cache_size_limit == 2048
        assert torch._dynamo.config.accumulated_cache_size_limit == 8192
        assert (gm.add_global_state_guard, gm.add_torch_function_mode_stack_guard) == before


@pytest.mark.compiles
def test_global_state_is_not_guarded_with_evaluate_guards(hook_off):
    """The one hook-off setting that keeps guards keeps SHAPE_ENV only: a changed thread count (part
    of GLOBAL_STATE) neither retraces nor trips fail_on_recompile."""
    m = Branchy(compilation_config=cfg(
        dynamic_shapes_config=DynamicShapesConfig(evaluate_guards=True)))
    m(torch.randn(8, 8))
    assert not any(r.kept for r in m.guard_table if r.guard_type in ("GLOBAL_STATE",
                                                                     "TORCH_FUNCTION_STATE"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        with compilation_counter.expect(num_dynamo_traces=0):
            m(torch.randn(6, 8))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.compiles
@pytest.mark.parametrize("aot", ["0", "1"])
def test_torch_compile_disable_runs_the_model_eagerly(aot, tmp_path):
    """TORCH_COMPILE_DISABLE=1 is mode=NONE, as in vLLM (config/vllm.py): nothing traced or saved.
    Before, the model was still traced under AOT, and with AOT off failed
    ("found no compiled frames")."""
    import subprocess
    import sys

    code = """
import torch
from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter
from minivllm_compile.models import build_model
assert CompilationConfig().mode == CompilationMode.NONE
lm = build_model("llama", num_layers=1)
ids = torch.randint(0, 200, (8,))
with compilation_counter.expect(num_models_seen=0, num_dynamo_traces=0, num_aot_compiles=0,
                                num_backend_compilations=0):
    out = lm(ids, torch.arange(8))
assert lm.model.do_not_compile
print("eager", tuple(out.shape))
"""
    env = {**os.environ, "TORCH_COMPILE_DISABLE": "1", "VLLM_USE_AOT_COMPILE": aot,
           "VLLM_CACHE_ROOT": str(tmp_path), "VLLM_DISABLE_COMPILE_CACHE": "0"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "eager (8, 258)" in r.stdout
    assert "TORCH_COMPILE_DISABLE is set" in r.stderr
    assert not any(tmp_path.iterdir())  # no AOT file, no piece folder


def test_the_first_compile_runs_under_one_named_set_of_patches():
    """decorators.compile_patches (seed §11): inside it every file Dynamo inlines is recorded and
    the C++ shape guards are off (with 32-bit indexing when asked for); after it, torch is as it
    was.
    input_spec only describes the call: the decorator keeps the checks it derives."""
    from torch._dynamo.symbolic_convert import InliningInstructionTranslator

    from minivllm_compile.compilation.decorators import compile_patches, input_spec

    ds = DynamicShapesConfig(assume_32_bit_indexing=True)
    model = Branchy(compilation_config=cfg(dynamic_shapes_config=ds))
    inline_call = InliningInstructionTranslator.inline_call_
    with compile_patches(model):
        assert InliningInstructionTranslator.inline_call_ is not inline_call
        assert torch._dynamo.config.enable_cpp_symbolic_shape_guards is False
        assert torch._inductor.config.assume_32bit_indexing is True
    assert InliningInstructionTranslator.inline_call_ is inline_call
    assert torch._inductor.config.assume_32bit_indexing is False
    assert Branchy.forward.__code__.co_filename in model.compilation_config.traced_files
    spec = input_spec(model, (torch.ones(6, 8),), {}, {"x": 0}, None)
    assert spec == {"x": {"dtype": "torch.float32", "device": "cpu", "shape": [None, 8],
                          "contiguous": True}}
    assert not hasattr(model, "_input_checks")  # no side effect: the decorator's first call sets it


@pytest.mark.compiles
def test_the_backend_gets_the_models_cache_key_factors_as_an_argument():
    """VllmBackend(model_factors=...) asks for them when Dynamo hands it the graph; a decorated
    model passes its own (known at its first call), a backend used on its own keys without them."""
    import json

    from minivllm_compile.compilation.backends import VllmBackend

    cc = cfg(CompilationMode.VLLM_COMPILE, compile_sizes=[], max_num_batched_tokens=16)
    lm = build_model("llama", num_layers=1, compilation_config=cc)
    lm(torch.arange(5), torch.arange(5))
    factors = lm.model.backend.cache_key_factors
    assert factors["config"]["model"] == json.loads(json.dumps(lm.model.model_factors))
    assert VllmBackend(cc).model_factors() is None
    given = {"model": "m", "constants": "c", "inputs": None, "tag": "backbone"}
    assert VllmBackend(cc, model_factors=lambda: given).model_factors() is given


class _ShapeBranch(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.size()[0] >= 4 else x * 100


class _Wrapped(TorchCompileWithNoGuardsWrapper):
    """A wrapper of one's own, as vLLM's tests/compile/test_wrapper.py builds it."""

    def __init__(self, model: nn.Module, mode: CompilationMode):
        self.model, self.compilation_config = model, cfg(mode)
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)


@pytest.mark.compiles
@pytest.mark.parametrize("hook", ["1", "0"])
def test_the_wrapper_keeps_dynamos_guards_under_stock_torch_compile(hook, monkeypatch):
    """vLLM's test_torch_compile_wrapper: trace-once serves the 3-token call with the 4-token trace
    (its guards dropped); STOCK_TORCH_COMPILE keeps the guards and recompiles; NONE is refused."""
    monkeypatch.setenv("VLLM_USE_BYTECODE_HOOK", hook)
    results = {}
    for mode in (ONCE, CompilationMode.STOCK_TORCH_COMPILE):
        torch._dynamo.reset()
        wrapper = _Wrapped(_ShapeBranch(), mode)
        x = torch.tensor([1, 2, 3, 4])
        torch._dynamo.mark_dynamic(x, 0)
        assert torch.equal(wrapper(x), x * 2)
        results[mode] = (wrapper(torch.tensor([1, 2, 3])), len(wrapper.captured_graphs))
    torch._dynamo.reset()
    assert torch.equal(results[ONCE][0], torch.tensor([2, 4, 6])) and results[ONCE][1] == 1
    stock_out, stock_graphs = results[CompilationMode.STOCK_TORCH_COMPILE]
    assert torch.equal(stock_out, torch.tensor([100, 200, 300])) and stock_graphs == 2
    with pytest.raises(RuntimeError, match="NONE compiles nothing"):
        _Wrapped(_ShapeBranch(), CompilationMode.NONE)


def test_the_wrapper_refuses_a_config_with_no_mode():
    """vLLM's wrapper.py: a mode of None (set after construction) is refused, in vLLM's words."""

    class NoMode(_Wrapped):
        def __init__(self, model):
            self.model, self.compilation_config = model, cfg(ONCE)
            self.compilation_config.mode = None
            TorchCompileWithNoGuardsWrapper.__init__(self)

    with pytest.raises(RuntimeError, match="Compilation mode cannot be NO_COMPILATION"):
        NoMode(_ShapeBranch())


@pytest.mark.compiles
def test_stock_torch_compile_logs_the_traces_own_time(caplog):
    """STOCK_TORCH_COMPILE is compiled by its caller, outside monitor_torch_compile: the logged
    "Dynamo bytecode transform time" used to be measured from 0, i.e. the seconds since the
    machine booted. It is measured from the start of Dynamo's compile of the frame instead, and a
    later compile measures from its own start, not from an earlier model's."""
    import logging
    import time

    for n in range(2):  # the second one after another model's compile has finished
        model = Branchy(compilation_config=cfg(CompilationMode.STOCK_TORCH_COMPILE))
        compiled = compile_model_with_stock_torch(model, model.compilation_config)
        time.sleep(0.3)  # between compiling and the first call: not part of the trace
        t0 = time.perf_counter()
        with caplog.at_level(logging.INFO, logger="minivllm_compile"):
            compiled(torch.randn(6, 8))
        wall = time.perf_counter() - t0
        seconds = compiled.backend.dynamo_time_s
        assert seconds is not None and 0 < seconds <= wall, (n, seconds, wall)
        assert f"Dynamo bytecode transform time: {seconds:.2f} s" in caplog.text


class NumpyScale(nn.Module):
    def __init__(self, *, compilation_config=None):
        super().__init__()
        import numpy as np

        self.lin = nn.Linear(8, 8)
        self.scale = np.float32(0.5)  # a numpy scalar, as a config loaded with numpy gives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * float(self.scale)


NumpyScale = support_torch_compile(NumpyScale)


@pytest.mark.compiles
def test_a_numpy_scalar_read_as_a_float_is_explained_under_vllm_compile(monkeypatch):
    """Dynamo reads a numpy scalar attribute as a 0-d tensor input and float() of it as an unbacked
    float. DYNAMO_TRACE_ONCE compiles the graph whole and runs it; VLLM_COMPILE's pieces failed deep
    in Inductor with PendingUnbackedSymbolNotFound. Now the error names the line and the fix."""
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    x = torch.randn(4, 8)
    once = NumpyScale(compilation_config=cfg(backend="inductor"))
    torch.testing.assert_close(once(x), once.lin(x) * 0.5)
    model = NumpyScale(compilation_config=cfg(CompilationMode.VLLM_COMPILE, backend="inductor",
                                              splitting_ops=[]))
    with pytest.raises(Exception) as info:
        model(x)
    message = str(info.value)
    assert "PendingUnbackedSymbolNotFound" not in message, message
    assert f"{Path(__file__).name}:" in message and "float(self.scale)" in message, message
    assert "self.scale is a numpy" in message and "self.scale = float(" in message, message
