"""The stitching function (compilation/codegen.py, vLLM's): the split graph written as plain Python
is what runs at every call, equals eager, is logged to TORCH_TRACE, is saved in the mega AOT
artifact and exec'd again on load without being written anew; and the backend's interpreter reads
each piece's outputs instead of running it."""

import json
import operator
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from minivllm_compile import CompilationConfig, CompilationMode
from minivllm_compile.compilation import codegen
from minivllm_compile.compilation.piecewise_backend import StitchingRecord
from minivllm_compile.models import build_model


def _split() -> fx.GraphModule:
    """A stitching graph as split_graph leaves one: piece 0, a splitting piece (relu, with a
    constant the code cannot write as a literal), piece 2."""

    def f(x, y):
        a = torch.mul(x, 2.0)
        b = torch.add(a, y)
        # the "splitting op": a piece of its own
        c = torch.clamp(torch.relu(b), max=float("inf")) + torch.zeros_like(
            b, device=torch.device("cpu"))
        return torch.sub(c, x), a

    gm = fx.symbolic_trace(f)
    part = {}
    for n in gm.graph.nodes:
        part[n.name] = (1 if n.name in ("relu", "clamp", "zeros_like", "add_1")
                        else 0 if n.name in ("mul", "add") else 2)
    return split_module(gm, None, lambda n: part[n.name], keep_original_order=True)


def test_the_stitching_function_calls_the_pieces_from_a_list_and_inlines_a_splitting_piece():
    split_gm = _split()
    record = StitchingRecord(split_gm)
    calls = []
    for name in ("submod_0", "submod_2"):  # "compiled": anything but a plain GraphModule
        piece = split_gm._modules[name]
        record.install(name, lambda *a, piece=piece, name=name: calls.append(name) or piece(*a))
    fn = record.stitch()
    x, y = torch.randn(3), torch.randn(3)
    for got, want in zip(fn(x, y), split_gm(x, y)):
        torch.testing.assert_close(got, want)
    assert calls == ["submod_0", "submod_2", "submod_0", "submod_2"]  # theirs, then the graph's
    code = record.execution_code
    assert "def __vllm_inlined_submods__1(" in code and "__vllm_submods__[0](" in code
    assert "torch.relu(" in code  # the splitting piece, as code
    assert "del " in code  # a value is freed after its last use
    # float("inf") and a device are no Python literals: kept as constants, named by index
    assert "__vllm_consts__[" in code and torch.device("cpu") in record.consts
    assert any(c == float("inf") for c in record.consts if isinstance(c, float))
    assert record.submod_names == ["submod_0", "submod_1", "submod_2"]


def test_the_code_names_what_its_imports_reach_and_keeps_the_rest_as_constants():
    writer = codegen._Writer([], {})
    assert writer.callee(torch.ops.aten.sym_size.int) == "torch.ops.aten.sym_size.int"
    assert writer.callee(operator.mul) == "operator.mul"  # its qualified name is _operator.mul

    def local(a):
        return a

    assert writer.callee(local) == "__vllm_consts__[0]" and writer.consts == [local]
    assert writer.ref([1, (2,), {"k": None}]) == "[1, (2,), {'k': None}]"


def test_a_stitching_function_is_exec_d_as_saved():
    """A load binds the saved source to the loaded pieces; nothing is generated again."""
    split_gm = _split()
    code, names, consts = codegen.generate_execution_code(split_gm)
    record = StitchingRecord(split_gm)
    fn = record.stitch((code, names, consts))
    assert record.execution_code is code
    torch.testing.assert_close(fn(torch.ones(3), torch.ones(3))[0],
                               split_gm(torch.ones(3), torch.ones(3))[0])


def _cc(**kw) -> CompilationConfig:
    return CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="eager", compile_sizes=[4],
                             max_num_batched_tokens=16, **kw)


@pytest.mark.compiles
def test_a_compiled_model_runs_the_stitching_function_never_the_graph_module(monkeypatch):
    logged = []
    monkeypatch.setattr(codegen, "trace_structured",
                        lambda kind, metadata_fn, payload_fn: logged.append(
                            (metadata_fn()["name"], payload_fn())))
    interpreted = []  # fx.Interpreter.call_module would run a piece: the backend's reads instead
    base_call_module = fx.Interpreter.call_module
    monkeypatch.setattr(fx.Interpreter, "call_module",
                        lambda self, *a: interpreted.append(a[0]) or base_call_module(self, *a))
    lm = build_model("llama", num_layers=2, compilation_config=_cc())
    eager = build_model("llama", num_layers=2)
    lm.warmup()
    assert interpreted == []
    record = lm.model.backend.record
    assert logged == [("vllm_execution_code", record.execution_code)]
    assert record.submod_names == [f"submod_{i}" for i in range(5)]
    assert record.execution_code.count("def __vllm_inlined_submods__") == 2  # the attentions

    def graph_module_called(*args):
        raise AssertionError("the stitching graph ran as a GraphModule")

    monkeypatch.setattr(record.split_gm, "forward", graph_module_called)
    stitched, calls = record.execution_fn, []
    record.execution_fn = lambda *a: calls.append(1) or stitched(*a)
    for n in range(1, 17):  # every compiled entry: the size 4 and the range [1, 16]
        ids = torch.randint(0, 200, (n,), generator=torch.Generator().manual_seed(n))
        torch.testing.assert_close(lm(ids, torch.arange(n)), eager(ids, torch.arange(n)))
    assert len(calls) == 16


@pytest.mark.compiles
def test_a_stitching_function_the_code_gets_wrong_gives_wrong_results(monkeypatch):
    """What runs is the generated code: make its return zero the result and the logits follow."""
    real = codegen.generate_execution_code

    def zeroed(split_gm):
        code, names, consts = real(split_gm)
        code, n = re.subn(r"^    return \((\w+),\)$", r"    return (\1 * 0,)", code, flags=re.M)
        assert n == 1  # the stitching function's own return, not an inlined piece's
        return code, names, consts

    monkeypatch.setattr(codegen, "generate_execution_code", zeroed)
    lm = build_model("llama", num_layers=2, compilation_config=_cc())
    ids = torch.arange(6)
    out = lm(ids, ids)
    assert "* 0,)" in lm.model.backend.record.execution_code
    assert not out.any() and build_model("llama", num_layers=2)(ids, ids).any()


CHILD = r"""
import hashlib, json, sys, torch
from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter
from minivllm_compile.compilation import codegen
if sys.argv[2] == "load":  # a load must exec the saved source, never write it again
    def refuse(split_gm):
        raise AssertionError("generate_execution_code called on a load")
    codegen.generate_execution_code = refuse
from minivllm_compile.models import build_model
cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, max_num_batched_tokens=16)
lm = build_model("llama", num_layers=1, compilation_config=cc)
out = lm(torch.arange(5), torch.arange(5))
torch.save(out, sys.argv[1] + "/" + sys.argv[2] + ".pt")
fn = lm.model.aot_compiled_fn._artifacts.compiled_fn
record = fn.record
print("RESULT " + json.dumps({
    "code": hashlib.sha256(record.execution_code.encode()).hexdigest(),
    "symbols": sorted(map(str, fn.shape_env.var_to_val)) if fn.shape_env is not None else None,
    "loaded": compilation_counter.num_aot_artifacts_loaded,
    "saved": compilation_counter.num_aot_artifacts_saved}))
"""


@pytest.mark.compiles
def test_an_aot_load_in_a_fresh_process_runs_the_saved_function(tmp_path, seed_isa_record):
    """The mega artifact holds the stitching function's source: a load exec's it (writing it
    again is refused in the loading process) and gets the compiling process's output."""
    seed_isa_record(tmp_path)  # conftest.py: no ISA probe in the first start
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path), "VLLM_DISABLE_COMPILE_CACHE": "0",
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    results = {}
    for step in ("compile", "load"):
        proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), step], env=env,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[step] = next(json.loads(line[7:]) for line in proc.stdout.splitlines()
                             if line.startswith("RESULT "))
    assert results["compile"]["saved"] == 1 and results["load"]["loaded"] == 1
    assert results["load"]["code"] == results["compile"]["code"]
    # the loaded function keeps a shape environment with the trace's symbols (vLLM's keeps its
    # example inputs for this): num_tokens among them
    assert results["load"]["symbols"] and set(results["load"]["symbols"]) <= set(
        results["compile"]["symbols"])
    assert torch.equal(torch.load(tmp_path / "compile.pt"), torch.load(tmp_path / "load.pt"))
