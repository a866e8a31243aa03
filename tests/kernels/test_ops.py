"""The custom ops: what they declare to torch, the opaque attention op's math, clear errors."""

import pytest
import torch
import torch.nn.functional as F

import minivllm_compile.ops  # noqa: F401
from minivllm_compile.forward_context import set_forward_context
from minivllm_compile.models import build_model

ops = torch.ops.minivllm

# argument names marked mutable (Tensor(a!)) in each schema, as in vLLM's _C / vllm ops
MUTATES = {
    "rms_norm": {"out"},
    "fused_add_rms_norm": {"input", "residual"},
    "rotary_embedding": {"query", "key"},
    "fused_qk_norm_rope": {"qkv"},
    "silu_and_mul": {"out"},
    "unified_attention_with_output": {"output"},
    "short_conv": {"output"},
}


@pytest.mark.parametrize("name", sorted(MUTATES))
def test_schema_declares_in_place_arguments(name):
    schema = getattr(ops, name).default._schema
    mutated = {a.name for a in schema.arguments if a.alias_info is not None
               and a.alias_info.is_write}
    assert mutated == MUTATES[name]
    assert len(schema.returns) == 0  # like vLLM's in-place ops: results live in the mutated inputs


def test_errors_name_the_argument():
    x, w = torch.randn(4, 96), torch.ones(96)
    with pytest.raises(ValueError, match="`out` has shape"):
        ops.rms_norm(torch.empty(3, 96), x, w, 1e-6)
    with pytest.raises(ValueError, match="`weight` has shape"):
        ops.rms_norm(torch.empty_like(x), x, torch.ones(95), 1e-6)
    with pytest.raises(ValueError, match="`residual` is torch.float64"):
        ops.fused_add_rms_norm(x, x.double(), w, 1e-6)
    with pytest.raises(ValueError, match="`out` has shape"):
        ops.silu_and_mul(torch.empty(4, 96), x)
    with pytest.raises(ValueError, match="`positions` has 3 entries"):
        ops.rotary_embedding(torch.arange(3), torch.randn(4, 64), torch.randn(4, 32), 32,
                             torch.randn(16, 32), True)
    with pytest.raises(ValueError, match="`qkv` has shape"):
        ops.fused_qk_norm_rope(torch.randn(4, 100), 2, 1, 1, 32, 1e-6, torch.ones(32),
                               torch.ones(32),
                               torch.randn(16, 32), True, torch.arange(4))


def test_mixer_op_outside_a_forward_context_says_how_to_fix():
    q = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="set_forward_context"):
        ops.unified_attention_with_output(q, q, q, torch.empty_like(q),
                                          "model.layers.0.self_attn.attn")


def naive_attention(q, k, v, scale):
    """Full causal attention over one sequence, GQA by repeating kv heads: [T, H, D] each."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("thd,shd->hts", q, k) * scale
    s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v)


def test_attention_op_varlen_prefill_then_decode_matches_naive():
    lm = build_model("llama", num_layers=1)
    layer = lm.model.static_forward_context["model.layers.0.self_attn.attn"]
    H, KV, D = layer.num_heads, layer.num_kv_heads, layer.head_size
    lens = [5, 1, 19]  # uneven; 19 crosses a 16-token block
    total = [n + 2 for n in lens]
    g = torch.Generator().manual_seed(0)
    qs = [torch.randn(n, H, D, generator=g) for n in total]
    ks = [torch.randn(n, KV, D, generator=g) for n in total]
    vs = [torch.randn(n, KV, D, generator=g) for n in total]
    table = lm.allocate_caches(total)

    def step(q_lens, seq_lens, pieces):
        md = lm.metadata(q_lens, seq_lens, [0, 1, 2], table)
        q, k, v = (torch.cat(p).flatten(1) for p in pieces)
        out = torch.empty_like(q)
        with set_forward_context(md, lm.model.static_forward_context):
            ops.unified_attention_with_output(q, k, v, out, layer.layer_name)
        return out.view(-1, H, D)

    out = step(lens, lens, [[x[:n] for x, n in zip(t, lens)] for t in (qs, ks, vs)])
    want = torch.cat([naive_attention(q[:n], k[:n], v[:n], layer.scale)
                      for q, k, v, n in zip(qs, ks, vs, lens)])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    for extra in (1, 2):  # two decode steps: one new token each, attending to the whole cache
        seq_lens = [n + extra for n in lens]
        out = step([1, 1, 1], seq_lens, [[x[s - 1 : s] for x, s in zip(t, seq_lens)]
                                         for t in (qs, ks, vs)])
        want = torch.stack([naive_attention(q[:s], k[:s], v[:s], layer.scale)[-1]
                            for q, k, v, s in zip(qs, ks, vs, seq_lens)])
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_short_conv_op_matches_a_plain_conv1d():
    lm = build_model("hybrid", num_layers=1)
    layer = lm.model.static_forward_context["model.layers.0.conv"]
    dim, width = layer.conv_weight.shape
    h = torch.randn(11, dim)
    md = lm.metadata([11], [11], [0], lm.allocate_caches([11]))
    out = torch.empty_like(h)
    with torch.no_grad(), set_forward_context(md, lm.model.static_forward_context):
        ops.short_conv(h, out, layer.layer_name)
        b, c, x = F.linear(h, layer.in_proj.weight).chunk(3, -1)
        y = F.conv1d((b * x).T.unsqueeze(0), layer.conv_weight.unsqueeze(1), padding=width - 1,
                     groups=dim)[0, :, :11].T
        want = F.linear(c * y, layer.out_proj.weight)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    # the state keeps the last width-1 inputs of the conv, for the next decode step
    torch.testing.assert_close(layer.conv_state[0], (b * x)[-(width - 1):].T)


# --- registration: vLLM's direct_register_custom_op, no autograd kernel of
# our own -----------------

@pytest.mark.parametrize("kind", ["llama", "hybrid"])
def test_eager_decoder_runs_with_grad_enabled(kind):
    """With grad on, RoPE writes in place into q and k split from one qkv tensor: through
    torch.library.custom_op's autograd wrapper that raised "Output 0 of SplitWithSizes is a view
    and ... modified inplace". Registered as vLLM registers its ops, the model runs, and computes
    what it computes under inference mode."""
    lm = build_model(kind, num_layers=2)
    model = lm.model
    for p in model.parameters():
        p.requires_grad_(True)
    ids, pos = torch.arange(1, 7), torch.arange(6)

    def forward():
        # fresh caches: the same prefill twice
        md = lm.metadata([6], [6], [0], lm.allocate_caches([6]))
        with set_forward_context(md, model.static_forward_context):
            return model(ids, pos)

    with torch.enable_grad():
        with_grad = forward()
    with torch.inference_mode():
        inference = forward()
    # autograd did run: it recorded the torch ops around the custom ops
    assert with_grad.requires_grad
    assert torch.equal(with_grad, inference)


def test_rotary_embedding_in_place_on_split_views_that_require_grad():
    head_size, rot = 32, 16
    cache = torch.randn(16, rot)
    positions = torch.tensor([3, 0, 7, 1, 15])
    base = torch.randn(5, 4 * head_size)
    # a non-leaf requiring grad, as a linear's output
    qkv = base.clone().requires_grad_(True).clone()
    q, k, _ = qkv.split([2 * head_size, head_size, head_size], dim=-1)
    ops.rotary_embedding(positions, q, k, head_size, cache, True)
    # used again by autograd, as attention uses them next: with custom_op's autograd wrapper this
    # raised "Output 0 of SplitWithSizes is a view and its base ... has been modified inplace"
    assert (q * 2).requires_grad and (k * 2).requires_grad

    with torch.no_grad():
        q_want, k_want, v_want = base.clone().split([2 * head_size, head_size, head_size], dim=-1)
        ops.rotary_embedding(positions, q_want, k_want, head_size, cache, True)
    assert torch.equal(q, q_want) and torch.equal(k, k_want)  # rotated in place, through the views
    assert torch.equal(qkv[:, 3 * head_size:], v_want)  # v untouched
    assert not torch.equal(q_want, base[:, : 2 * head_size])  # (and the op did rotate something)


@pytest.mark.parametrize("name", sorted(MUTATES))
def test_registered_without_an_autograd_kernel(name):
    # vLLM's direct_register_custom_op: a kernel for the backend keys and a fake, nothing at the
    # Autograd or ADInplaceOrView keys (the dispatcher's fallbacks run there, as for vLLM's _C ops)
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    qualname = f"minivllm::{name}"
    # Meta: the fake
    assert has(qualname, "CPU") and has(qualname, "CUDA") and has(qualname, "Meta")
    assert not has(qualname, "Autograd") and not has(qualname, "ADInplaceOrView")


def test_custom_op_would_have_registered_an_autograd_kernel():
    # what torch.library.custom_op registers, for comparison: its autograd wrapper and the kernel
    # bumping version counters, which are what tripped over the split views above
    @torch.library.custom_op("minivllm_test::scale_", mutates_args=["x"])
    def scale_(x: torch.Tensor) -> None:
        x.mul_(2)

    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has("minivllm_test::scale_", "Autograd") and has("minivllm_test::scale_",
                                                            "ADInplaceOrView")
