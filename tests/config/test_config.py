"""CompilationConfig, the environment switches and the counter: bad input
fails early and clearly."""

from pathlib import Path

import pytest
import torch

from minivllm_compile import (
    CompilationConfig,
    CompilationMode,
    DynamicShapesConfig,
    DynamicShapesType,
    Range,
    compilation_counter,
    envs,
)
from minivllm_compile.config import hash_config


def test_modes_are_vllms_int_enum():
    assert [m.name for m in CompilationMode] == ["NONE", "STOCK_TORCH_COMPILE", "DYNAMO_TRACE_ONCE",
                                                 "VLLM_COMPILE"]
    assert [int(m) for m in CompilationMode] == [0, 1, 2, 3]
    assert CompilationConfig(mode=2).mode is CompilationMode.DYNAMO_TRACE_ONCE


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode=7), "mode=7"),
    (dict(backend="tvm"), "backend='tvm'"),
    (dict(compile_sizes=[4, 0]), r"compile_sizes \[0\]"),
    (dict(compile_sizes=[300], max_num_batched_tokens=256), r"\[1, max_num_batched_tokens=256\]"),
    (dict(compile_ranges_endpoints=[8.5]), "compile_ranges_endpoints"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(splitting_ops=["unified_attention"]), "namespace::name"),
    (dict(dynamic_shapes_config=dict(type="sometimes")), "type='sometimes'"),
    (dict(dynamic_shapes_config=dict(evaluate_guards="yes")), "evaluate_guards"),
    (dict(inductor_compile_config=[("max_autotune", True)]), "inductor_compile_config"),
    # an unknown Inductor option would otherwise surface at the first call, after the trace
    (dict(inductor_compile_config={"max_autotun": True}), r"\['max_autotun'\].*did you mean "
                                                          r"'max_autotune'"),
    (dict(inductor_compile_config={"triton.cudagraph": False}), "did you mean 'triton.cudagraphs'"),
    # accepted once, then failing late or reinterpreted
    (dict(pass_config=None), "pass_config must be a PassConfig"),
    (dict(pass_config=dict(enable_nop=False)), r"pass_config: .*enable_nop.*its fields are"),
    # this project's old name for vLLM's eliminate_noops
    (dict(pass_config=dict(enable_noop=False)), r"did you mean 'eliminate_noops' for "
                                                r"'enable_noop'\?"),
    (dict(pass_config=dict(eliminate_noops="no")), "PassConfig.eliminate_noops must "
                                                   "be True or False, got 'no'"),
    (dict(pass_config=dict(enable_fix_functionalization=0)),
     "enable_fix_functionalization must be True or False"),
    (dict(dynamic_shapes_config="backed"), "dynamic_shapes_config must be a DynamicShapesConfig"),
    (dict(cache_dir=123), "cache_dir must be a path"),
    (dict(debug_dump_path=1.5), "debug_dump_path must be a path"),
    (dict(mode=True), "mode=True is not one of"),
    (dict(max_num_batched_tokens=True), "max_num_batched_tokens must be a positive int, got True"),
    (dict(enable_layerwise_nvtx_tracing=1), "enable_layerwise_nvtx_tracing must be True or False"),
    (dict(custom_ops=["all", "none"]), "one base mode at most"),
    (dict(custom_ops=["none", "+rms_norm", "-rms_norm"]), r"both enables and disables "
                                                          r"\['rms_norm'\]"),
    (dict(custom_ops="all"), "custom_ops must be a list"),
    (dict(max_num_batched_tokens=1), "max_num_batched_tokens=1 under VLLM_COMPILE.*at least 2"),
    (dict(mode=CompilationMode.DYNAMO_TRACE_ONCE, max_num_batched_tokens=1),
     "under DYNAMO_TRACE_ONCE"),
    (dict(compile_sizes=4), r"compile_sizes must be a list of ints, got 4 "
                            r"\(for one size, write \[4\]\)"),
    (dict(compile_ranges_endpoints=8), "compile_ranges_endpoints must be a list"),
    (dict(splitting_ops="minivllm::short_conv"), "splitting_ops must be a list"),
])
def test_bad_config_fails_at_construction_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CompilationConfig(**kwargs)


def test_inductor_options_known_to_torch_and_guard_filter_fn_are_accepted():
    cfg = CompilationConfig(inductor_compile_config={"max_autotune": False,
                                                     "triton.cudagraphs": False,
                                                     "enable_auto_functionalized_v2": False,
                                                     "guard_filter_fn": lambda entries: [False]
                                                     * len(entries)})
    assert set(cfg.inductor_config_and_guard_filter()[0]) == {"max_autotune", "triton.cudagraphs",
                                                              "enable_auto_functionalized_v2"}


def test_compile_ranges_as_vllm_builds_them():
    cc = CompilationConfig(compile_ranges_endpoints=[32, 8, 8], max_num_batched_tokens=128)
    assert cc.get_compile_ranges() == [Range(1, 8), Range(9, 32), Range(33, 128)]
    assert CompilationConfig(max_num_batched_tokens=64).get_compile_ranges() == [Range(1, 64)]
    assert CompilationConfig(compile_sizes=None).compile_sizes == []
    r = Range(3, 3)
    assert r.is_single_size() and 3 in r and 4 not in r
    with pytest.raises(ValueError, match="start <= end"):
        Range(5, 2)


def test_hash_changes_with_what_is_compiled_not_with_paths():
    base = hash_config(CompilationConfig())
    assert base == hash_config(CompilationConfig())
    assert base != hash_config(CompilationConfig(mode=CompilationMode.DYNAMO_TRACE_ONCE))
    assert base != hash_config(CompilationConfig(compile_sizes=[4]))
    assert base != hash_config(CompilationConfig(
        dynamic_shapes_config=DynamicShapesConfig(type=DynamicShapesType.UNBACKED)))
    same = CompilationConfig(debug_dump_path="/tmp/x", cache_dir="/tmp/y")
    same.traced_files.add("/some/file.py")
    assert hash_config(same) == base


def test_env_switches_parse_and_refuse_nonsense(monkeypatch):
    monkeypatch.delenv("VLLM_USE_BYTECODE_HOOK", raising=False)
    assert envs.VLLM_USE_BYTECODE_HOOK is True  # default on
    monkeypatch.setenv("VLLM_USE_BYTECODE_HOOK", "0")
    assert envs.VLLM_USE_BYTECODE_HOOK is False
    monkeypatch.setenv("VLLM_USE_BYTECODE_HOOK", "maybe")
    with pytest.raises(ValueError, match="VLLM_USE_BYTECODE_HOOK='maybe' is not a boolean"):
        envs.VLLM_USE_BYTECODE_HOOK
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/tmp/mvc")
    assert envs.VLLM_CACHE_ROOT == "/tmp/mvc"
    monkeypatch.delenv("VLLM_CACHE_ROOT")
    assert envs.VLLM_CACHE_ROOT.endswith(".cache/minivllm_compile")  # never vLLM's own cache


def test_counter_expect_checks_deltas():
    with compilation_counter.expect(num_graphs_seen=1, num_models_seen=0):
        compilation_counter.num_graphs_seen += 1
    with pytest.raises(AssertionError, match="num_graphs_seen: 0 != 1"):
        with compilation_counter.expect(num_graphs_seen=1):
            pass
    with pytest.raises(ValueError, match="no field"):
        with compilation_counter.expect(num_graphs=1):
            pass


@pytest.mark.parametrize("ops, phrase", [
    (["+layernorm"], "Invalid syntax '\\+layernorm' for custom op"),
    (["all", "none"], "can contain only one base mode"),
    (["none", "+rms_norm", "-rms_norm"], r"cannot both enable and disable the same operation\(s\)"),
])
def test_custom_ops_errors_carry_vllms_phrases(ops, phrase):
    """Clearer wording here, and vLLM's own phrase too: a search for vLLM's message finds it."""
    with pytest.raises(ValueError, match=phrase):
        CompilationConfig(custom_ops=ops)


def test_unbacked_with_evaluate_guards_is_refused():
    with pytest.raises(ValueError, match="unbacked symbols add no shape guards"):
        DynamicShapesConfig(type=DynamicShapesType.UNBACKED, evaluate_guards=True)


def test_custom_ops_switch_follows_vllm():
    assert CompilationConfig().custom_op_enabled("rms_norm")  # default: all
    none = CompilationConfig(custom_ops=["none", "+silu_and_mul"])
    assert not none.custom_op_enabled("rms_norm") and none.custom_op_enabled("silu_and_mul")
    assert not CompilationConfig(
        custom_ops=["all", "-rotary_embedding"]).custom_op_enabled("rotary_embedding")
    with pytest.raises(ValueError, match="custom_ops.*'\\+name'"):
        CompilationConfig(custom_ops=["+layernorm"])


def test_default_device_follows_minivllm_device(monkeypatch):
    from minivllm_compile.envs import default_device

    monkeypatch.delenv("MINIVLLM_DEVICE", raising=False)
    assert default_device() == ("cuda" if torch.cuda.is_available() else "cpu")
    monkeypatch.setenv("MINIVLLM_DEVICE", " CPU ")
    assert default_device() == "cpu"
    monkeypatch.setenv("MINIVLLM_DEVICE", "gpu")
    with pytest.raises(ValueError, match="MINIVLLM_DEVICE='gpu'.*cpu or cuda"):
        default_device()
    if not torch.cuda.is_available():
        monkeypatch.setenv("MINIVLLM_DEVICE", "cuda")
        with pytest.raises(RuntimeError, match="sees no GPU"):
            default_device()


def test_the_values_those_refusals_spare_still_construct():
    """Where the refusals above stop: what vLLM accepts is still accepted."""
    assert CompilationConfig(mode=CompilationMode.NONE,
                             max_num_batched_tokens=1).max_num_batched_tokens == 1
    unbacked = DynamicShapesConfig(type=DynamicShapesType.UNBACKED)
    assert CompilationConfig(max_num_batched_tokens=1, dynamic_shapes_config=unbacked)
    assert CompilationConfig(
        pass_config={"eliminate_noops": False}).pass_config.eliminate_noops is False
    assert CompilationConfig(cache_dir=Path("/tmp/x")).cache_dir == "/tmp/x"
    assert CompilationConfig(compile_sizes=(8, 4)).compile_sizes == [4, 8]
    assert CompilationConfig(custom_ops=["none", "+rms_norm",
                                         "-silu_and_mul"]).custom_op_enabled("rms_norm")


def test_an_empty_cache_root_is_refused(monkeypatch):
    """VLLM_CACHE_ROOT="" would put the cache in the current directory, unseen."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", "")
    with pytest.raises(ValueError, match="VLLM_CACHE_ROOT is set but empty"):
        envs.VLLM_CACHE_ROOT


def test_compile_range_endpoints_vllm_would_drop_are_dropped():
    """vLLM keeps only the endpoints e with 1 < e < max_num_batched_tokens (VllmConfig.
    _set_compile_ranges): 1 does not make Range(1, 1), one at or past the end adds nothing."""
    cc = CompilationConfig(compile_ranges_endpoints=[1, 8, 64, 500], max_num_batched_tokens=64)
    assert cc.compile_ranges_endpoints == [8]
    assert cc.get_compile_ranges() == [Range(1, 8), Range(9, 64)]
    with pytest.raises(ValueError, match=r"compile_ranges_endpoints \[0\]"):
        CompilationConfig(compile_ranges_endpoints=[0])  # vLLM asserts x > 0


def test_aot_compile_is_off_when_the_cache_is(monkeypatch):
    """vLLM's use_aot_compile(): on by default (torch >= 2.10) unless VLLM_DISABLE_COMPILE_CACHE is
    set, so a cache-less run takes the JIT path through the bytecode hook."""
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    assert envs.VLLM_USE_AOT_COMPILE is True
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    assert envs.VLLM_USE_AOT_COMPILE is False
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")  # an explicit setting wins, as in vLLM
    assert envs.VLLM_USE_AOT_COMPILE is True


def test_a_range_gated_pass_adds_its_endpoint():
    """As vLLM's _set_compile_ranges adds a range-gated fusion's max token count to the endpoints:
    on and bounded, it makes a range end there; off, or past the end, it adds nothing."""
    from minivllm_compile import PassConfig

    gated = PassConfig(enable_qk_norm_rope_fusion=True, qk_norm_rope_fusion_max_token_num=8)
    cc = CompilationConfig(max_num_batched_tokens=32, compile_ranges_endpoints=[16],
                           pass_config=gated)
    assert cc.get_compile_ranges() == [Range(1, 8), Range(9, 16), Range(17, 32)]
    off = PassConfig(qk_norm_rope_fusion_max_token_num=8)
    assert CompilationConfig(max_num_batched_tokens=32,
                             pass_config=off).get_compile_ranges() == [Range(1, 32)]
    past = PassConfig(enable_qk_norm_rope_fusion=True, qk_norm_rope_fusion_max_token_num=64)
    assert CompilationConfig(max_num_batched_tokens=32,
                             pass_config=past).get_compile_ranges() == [Range(1, 32)]
    assert hash_config(cc) != hash_config(CompilationConfig(max_num_batched_tokens=32,
                                                            compile_ranges_endpoints=[16]))
    with pytest.raises(ValueError, match="qk_norm_rope_fusion_max_token_num must "
                                         "be a positive int or None"):
        PassConfig(qk_norm_rope_fusion_max_token_num=0)


def test_v1_auto_functionalization_is_set_by_the_config_in_every_mode():
    """As vLLM's CompilationConfig.__post_init__ sets enable_auto_functionalized_v2=False (the
    passes read v1 nodes): so DYNAMO_TRACE_ONCE's whole-graph Inductor compile gets it too, not only
    the backend's; a value the user gives wins."""
    from minivllm_compile.models import build_model

    for mode in CompilationMode:
        config = CompilationConfig(mode=mode).inductor_compile_config
        assert config["enable_auto_functionalized_v2"] is False
    once = build_model("llama", num_layers=1, compilation_config=CompilationConfig(
        mode=CompilationMode.DYNAMO_TRACE_ONCE, max_num_batched_tokens=16))
    assert once.model.backend.inductor_config["enable_auto_functionalized_v2"] is False
    kept = CompilationConfig(inductor_compile_config={"enable_auto_functionalized_v2": True})
    assert kept.inductor_compile_config["enable_auto_functionalized_v2"] is True
