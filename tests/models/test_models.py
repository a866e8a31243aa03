"""The models on the custom ops: cache correctness, batching, loading, and a compile-ready graph."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm_compile.models import build_model, load_model

ARCHS = ["llama", "hybrid"]


@pytest.fixture(scope="module", params=ARCHS)
def lm(request):
    return build_model(request.param, num_layers=2, seed=1)


def test_incremental_decode_matches_full_prefill(lm):
    """Prefill a prefix, then decode token by token through the caches: every step's logits equal
    those of one prefill over the whole sequence (KV cache and conv state are right)."""
    n, k = 23, 17
    ids = torch.randint(0, lm.config.vocab_size, (n,), generator=torch.Generator().manual_seed(0))
    full = lm(ids, torch.arange(n))
    table = lm.allocate_caches([n])
    md = lm.metadata([k], [k], [0], table)
    hidden = lm.forward_step(ids[:k], torch.arange(k), md)
    torch.testing.assert_close(lm.compute_logits(hidden), full[:k], atol=1e-4, rtol=1e-4)
    for t in range(k, n):
        md = lm.metadata([1], [t + 1], [0], table)
        hidden = lm.forward_step(ids[t : t + 1], torch.tensor([t]), md)
        torch.testing.assert_close(lm.compute_logits(hidden)[0], full[t], atol=1e-4, rtol=1e-4)


def test_batched_generate_equals_one_by_one(lm):
    """Prompts of different lengths batched together give each prompt's own greedy output: the
    steps run different numbers of tokens (prefill: the sum of prompt lengths; decode: one each)."""
    prompts = ["def main(", "x = 1\nprint(", "import o"]
    batched = lm.generate(prompts, max_new_tokens=6)
    assert batched == [lm.generate([p], max_new_tokens=6)[0] for p in prompts]


def test_sampling_is_seeded_and_differs_from_greedy(lm):
    a = lm.generate(["class A"], 12, temperature=1.5, seed=3)
    assert a == lm.generate(["class A"], 12, temperature=1.5, seed=3)
    assert a != lm.generate(["class A"], 12, temperature=0.0)


def test_bad_inputs_name_what_is_wrong(lm):
    with pytest.raises(ValueError, match="1-D"):
        lm(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 258\)"):
        lm(torch.tensor([999]), torch.tensor([0]))
    with pytest.raises(ValueError, match="positions must be an integer"):
        lm(torch.tensor([1]), torch.tensor([0.0]))
    with pytest.raises(TypeError, match="list of strings"):
        lm.generate("def", 3)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid"])
def test_checkpoint_missing_extra_or_misshaped_tensor_is_refused(name, tmp_path):
    lm = load_model(name)
    tensors = load_file(lm.checkpoint_dir / "model.safetensors")
    cfg = json.loads((lm.checkpoint_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    victim = "model.layers.1.mlp.up_proj.weight"

    def try_load(ts):
        save_file(ts, tmp_path / "model.safetensors")
        return load_model(tmp_path)

    assert try_load(dict(tensors)).config == lm.config  # unchanged copy loads
    with pytest.raises(ValueError, match=f"missing.*{victim}"):
        try_load({k: v for k, v in tensors.items() if k != victim})
    with pytest.raises(ValueError, match="unexpected.*model.layers.9.extra"):
        try_load({**tensors, "model.layers.9.extra": torch.zeros(2)})
    with pytest.raises(ValueError, match=f"{victim}.*shape"):
        try_load({**tensors, victim: tensors[victim][:, :-1].contiguous()})


def test_load_model_unknown_name():
    with pytest.raises(FileNotFoundError, match="tiny-llama"):
        load_model("no-such-model")


def test_decoder_traces_as_one_graph_with_auto_functionalized_ops():
    """What every later stage stands on: the decoder is one Dynamo graph (fullgraph=True, no graph
    break), its in-place ops appear as auto_functionalized after AOT functionalization, the norms
    as vLLM IR ops, and the opaque attention op stays a single node."""
    from torch._dynamo.backends.common import aot_autograd

    lm = build_model("llama", num_layers=2)
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    compiled = torch.compile(lm.model, fullgraph=True, backend=aot_autograd(fw_compiler=capture))
    ids = torch.randint(0, 258, (9,))
    table = lm.allocate_caches([9])
    md = lm.metadata([9], [9], [0], table)
    from minivllm_compile.forward_context import set_forward_context

    with torch.inference_mode(), set_forward_context(md, lm.model.static_forward_context):
        out = compiled(ids, torch.arange(9))
    ref = lm.forward_step(ids, torch.arange(9), lm.metadata([9], [9], [0], lm.allocate_caches([9])))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert len(graphs) == 1
    code = graphs[0].code
    assert "auto_functionalized" in code
    for op in ("rotary_embedding", "silu_and_mul"):
        assert f"minivllm.{op}" in code, op
    # the norms are vLLM IR ops (RMSNorm calls them, as vLLM 0.34's does): one node each
    for op in ("rms_norm", "fused_add_rms_norm"):
        assert f"minivllm_ir.{op}" in code and f"minivllm.{op}" not in code, op
    assert code.count("minivllm.unified_attention_with_output") == 2  # one per layer
