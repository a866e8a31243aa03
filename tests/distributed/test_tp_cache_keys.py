"""Tensor parallelism and the compiler, in one process (the ranks faked, nothing communicates):
the cache key has the TP size and not the rank, the folder has the rank, and the all-reduce fusion
is off by default and at TP=1, its op functionalizes as FixFunctionalization expects, and its uuid
is in the key. The real 2-rank runs are in test_tp_compile.py."""

import contextlib
import operator
import types

import pytest
import torch
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized

from minivllm_compile import CompilationConfig, CompilationMode
from minivllm_compile.compilation import cache_files, cache_keys
from minivllm_compile.compilation.passes import make_pass_manager
from minivllm_compile.compilation.passes.utility.fix_functionalization import (
    FixFunctionalizationPass,
)
from minivllm_compile.config import PassConfig
from minivllm_compile.distributed import parallel_state
from minivllm_compile.models import build_model


@contextlib.contextmanager
def as_rank(rank: int, size: int):
    """Rank `rank` of `size`, as the layers and the key read it, with no process group."""
    old = parallel_state._TP, parallel_state._WORLD
    group = types.SimpleNamespace(world_size=size, rank_in_group=rank, rank=rank,
                                  unique_name="tp:0", all_reduce=lambda t: t)
    parallel_state._TP = parallel_state._WORLD = group
    try:
        yield
    finally:
        parallel_state._TP, parallel_state._WORLD = old


def key_of(rank: int, size: int, **pass_config):
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, pass_config=pass_config)
    with as_rank(rank, size):
        lm = build_model("llama", num_layers=1, seed=3)
        return cache_keys.aot_cache_key(lm.model, cc), cache_files.rank_folder(), \
            cache_keys.model_constants(lm.model)


def test_every_rank_gets_one_hash_and_its_own_folder():
    """The two ranks of a TP=2 model hold different plain values (their rank, their slice of the
    vocabulary), which Dynamo bakes into each rank's graph: those are left out of the key, so both
    ranks share the hash (vLLM's hash excludes the rank), and the folder below it has the rank."""
    (k0, f0), folder0, c0 = key_of(0, 2)
    (k1, f1), folder1, c1 = key_of(1, 2)
    assert k0 == k1 and f0 == f1
    assert (folder0, folder1) == ("rank_0_0", "rank_1_0")
    assert f0["config"]["parallel"] == {"tensor_parallel_size": 2}
    assert not any(n.endswith((".tp_rank", ".vocab_start_index", ".vocab_end_index")) for n in c0)
    assert c0 == c1 and c0["embed_tokens.tp_size"] == 2  # what is the same on every rank stays


def test_tp1_and_tp2_differ_and_tp1_keeps_its_key():
    """TP=1 and TP=2 differ by config.parallel (and the shard shapes); a TP=1 rank keys and lays
    out as a single process does (rank_0_0)."""
    from minivllm_compile.viz.debugging import changed_factors

    (k1, f1), folder, _ = key_of(0, 1)
    (k2, f2), _, _ = key_of(0, 2)
    assert k1 != k2 and folder == "rank_0_0"
    assert changed_factors(f1, f2)["config.parallel.tensor_parallel_size"] == (1, 2)
    lm = build_model("llama", num_layers=1, seed=3)  # no TP group at all
    assert cache_keys.aot_cache_key(lm.model, CompilationConfig())[0] == k1
    assert cache_files.rank_folder() == "rank_0_0"


def test_allreduce_fusion_is_off_by_default_and_disabled_at_tp1():
    """PassConfig.fuse_allreduce_rms is off by default. Turned on at TP=1 the pass is in the
    pipeline but disabled (vLLM's: nothing to reduce), so it applies to no range and adds no
    compile-range endpoint."""
    assert PassConfig().fuse_allreduce_rms is False
    assert not any(type(p).__name__ == "AllReduceFusionPass"
                   for p in make_pass_manager(CompilationConfig()).all_passes())
    on = {"fuse_allreduce_rms": True, "allreduce_fusion_max_token_num": 8}
    cc = CompilationConfig(max_num_batched_tokens=32, pass_config=on)
    (fusion,) = [p for p in make_pass_manager(cc).passes if type(p).__name__
                 == "AllReduceFusionPass"]
    assert fusion.disabled and not fusion.is_applicable_for_range(cc.get_compile_ranges()[0])
    assert cc.compile_ranges_endpoints == []
    with as_rank(0, 2):
        cc2 = CompilationConfig(max_num_batched_tokens=32, pass_config=on)
        (fusion2,) = [p for p in make_pass_manager(cc2).passes
                      if type(p).__name__ == "AllReduceFusionPass"]
    assert cc2.compile_ranges_endpoints == [8]  # vLLM's _set_compile_ranges: an endpoint at TP=2
    assert [fusion2.is_applicable_for_range(r) for r in cc2.get_compile_ranges()] == [True, False]
    assert fusion2.max_token_num == 8


def test_the_fusion_pass_and_its_gate_are_in_the_key():
    """At TP=2, turning the pass on, or changing its gate, is another key (its settings are in
    config.compilation.pass_config, the TP size in config.parallel), and another pass manager
    uuid (Inductor's FX-graph key: the pass's source, the TP size, max_token_num, the group)."""
    configs = [{}, {"fuse_allreduce_rms": True},
               {"fuse_allreduce_rms": True, "allreduce_fusion_max_token_num": 4}]
    with as_rank(0, 2):
        ccs = [CompilationConfig(pass_config=c) for c in configs]
        uuids = {cache_keys.passes_uuid(cc) for cc in ccs}
        keys = {cache_keys.backend_cache_key(cc, "cpu")[0] for cc in ccs}
    assert len(uuids) == len(keys) == 3


@pytest.mark.parametrize("with_norm_out", [False, True])
def test_the_fused_op_functionalizes_and_is_defunctionalized(with_norm_out):
    """The fused op mutates allreduce_in, residual and norm_out (vLLM's schema); its
    auto_functionalized form's results 1, 2, 3 are those arguments, and FixFunctionalization turns
    it into the direct in-place call with every reader pointed at the argument."""
    op = torch.ops.minivllm.flashinfer_trtllm_fused_allreduce_norm.default
    assert [a.name for a in op._schema.arguments if a.alias_info and a.alias_info.is_write] == \
        ["allreduce_in", "residual", "norm_out"]
    g = fx.Graph()
    x, res, w, out = (g.placeholder(n) for n in ("x", "res", "w", "out"))
    at = g.call_function(auto_functionalized, (op,), {
        "allreduce_in": x, "residual": res, "rms_gamma": w, "rms_eps": 1e-6, "world_size": 2,
        "max_token_num": 16,
        "group_name": "tp:0", "norm_out": out if with_norm_out else None})
    picks = [g.call_function(operator.getitem, (at, i))
             for i in ((3, 1) if with_norm_out else (1, 2))]
    g.output(tuple(picks))
    FixFunctionalizationPass()(g)
    calls = [n for n in g.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [op]
    assert calls[0].args[:3] == (x, res, w) and calls[0].args[-1] == (
        out if with_norm_out else None)
    (output,) = g.find_nodes(op="output")
    assert output.args[0] == ((out, x) if with_norm_out else (x, res))
