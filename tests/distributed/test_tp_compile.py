"""Compiling under TP=2 in real processes (launch.run, gloo on loopback), Inductor: each rank's own
folder below one shared hash, a warm start that compiles nothing on either rank, and the
all-reduce + RMSNorm fusion (its matches, its logits, its range gate). Two launches in all, shared
by the tests; each bounded by a timeout, and launch.run kills every rank it started."""

import json

import pytest
import torch

from minivllm_compile import launch

# every test here compiles, or shares a module fixture that does: whole suite only
pytestmark = pytest.mark.compiles

TOKENS = 7


def _ranks_compile(root: str, warm: bool):
    """On each rank: the model compiled with the compile cache in `root` (cold, or warm from the
    first launch); on the cold launch also, with the cache off, the all-reduce fusion on, and on
    with a range gate."""
    from minivllm_compile import CompilationConfig, CompilationMode, envs
    from minivllm_compile.compilation.counter import compilation_counter
    from minivllm_compile.compilation.passes.vllm_inductor_pass import VllmPatternMatcherPass
    from minivllm_compile.distributed import tensor_parallel_disabled
    from minivllm_compile.models import build_model

    def config(inductor=None, **pass_config):
        return CompilationConfig(mode=CompilationMode.VLLM_COMPILE, max_num_batched_tokens=16,
                                 pass_config=pass_config, inductor_compile_config=inductor or {})

    ids, pos = torch.arange(1, TOKENS + 1), torch.arange(TOKENS)
    out = {}
    with envs.override(VLLM_CACHE_ROOT=root, VLLM_DISABLE_COMPILE_CACHE="0"):
        before = compilation_counter.clone()
        out["logits"] = build_model("llama", num_layers=2, compilation_config=config(),
                                    seed=5)(ids, pos)
        out["counters"] = dict(compilation_counter.since(before))
    if warm:
        return out

    def fused_run(layers, **pass_config):
        before = VllmPatternMatcherPass.match_table["AllReduceFusionPass"]
        # Inductor's own cache off: a hit (the other rank's identical piece) would skip the passes
        cc = config({"force_disable_caches": True}, **pass_config)
        lm = build_model("llama", num_layers=layers, compilation_config=cc, seed=5)
        logits = {n: lm(ids[:n], pos[:n]) for n in (TOKENS, 3)}
        matches = VllmPatternMatcherPass.match_table["AllReduceFusionPass"] - before
        code = {}  # each compile range's Inductor code, every piece's
        for piece in lm.model.backend.piecewise_backends:
            for r, entry in piece.range_entries.items():
                code.setdefault(str(r), []).append("\n".join(entry.compiled.code))
        return logits, matches, code, lm.model.compilation_config.compile_ranges_endpoints

    out["fused"] = fused_run(2, fuse_allreduce_rms=True)
    out["gated"] = fused_run(1, fuse_allreduce_rms=True, allreduce_fusion_max_token_num=4)
    eager = build_model("llama", num_layers=1, seed=5)  # this rank's shard, uncompiled
    out["eager_1_layer"] = {n: eager(ids[:n], pos[:n]) for n in (TOKENS, 3)}
    with tensor_parallel_disabled():
        out["whole"] = build_model("llama", num_layers=2, seed=5)(ids, pos)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tp_cache"))
    # the default timeouts: a rank that finds the other's pieces in the shared Inductor cache
    # waits at its first all-reduce for the compile timeout, not the collective one
    cold = launch.run(_ranks_compile, tp=2, kwargs={"root": root, "warm": False}, timeout=500)
    warm = launch.run(_ranks_compile, tp=2, kwargs={"root": root, "warm": True}, timeout=300)
    return root, cold, warm


def test_each_rank_has_its_folder_below_one_shared_hash(runs):
    """torch_aot_compile/<hash>/rank_{r}_0/model and <hash>/rank_{r}_0/backbone, one hash for both
    ranks (the TP size is in it, the rank is not), and the factors say TP=2."""
    from pathlib import Path

    base = Path(runs[0]) / "torch_compile_cache"
    aot = sorted(str(p.relative_to(base / "torch_aot_compile"))
                 for p in (base / "torch_aot_compile").glob("*/rank_*/model"))
    assert len(aot) == 2 and {a.split("/")[0] for a in aot} == {aot[0].split("/")[0]}
    assert [a.split("/")[1] for a in aot] == ["rank_0_0", "rank_1_0"]
    backend = sorted(p.relative_to(base) for p in base.glob("*/rank_*/backbone"))
    assert [str(p.parent.name) for p in backend] == ["rank_0_0", "rank_1_0"]
    assert backend[0].parent.parent == backend[1].parent.parent
    factors = [json.loads((base / p / "cache_key_factors.json").read_text()) for p in backend]
    assert factors[0] == factors[1]
    assert factors[0]["config"]["parallel"] == {"tensor_parallel_size": 2}


def test_a_warm_tp2_start_compiles_nothing_on_either_rank(runs):
    """The second launch loads each rank's AOT artifact from its own folder: no Dynamo trace, no
    Inductor compile, on either rank; the logits are the cold start's, bit for bit."""
    _, cold, warm = runs
    for c, w in zip(cold, warm):
        assert (c["counters"]["num_aot_compiles"] == 1
                and c["counters"]["num_aot_artifacts_saved"] == 1)
        assert c["counters"]["num_inductor_compiles"] > 0
        assert w["counters"]["num_aot_artifacts_loaded"] == 1
        assert w["counters"].get("num_inductor_compiles", 0) == 0
        assert w["counters"].get("num_dynamo_traces", 0) == 0
        assert torch.equal(w["logits"], c["logits"])
    torch.testing.assert_close(cold[0]["logits"], cold[0]["whole"], atol=1e-5, rtol=1e-5)


def test_the_fusion_replaces_every_all_reduce_before_a_norm(runs):
    """fuse_allreduce_rms=True, 2 layers: 2L+1 = 5 matches on each rank (after o_proj and
    down_proj in each layer, and after the vocabulary-parallel embedding), the fused op in the
    generated code and no plain all-reduce left; the logits equal the unfused compile's within
    1e-5 (float32)."""
    for r in runs[1]:
        logits, matches, code, _ = r["fused"]
        assert matches == 5
        (text,) = code.values()  # one range: Range(1, 16)
        src = "\n".join(text)
        assert "flashinfer_trtllm_fused_allreduce_norm" in src and "minivllm.all_reduce" not in src
        torch.testing.assert_close(logits[TOKENS], r["logits"], atol=1e-5, rtol=1e-5)


def test_the_range_gate_keeps_a_range_past_max_token_num_unfused(runs):
    """allreduce_fusion_max_token_num=4: an endpoint at 4, so ranges 1-4 and 5-16; the fusion
    applies to the first only (3 matches, 1 layer), the second keeps the plain all-reduce. Both
    sizes' logits equal the eager model's."""
    for r in runs[1]:
        logits, matches, code, endpoints = r["gated"]
        assert endpoints == [4] and matches == 3
        small, large = "\n".join(code["Range(1, 4)"]), "\n".join(code["Range(5, 16)"])
        assert ("flashinfer_trtllm_fused_allreduce_norm" in small
                and "minivllm.all_reduce" not in small)
        assert ("flashinfer_trtllm_fused_allreduce_norm" not in large
                and "minivllm.all_reduce" in large)
        for n in (TOKENS, 3):
            torch.testing.assert_close(logits[n], r["eager_1_layer"][n], atol=1e-5, rtol=1e-5)
