"""The fusion passes register their patterns on fake tensors (vLLM's enable_fake_mode,
passes/inductor_pass.py): tracing a pattern runs no op, so registering the all-reduce patterns
needs no process group and runs no collective during a compile."""

import pytest
import torch
from torch._inductor.pattern_matcher import PatternMatcherPass
from torch._subclasses.fake_tensor import FakeTensor

from minivllm_compile import PassConfig
from minivllm_compile.compilation.passes.fusion import (
    act_quant_fusion,
    allreduce_rms_fusion,
    qk_norm_rope_fusion,
    rms_quant_fusion,
)
from minivllm_compile.distributed import model_parallel_is_initialized


def test_the_all_reduce_patterns_register_without_a_process_group():
    """A real all-reduce on "tp:0" fails in a process with no groups: the registration, which
    traces two all-reduce patterns three times, never runs one."""
    assert not model_parallel_is_initialized()
    fusion = allreduce_rms_fusion.AllReduceFusionPass.__new__(
        allreduce_rms_fusion.AllReduceFusionPass)  # as built at TP=2, without the group
    fusion.params = allreduce_rms_fusion.FlashInferFusedAllReduceParams(2, 64, "tp:0")
    fusion.patterns, fusion.registered = PatternMatcherPass(), set()
    fusion.register_patterns(1e-5, torch.float32)
    assert fusion.registered == {(1e-5, torch.float32)} and fusion.patterns.patterns
    with pytest.raises(Exception, match="tp:0"):  # what tracing on real tensors would have hit
        torch.ops.minivllm.all_reduce(torch.ones(2), "tp:0")


@pytest.mark.parametrize("make", [
    lambda: rms_quant_fusion.RMSNormQuantFusionPass(PassConfig(fuse_norm_quant=True)),
    lambda: act_quant_fusion.ActivationQuantFusionPass(PassConfig(fuse_act_quant=True)),
], ids=["rms_quant", "act_quant"])
def test_the_quant_patterns_are_traced_on_fake_inputs(make, monkeypatch):
    seen = []
    real = rms_quant_fusion.register

    def spy(pattern, replacement, inputs, *args, **kwargs):
        seen.extend(inputs)
        return real(pattern, replacement, inputs, *args, **kwargs)

    for module in (rms_quant_fusion, act_quant_fusion):
        monkeypatch.setattr(module, "register", spy)
    fusion = make()
    if isinstance(fusion, rms_quant_fusion.RMSNormQuantFusionPass):
        fusion.register_patterns(1e-5, torch.float32)
    else:
        fusion.register_patterns(torch.float32)
    assert seen and all(isinstance(t, FakeTensor) for t in seen)


def test_the_qk_norm_rope_patterns_are_traced_on_fake_inputs(monkeypatch):
    seen = []
    real = qk_norm_rope_fusion.QkNormRopePattern.get_inputs

    def spy(self):
        inputs = real(self)
        seen.extend(inputs)
        return inputs

    monkeypatch.setattr(qk_norm_rope_fusion.QkNormRopePattern, "get_inputs", spy)
    fusion = qk_norm_rope_fusion.QKNormRoPEFusionPass(PassConfig(enable_qk_norm_rope_fusion=True))
    fusion.register_patterns(qk_norm_rope_fusion.QkNormRopeGeometry(4, 2, 16, 1e-6, torch.float32))
    assert seen and all(isinstance(t, FakeTensor) for t in seen if isinstance(t, torch.Tensor))
