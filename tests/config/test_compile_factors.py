"""Compile factors in vLLM 0.34's shape (config/utils.py): every config says which of its fields
change what is compiled (compile_factors), built on get_compile_factors and normalize_value, which
refuse what they cannot hash stably; a compiler adaptor adds its own (compile_factors(config)), and
one still defining the older compute_hash is refused."""

import dataclasses
import enum
import json

import pytest

from minivllm_compile import CompilationConfig, CompilationMode, envs
from minivllm_compile.config import (
    DynamicShapesConfig,
    IrOpPriorityConfig,
    KernelConfig,
    ParallelConfig,
    PassConfig,
    get_compile_factors,
    hash_config,
    hash_factors,
    normalize_value,
)


@dataclasses.dataclass
class Toy:
    size: int = 4
    path: str = "/tmp"
    hook: object = None

    def compile_factors(self):
        return get_compile_factors(self, {"path"})


def test_get_compile_factors_refuses_an_unknown_ignored_field():
    assert get_compile_factors(Toy(), {"path", "hook"}) == {"size": 4}
    with pytest.raises(ValueError, match=r"ignored_factors contain unknown fields \['pathh'\] "
                                         "for Toy"):
        get_compile_factors(Toy(), {"pathh"})


def test_get_compile_factors_refuses_a_value_it_cannot_hash_naming_the_field():
    with pytest.raises(TypeError, match="unsupported type for key 'hook' \\(function\\)"):
        get_compile_factors(Toy(hook=lambda: 1), set())
    with pytest.raises(TypeError, match="unsupported type for key 'hook' \\(object\\)"):
        get_compile_factors(Toy(hook=object()), set())


def test_normalize_value_gives_stable_json():
    class Color(enum.Enum):
        RED = 1

    class WithUuid:
        def uuid(self):
            return "u-1"

    assert normalize_value(Color.RED) == (f"{__name__}.{Color.__qualname__}", 1)  # not the int 1
    assert normalize_value(CompilationMode.VLLM_COMPILE) == 3  # an IntEnum is an int
    assert normalize_value(Toy) == f"{__name__}.Toy"
    assert normalize_value(Toy(size=8)) == {"size": 8, "hook": None}  # a config: its factors
    assert normalize_value(WithUuid()) == "u-1"
    assert normalize_value(b"\x01\xff") == "01ff"
    assert normalize_value({2: "b", 1: ("a", {3})}) == {"1": ("a", ("3",)), "2": "b"}
    with pytest.raises(TypeError, match="function or callable instance unsupported"):
        normalize_value(print)


def test_every_config_has_compile_factors_as_plain_json():
    cc = CompilationConfig()
    for config in (cc, cc.pass_config, cc.dynamic_shapes_config, cc.kernel_config,
                   cc.kernel_config.ir_op_priority, ParallelConfig()):
        factors = config.compile_factors()
        assert isinstance(factors, dict) and factors
        assert json.loads(json.dumps(factors)) is not None  # serializable as it is
        assert hash_config(config) == hash_factors(factors) == hash_config(config)
    compilation = cc.compile_factors()
    # nested configs by their own factors, named down to the field
    assert compilation["pass_config"] == PassConfig().compile_factors()
    assert compilation["dynamic_shapes_config"] == DynamicShapesConfig().compile_factors()
    assert compilation["kernel_config"]["ir_op_priority"]["rms_norm"] == ("native",)
    assert set(compilation["kernel_config"]["ir_op_priority"]["_impls"]["rms_norm"]) == {"native"}
    assert not {"cache_dir", "debug_dump_path", "traced_files",
                "enforce_eager"} & set(compilation)
    # the TP size, not the rank
    assert ParallelConfig(2, rank=1).compile_factors() == {"tensor_parallel_size": 2}
    assert hash_config(ParallelConfig(2, rank=0)) == hash_config(ParallelConfig(2, rank=1))
    assert hash_config(ParallelConfig(2)) != hash_config(ParallelConfig(1))


@pytest.mark.parametrize("change", [
    {"cudagraph_mode": "FULL_AND_PIECEWISE"},
    {"cudagraph_capture_sizes": [1, 2, 8]},
    {"max_cudagraph_capture_size": 8},
    {"cudagraph_copy_inputs": True},
])
def test_each_cuda_graph_field_is_hashed_as_vllm_hashes_it(change):
    def cc(**kw):
        kw = {"cudagraph_mode": "PIECEWISE", **kw}
        return CompilationConfig(mode=CompilationMode.VLLM_COMPILE, max_num_batched_tokens=16,
                                 **kw)

    assert hash_config(cc()) == hash_config(cc())
    assert hash_config(cc(**change)) != hash_config(cc())


class _CallablePass:  # a pass without a uuid(): keyed by its class's source
    def __call__(self, graph):
        pass


def test_what_is_no_compiled_code_is_left_out_and_a_users_pass_is_its_source():
    from minivllm_compile.compilation.passes.inductor_pass import CallableInductorPass

    def my_pass(graph):
        pass

    base = hash_config(CompilationConfig())
    assert hash_config(CompilationConfig(inductor_compile_config={
        "guard_filter_fn": lambda entries: [True] * len(entries)})) == base
    # enforce_eager acts through mode and cudagraph_mode, which are hashed
    assert hash_config(CompilationConfig(enforce_eager=True)) == hash_config(
        CompilationConfig(mode=CompilationMode.NONE))
    with_pass = CompilationConfig(inductor_compile_config={"post_grad_custom_post_pass": my_pass})
    factors = with_pass.compile_factors()["inductor_compile_config"]
    # the uuid the backend's wrapper will have, the function's source: not its address
    assert factors["post_grad_custom_post_pass"] == CallableInductorPass(my_pass).uuid()
    def user_pass_factor(user_pass):
        return CompilationConfig(inductor_compile_config={
            "post_grad_custom_post_pass": user_pass}).compile_factors()[
            "inductor_compile_config"]["post_grad_custom_post_pass"]

    assert user_pass_factor(_CallablePass()) == CallableInductorPass(_CallablePass()).uuid()
    given = CallableInductorPass(my_pass, uuid="mine v2")
    assert user_pass_factor(given) == "mine v2"
    # any other function there has no stable form: refused, naming where it is
    with pytest.raises(TypeError, match="'inductor_compile_config' of CompilationConfig"):
        CompilationConfig(inductor_compile_config={
            "post_grad_custom_pre_pass": my_pass}).compile_factors()


def test_the_ir_priority_and_each_providers_uuid_are_factors():
    native = KernelConfig(IrOpPriorityConfig.with_default(["native"]))
    vllm_c = KernelConfig(IrOpPriorityConfig.with_default(["vllm_c", "native"]))
    assert hash_config(native) != hash_config(vllm_c)
    impls = native.ir_op_priority.compile_factors()["_impls"]
    assert set(impls) == {f.name for f in dataclasses.fields(IrOpPriorityConfig)}
    assert impls["rms_norm"]["native"] and "vllm_c" in vllm_c.compile_factors()[
        "ir_op_priority"]["_impls"]["rms_norm"]


def test_the_env_factors_are_every_switch_but_the_ignored_ones(monkeypatch):
    factors = envs.compile_factors()
    assert set(factors) == set(envs.environment_variables) - envs.IGNORED_FACTORS
    assert {"VLLM_USE_AOT_COMPILE", "VLLM_USE_BYTECODE_HOOK", "VLLM_USE_MEGA_AOT_ARTIFACT",
            "VLLM_USE_STANDALONE_COMPILE", "VLLM_DISABLE_COMPILE_CACHE",
            "MINIVLLM_DEVICE"} <= set(factors)
    assert {"VLLM_CACHE_ROOT", "VLLM_FORCE_AOT_LOAD", "VLLM_LOGGING_LEVEL"} <= envs.IGNORED_FACTORS
    monkeypatch.setenv("VLLM_CACHE_ROOT", "/elsewhere")  # where the cache is: not a factor
    monkeypatch.setenv("VLLM_FORCE_AOT_LOAD", "1")
    assert envs.compile_factors() == factors
    monkeypatch.setenv("VLLM_USE_BYTECODE_HOOK", "0")
    assert envs.compile_factors()["VLLM_USE_BYTECODE_HOOK"] is False


def test_an_adaptor_defining_compute_hash_is_refused_and_each_gives_its_factors():
    from minivllm_compile.compilation.compiler_interface import (
        CompilerInterface,
        EagerAdaptor,
        InductorAdaptor,
        InductorStandaloneAdaptor,
    )

    with pytest.raises(TypeError, match="Old defines `compute_hash`, which is no longer called. "
                                        "Implement `compile_factors` instead."):
        class Old(CompilerInterface):
            def compute_hash(self, config):
                return "x"

    class New(CompilerInterface):  # compile_factors is the way
        def compile_factors(self, config):
            return {"mine": 1}

    cc = CompilationConfig()
    assert New().compile_factors(cc) == {"mine": 1} and EagerAdaptor().compile_factors(cc) == {}
    standalone = InductorStandaloneAdaptor().compile_factors(cc)
    assert standalone == InductorAdaptor().compile_factors(cc)
    assert set(standalone) == {"inductor"}
    inductor = standalone["inductor"]
    assert {"torch_key", "torch_version", "inductor_config", "functorch_config"} <= set(inductor)
    assert "max_autotune" in inductor["inductor_config"]
