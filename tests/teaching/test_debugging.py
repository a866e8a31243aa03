"""The debugging switches: enforce_eager, debug_dump_path, and viz/debugging's switches and reruns
(vLLM's docs/design/debug_vllm_compile.md, notebook 17)."""

import json
import logging
import sys

import pytest
import torch
from torch import nn

from minivllm_compile import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    PassConfig,
    envs,
    support_torch_compile,
)
from minivllm_compile.compilation.caching import VllmSerializableFunction
from minivllm_compile.config import hash_config
from minivllm_compile.models import build_model
from minivllm_compile.viz.debugging import (
    SWITCHES,
    apply_switch,
    changed_factors,
    narrowest,
    rerun,
    runner,
)


def test_enforce_eager_turns_off_compilation_and_cuda_graphs(caplog):
    cc = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, cudagraph_mode="PIECEWISE", enforce_eager=True
    )
    assert cc.mode == CompilationMode.NONE and cc.cudagraph_mode == CUDAGraphMode.NONE
    assert cc.cudagraph_capture_sizes == [] and cc.max_cudagraph_capture_size == 0
    # it acts through mode and cudagraph_mode, which the hash already holds
    assert hash_config(cc) == hash_config(CompilationConfig(mode=CompilationMode.NONE))
    with pytest.raises(ValueError, match="enforce_eager must be True or False"):
        CompilationConfig(enforce_eager="yes")


def test_enforce_eager_runs_the_model_eagerly():
    lm = build_model(
        "llama", num_layers=1, compilation_config=CompilationConfig(enforce_eager=True)
    )
    ref = build_model("llama", num_layers=1)
    assert lm.model.do_not_compile
    ids = torch.arange(5) + 1
    torch.testing.assert_close(lm(ids, torch.arange(5)), ref(ids, torch.arange(5)))


def test_every_switch_makes_a_valid_config_and_leaves_the_original_alone():
    def my_pass(graph):
        pass

    cc = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        cudagraph_mode="PIECEWISE",
        max_num_batched_tokens=16,
        inductor_compile_config={"post_grad_custom_post_pass": my_pass},
    )
    got = {name: apply_switch(cc, name) for name in SWITCHES}
    assert (
        got["enforce_eager"].mode == CompilationMode.NONE
        and got["enforce_eager"].cudagraph_mode == CUDAGraphMode.NONE
    )
    # mode=NONE turns off compilation only: no pieces, no piecewise graphs (as vLLM normalises it)
    assert (
        got["mode=NONE"].mode == CompilationMode.NONE
        and got["mode=NONE"].cudagraph_mode == CUDAGraphMode.NONE
    )
    assert got["cudagraph_mode=NONE"].mode == CompilationMode.VLLM_COMPILE
    assert (
        got["backend=eager"].backend == "eager"
        and got["backend=eager"].cudagraph_mode == CUDAGraphMode.PIECEWISE
    )
    # the IR switch, and the switches that change mode or backend let the wrap resolve afresh
    unwrapped = got["ir_enable_torch_wrap=False"]
    assert cc.ir_enable_torch_wrap is True and unwrapped.ir_enable_torch_wrap is False
    assert unwrapped.mode == CompilationMode.VLLM_COMPILE
    assert got["backend=eager"].ir_enable_torch_wrap is False
    assert got["mode=NONE"].ir_enable_torch_wrap is False
    assert got["cudagraph_mode=NONE"].ir_enable_torch_wrap is True
    off = got["passes off"]
    assert not any(v for v in vars(off.pass_config).values() if isinstance(v, bool))
    assert "post_grad_custom_post_pass" not in off.inductor_compile_config
    assert (
        hash_config(got["VLLM_DISABLE_COMPILE_CACHE=1"]) == hash_config(cc)
    )  # an environment switch
    assert (
        cc.mode == CompilationMode.VLLM_COMPILE
        and cc.inductor_compile_config["post_grad_custom_post_pass"] is my_pass
    )
    assert cc.pass_config == PassConfig()
    with pytest.raises(KeyError, match="no switch 'backend=inductor'"):
        apply_switch(cc, "backend=inductor")


def test_narrower_means_fewer_pieces_turned_off():
    s = SWITCHES
    assert s["passes off"].narrower_than(s["backend=eager"]) and s["backend=eager"].narrower_than(
        s["mode=NONE"]
    )
    assert s["mode=NONE"].narrower_than(s["enforce_eager"])
    assert s["mode=STOCK_TORCH_COMPILE"].narrower_than(s["mode=NONE"])
    assert not s["cudagraph_mode=NONE"].narrower_than(s["mode=NONE"])
    assert not s["backend=eager"].narrower_than(s["mode=STOCK_TORCH_COMPILE"])
    ir_wrap = s["ir_enable_torch_wrap=False"]
    assert ir_wrap.narrower_than(s["backend=eager"])
    assert ir_wrap.narrower_than(s["mode=STOCK_TORCH_COMPILE"])
    assert not ir_wrap.narrower_than(s["passes off"]) and not s["passes off"].narrower_than(ir_wrap)


@support_torch_compile
class _Branchy(nn.Module):
    def __init__(self, *, compilation_config=None):
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.shape[0] > 8 else x - 1


@pytest.mark.compiles
def test_rerun_finds_the_narrowest_switch_for_a_shape_specialisation():
    cc = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        backend="eager",
        max_num_batched_tokens=32,
        splitting_ops=[],
    )
    inputs = [torch.ones(16), torch.ones(4)]
    rows = rerun(
        lambda c: runner(_Branchy(compilation_config=c)),
        cc,
        inputs,
        _Branchy(),
        switches=["mode=STOCK_TORCH_COMPILE", "backend=eager", "mode=NONE"],
    )
    assert [(r.switch, r.ok) for r in rows] == [
        ("", False),
        ("mode=STOCK_TORCH_COMPILE", True),
        ("backend=eager", False),
        ("mode=NONE", True),
    ]
    assert "wrong at 4 tokens" in rows[0].said
    assert narrowest(rows) == ["mode=STOCK_TORCH_COMPILE"]


def test_changed_factors_names_the_field_two_cache_entries_differ_in(tmp_path):
    """Down to the field, from two folders, two files or two factor dicts; the hashes, which
    differ whenever a field under them does, are left out."""
    from minivllm_compile.compilation import cache_keys

    def factors(**pass_config):
        cc = CompilationConfig(pass_config=PassConfig(**pass_config))
        return cache_keys.backend_cache_key(cc, "cpu")[1]

    a, b = factors(), factors(fuse_norm_quant=True)
    for name, f in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "cache_key_factors.json").write_text(json.dumps(f, indent=1))
    want = {"config.compilation.pass_config.fuse_norm_quant": (False, True)}
    assert changed_factors(tmp_path / "a", tmp_path / "b") == want
    assert changed_factors(tmp_path / "a" / "cache_key_factors.json", b) == want
    assert changed_factors(a, b) == want and a["config_hash"] != b["config_hash"]
    assert changed_factors(a, a) == {}
    b["env"]["VLLM_USE_AOT_COMPILE"] = "new"
    del b["code"]
    assert changed_factors(a, b) == {**want, "code.files": ([], None),
                                     "env.VLLM_USE_AOT_COMPILE": (envs.VLLM_USE_AOT_COMPILE, "new")}


def _compile_with_dump(path):
    cc = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        backend="eager",
        max_num_batched_tokens=16,
        debug_dump_path=str(path),
    )
    lm = build_model("llama", num_layers=1, compilation_config=cc)
    lm(torch.arange(4) + 1, torch.arange(4))


@pytest.mark.compiles
def test_debug_dump_path_holds_the_transformed_code_and_every_piece(tmp_path):
    pytest.importorskip("depyf")
    _compile_with_dump(tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    transformed = (tmp_path / "transformed_code.py").read_text()
    assert (
        transformed.startswith("def forward(") and "__compiled_fn" in transformed
    )  # depyf's decompilation
    graph = (tmp_path / "computation_graph_backbone.py").read_text()
    assert (
        "class submod_0" in graph and "class submod_2" in graph
    )  # both compiled pieces of the layer
    assert any(n.startswith("__transformed_code_") for n in names)  # depyf's own dumps, as in vLLM
    assert any(n.startswith("__compiled_fn_") for n in names)


@pytest.mark.compiles
def test_debug_dump_path_without_depyf_still_holds_the_code_and_the_pieces(
    tmp_path, monkeypatch, caplog
):
    monkeypatch.setitem(sys.modules, "depyf", None)  # import depyf raises ImportError
    with caplog.at_level(logging.INFO, logger="minivllm_compile"):
        _compile_with_dump(tmp_path)
    assert (
        (tmp_path / "transformed_code.py")
        .read_text()
        .startswith("# depyf unavailable: disassembly instead")
    )
    assert "class submod_0" in (tmp_path / "computation_graph_backbone.py").read_text()
    assert "depyf is not installed" in caplog.text


def test_the_serializable_function_answers_depyf_by_a_code_name():
    assert VllmSerializableFunction.co_name.fget(None) == "VllmSerializableFunction"


@support_torch_compile
class _DonatesThenReads(nn.Module):
    """Reads h again after donating it to fused_add_rms_norm.maybe_inplace, against the IR's
    contract."""

    def __init__(self, *, compilation_config=None):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(16, 16)
        self.weight = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from minivllm_compile import ir

        h = self.proj(x)
        out, _ = ir.ops.fused_add_rms_norm.maybe_inplace(h, x, self.weight, 1e-6)
        return out + h


@pytest.mark.compiles
def test_rerun_finds_the_ir_wrap_for_a_model_that_breaks_the_ir_contract(compile_every_time):
    """Under Inductor with the wrap on, the IR's pre-grad pass refuses the graph; with the wrap off
    Dynamo traces the provider itself and the model runs: the IR switch is the narrowest."""
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, max_num_batched_tokens=16,
                           splitting_ops=[])
    eager = _DonatesThenReads(compilation_config=CompilationConfig(mode=CompilationMode.NONE))
    with torch.no_grad():
        rows = rerun(lambda c: _DonatesThenReads(compilation_config=c), cc, [torch.randn(8, 16)],
                     eager, switches=["ir_enable_torch_wrap=False", "passes off", "backend=eager"])
    assert [(r.switch, r.ok) for r in rows] == [
        ("", False), ("ir_enable_torch_wrap=False", True), ("passes off", False),
        ("backend=eager", True)]
    assert "ValueError" in rows[0].said and "maybe_inplace" in rows[0].said
    assert narrowest(rows) == ["ir_enable_torch_wrap=False"]
