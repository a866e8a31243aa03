"""QKNormRoPEFusionPass (vLLM's passes/fusion/qk_norm_rope_fusion.py) on the hybrid's attention
layers, whose q and k get a per-head RMSNorm before RoPE: under VLLM_COMPILE with Inductor, with
the custom ops ("all") and with their plain-torch forms ("none")."""

from __future__ import annotations

import re

import pytest
import torch

from minivllm_compile import CompilationConfig, CompilationMode, PassConfig, Range
from minivllm_compile.compilation import cache_keys
from minivllm_compile.compilation.passes import QKNormRoPEFusionPass, make_pass_manager
from minivllm_compile.config import hash_config
from minivllm_compile.models import build_model, load_model

QK = "QKNormRoPEFusionPass"
FUSED = "torch.ops.minivllm.fused_qk_norm_rope.default"
# fp32 throughout: the fused op keeps the normalised head in fp32 through the rotation, as the
# unfused ops do in fp32, so the two differ by the order of fp32 operations only
ATOL = RTOL = 1e-5
SIZES, ENDPOINTS, MAX = [4], [8], 16  # entries: size 4, Range(1, 8), Range(9, 16)


pytestmark = pytest.mark.usefixtures("compile_every_time")


def _cfg(custom_ops="all", fusion=True, max_token_num=None, **kw) -> CompilationConfig:
    kw.setdefault("compile_sizes", SIZES)
    kw.setdefault("compile_ranges_endpoints", ENDPOINTS)
    kw.setdefault("max_num_batched_tokens", MAX)
    # no FX graph cache: the post-grad passes really run for every entry
    return CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, custom_ops=custom_ops.split(","),
        inductor_compile_config={"fx_graph_cache": False},
        pass_config=PassConfig(enable_qk_norm_rope_fusion=fusion,
                               qk_norm_rope_fusion_max_token_num=max_token_num),
        **kw)


def _eager(make, custom_ops):
    return make(CompilationConfig(mode=CompilationMode.NONE, custom_ops=custom_ops.split(",")))


def _ids(lm, n=MAX):
    return torch.randint(0, lm.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))


def _runs(manager) -> list[dict[str, str]]:
    """The manager's records, one {stage: graph source} per post-grad run (one compiled entry)."""
    runs: list[dict[str, str]] = []
    for stage, text in manager.records:
        if stage == "post_grad.0.NoOpEliminationPass.before":
            runs.append({})
        runs[-1][stage] = text
    return runs


def _sites(text: str) -> int:
    """Attention layers in a graph: each splits its qkv matmul (nothing else
    splits, in either form)."""
    return len(re.findall(r"= torch\.ops\.aten\.split_with_sizes\.default\(", text))


def _unfused_left(text: str) -> list[str]:
    """What the unfused q/k norm + RoPE leaves in a graph, either form: the RoPE op, or the
    native RoPE's cos/sin lookup and the concatenation of its rotated halves; the per-head norm
    (its input reshaped to [T, heads, head_dim])."""
    return re.findall(r"torch\.ops\.minivllm\.rotary_embedding\.default"
                      r"|torch\.ops\.aten\.index\.Tensor|torch\.ops\.aten\.cat\.default"
                      r"|reshape\.default\(getitem_\d+, \[\w+, \d+, \d+\]\)", text)


# what an in-place op left functional costs in Inductor's code: a copy of its buffer (or a clone)
COPY = re.compile(r"\.copy_\(|\bclone\(|aten\.clone")


def _check_fused(lm) -> dict[str, int]:
    """Every post-grad run: each attention layer of the piece replaced, nothing unfused left, and
    the run's matched_count as many; after FixFunctionalizationPass (last) each fused op is a
    direct in-place call, none left in auto_functionalized, and the generated code that calls it
    copies and clones nothing (a functional op's cost, notebook 05). Returns totals."""
    manager = lm.model.backend.post_grad_pass_manager
    (qk,) = [p for p in manager.passes if isinstance(p, QKNormRoPEFusionPass)]
    totals = {"runs": 0, "sites": 0, "fused": 0}
    for run in _runs(manager):
        before, after = run[f"post_grad.1.{QK}.before"], run[f"post_grad.1.{QK}.after"]
        sites = _sites(before)
        assert after.count(f"auto_functionalized({FUSED}") == sites, after
        assert _unfused_left(after) == [], after
        if sites:
            assert _unfused_left(before)  # there was something to fuse
        (fixed,) = [text for stage, text in run.items()
                    if stage.endswith("FixFunctionalizationPass.after")]
        assert f"auto_functionalized({FUSED}" not in fixed and fixed.count(
            f"= {FUSED}(") == sites, fixed
        totals["runs"] += 1
        totals["sites"] += sites
        totals["fused"] += after.count(FUSED)
    assert qk.matched_count == _sites(_runs(manager)[-1][f"post_grad.1.{QK}.before"])
    calling = [c for b in lm.model.backend.piecewise_backends for e in b.range_entries.values()
               if FUSED in (c := "".join(e.compiled.code))]
    assert calling
    for code in calling:
        assert not COPY.search(code), COPY.findall(code)
    return totals


def _entry_code(lm) -> dict[Range, list[bool]]:
    """For each compiled range/size, one flag per piece: does its generated
    code call the fused op."""
    found: dict[Range, list[bool]] = {}
    for backend in lm.model.backend.piecewise_backends:
        for r, entry in backend.range_entries.items():
            found.setdefault(r, []).append("fused_qk_norm_rope" in "".join(entry.compiled.code))
    return found


@pytest.mark.compiles
@pytest.mark.parametrize("custom_ops", ["all", "none"])
def test_every_attention_layer_is_fused_and_outputs_match_at_every_size_and_range(custom_ops):
    def make(cc):
        return build_model("hybrid", num_layers=4, compilation_config=cc)

    lm, eager = make(_cfg(custom_ops)), _eager(make, custom_ops)
    ids = _ids(lm)
    for n in (MAX, 4, 3, 8, 9, 13):  # the first call compiles every entry
        got, want = lm(ids[:n], torch.arange(n)), eager(ids[:n], torch.arange(n))
        diff = (got - want).abs().max().item()
        print(f"custom_ops={custom_ops} num_tokens={n}: max |fused - unfused| = {diff:.2e}")
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    totals = _check_fused(lm)
    print(f"custom_ops={custom_ops}: {totals}")
    # 4 layers, conv/attention alternating: 5 pieces, 2 of them end in an attention layer's q/k/v.
    # Those two are identical, so the second reuses the first's artifacts: 4 pieces compiled for
    # 3 entries each, and one site in each of the 3 runs of the first attention piece
    assert totals == {"runs": 12, "sites": 3, "fused": 3}
    code = _entry_code(lm)
    assert set(code) == {Range(4, 4), Range(1, 8), Range(9, 16)}
    for r, flags in code.items():
        assert flags == [False, True, False, True, False], (r, flags)


@pytest.mark.compiles
@pytest.mark.parametrize("custom_ops", ["all", "none"])
def test_the_trained_hybrid_is_fused_and_generates_the_same_text(custom_ops):
    def make(cc):
        return load_model("tiny-hybrid", compilation_config=cc)

    lm = make(_cfg(custom_ops, compile_sizes=[], compile_ranges_endpoints=[],
                   max_num_batched_tokens=64))
    eager = _eager(make, custom_ops)
    prompt = torch.tensor([256, *b"def read_config(path):\n    with open(path) as f:\n"])
    n = len(prompt)
    got, want = lm(prompt, torch.arange(n)), eager(prompt, torch.arange(n))
    print(f"tiny-hybrid custom_ops={custom_ops}: max |fused - unfused| = "
          f"{(got - want).abs().max().item():.2e}")
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    # its two attention layers end two identical pieces: the second reuses the first's artifact
    assert _check_fused(lm) == {"runs": 4, "sites": 1, "fused": 1}
    assert _entry_code(lm) == {Range(1, 64): [False, True, False, True, False]}
    prompts = ["def __init__(self, name):\n"]
    assert lm.generate(prompts, max_new_tokens=24) == eager.generate(prompts, max_new_tokens=24)


@pytest.mark.compiles
@pytest.mark.parametrize("custom_ops, is_neox",
                         [("all", False), ("none", False), ("none,+rms_norm", True),
                                                  ("all,-rms_norm", True)])
def test_gpt_j_style_rope_and_mixed_forms_are_fused_too(custom_ops, is_neox):
    def make(cc):
        lm = build_model("hybrid", num_layers=2, compilation_config=cc)
        lm.model.layers[1].self_attn.rotary_emb.is_neox_style = is_neox  # read when traced
        return lm

    lm, eager = make(_cfg(custom_ops, compile_sizes=[],
                          compile_ranges_endpoints=[])), _eager(make, custom_ops)
    ids = _ids(lm)
    torch.testing.assert_close(lm(ids, torch.arange(MAX)), eager(ids, torch.arange(MAX)),
                               atol=ATOL, rtol=RTOL)
    assert _check_fused(lm) == {"runs": 3, "sites": 1, "fused": 1}
    after = [t for s, t in lm.model.backend.post_grad_pass_manager.records
             if s.endswith(f"{QK}.after")]
    assert any(f"is_neox = {is_neox}" in t for t in after)


@pytest.mark.compiles
def test_off_by_default():
    assert PassConfig().enable_qk_norm_rope_fusion is False
    lm = build_model("hybrid", num_layers=2,
                     compilation_config=_cfg(fusion=False, compile_sizes=[]))
    lm(_ids(lm), torch.arange(MAX))
    manager = lm.model.backend.post_grad_pass_manager
    assert not any(isinstance(p, QKNormRoPEFusionPass) for p in manager.passes)
    assert manager.records and not any(QK in stage for stage, _ in manager.records)
    assert not any("fused_qk_norm_rope" in text for _, text in manager.records)
    assert not any(any(flags) for flags in _entry_code(lm).values())


@pytest.mark.compiles
def test_a_model_without_qk_norm_runs_unchanged_with_the_pass_on():
    def make(cc):
        return build_model("llama", num_layers=2, compilation_config=cc)

    lm, eager = make(_cfg(compile_sizes=[])), _eager(make, "all")
    ids = _ids(lm)
    torch.testing.assert_close(lm(ids, torch.arange(MAX)), eager(ids, torch.arange(MAX)),
                               atol=ATOL, rtol=RTOL)
    manager = lm.model.backend.post_grad_pass_manager
    (qk,) = [p for p in manager.passes if isinstance(p, QKNormRoPEFusionPass)]
    # RoPE without q/k norm: not a candidate site
    assert qk.matched_count == 0 and not qk.geometries
    runs = _runs(manager)
    assert runs and all(run[f"post_grad.1.{QK}.before"] == run[f"post_grad.1.{QK}.after"]
                        for run in runs)


@pytest.mark.compiles
def test_range_gating_fuses_only_up_to_max_token_num():
    cc = _cfg(max_token_num=8, compile_sizes=[], compile_ranges_endpoints=[],
              max_num_batched_tokens=32)
    assert cc.get_compile_ranges() == [Range(1, 8), Range(9, 32)]  # the limit became an endpoint
    lm = build_model("hybrid", num_layers=2, compilation_config=cc)
    eager = _eager(lambda c: build_model("hybrid", num_layers=2, compilation_config=c), "all")
    ids = _ids(lm, 32)
    for n in (32, 5, 8, 9):
        torch.testing.assert_close(lm(ids[:n], torch.arange(n)), eager(ids[:n], torch.arange(n)),
                                   atol=ATOL, rtol=RTOL)
    code = _entry_code(lm)
    # the piece ending in the attention layer's q/k/v
    assert code[Range(1, 8)] == [False, True, False]
    assert code[Range(9, 32)] == [False, False, False]
    qk = QKNormRoPEFusionPass(cc.pass_config)
    assert [qk.is_applicable_for_range(r) for r in (Range(1, 8), Range(8, 8),
                                                    Range(9, 32))] == [True, True, False]
    assert QKNormRoPEFusionPass(
        PassConfig(enable_qk_norm_rope_fusion=True)).is_applicable_for_range(Range(9, 4096))


def test_the_pass_config_and_the_pass_source_are_in_the_cache_key():
    on, off = _cfg(fusion=True), _cfg(fusion=False)
    assert hash_config(on) != hash_config(off)
    assert cache_keys.passes_uuid(on) != cache_keys.passes_uuid(off)
    assert hash_config(_cfg(max_token_num=8)) != hash_config(_cfg(max_token_num=None))
    qk = make_pass_manager(on).passes[1]
    assert isinstance(qk, QKNormRoPEFusionPass)
    # a function of the source, not of the instance
    assert qk.uuid() == QKNormRoPEFusionPass().uuid()
    # the patterns are in it too
    assert qk.uuid() != QKNormRoPEFusionPass.hash_source(QKNormRoPEFusionPass)
