"""Tensor parallelism inside one process: the single-process defaults (no group: rank 0 of 1, no
collective in the graph), the sharding of every parallel layer (each rank's slice of the same
checkpoint, rebuilt here as "rank r of 2" without a process group), the TP-size checks, and the
by-value transport of a function. The multi-process runs are in test_launch.py."""

import contextlib
import math
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from minivllm_compile import CompilationConfig, CompilationMode
from minivllm_compile.distributed import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    by_value,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    parallel_state,
    tensor_model_parallel_all_reduce,
    tensor_parallel_disabled,
)
from minivllm_compile.models import ModelConfig, build_model, check_tensor_parallel_size, load_model
from minivllm_compile.models.loader import checkpoint_tensors, load_checkpoint_shards

# every test here compiles, or shares a module fixture that does: whole suite only
pytestmark = pytest.mark.compiles


@contextlib.contextmanager
def as_rank(rank: int, size: int):
    """Build layers as rank `rank` of `size` would, with no process group: the getters read the
    TP group's size and rank, and nothing here communicates."""
    old = parallel_state._TP
    # an all-reduce of one rank's view: the caller adds the ranks' outputs up itself
    parallel_state._TP = types.SimpleNamespace(world_size=size, rank_in_group=rank,
                                               all_reduce=lambda t: t)
    try:
        yield
    finally:
        parallel_state._TP = old


def test_one_process_is_rank_0_of_1_and_traces_no_collective():
    """No init_distributed_environment: rank 0 of 1, the all-reduce returns its input itself
    (vLLM's world_size == 1 bypass), and a traced model holds no all_reduce node."""
    assert (get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()) == (0, 1)
    x = torch.randn(3)
    assert tensor_model_parallel_all_reduce(x) is x
    lm = build_model("llama", num_layers=1, compilation_config=CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, backend="eager"))
    lm(torch.tensor([1, 2, 3]), torch.arange(3))
    targets = {str(n.target) for n in lm.model.backend.graphs[0].graph.nodes}
    assert not any("all_reduce" in t or "all_gather" in t for t in targets)
    assert any("unified_attention" in t for t in targets)  # (what would be there is)


def test_tp1_layers_are_the_torch_modules_they_replace():
    """At TP=1 each parallel layer is an nn.Linear / nn.Embedding of the whole weight, computing
    exactly what that module computes (so the models and their checkpoints are unchanged)."""
    torch.manual_seed(0)
    x = torch.randn(5, 12)
    for layer in (ColumnParallelLinear(12, 8, bias=True, return_bias=False),
                  MergedColumnParallelLinear(12, [8, 8], bias=False, return_bias=False),
                  QKVParallelLinear(12, 4, 3, 1, bias=False, return_bias=False),
                  RowParallelLinear(12, 8, bias=True, return_bias=False)):
        assert isinstance(layer, nn.Linear) and layer.weight.shape == (layer.output_size, 12)
        assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))
    emb = VocabParallelEmbedding(258, 6)
    assert emb.weight.shape == (258, 6)  # not padded to 320 in one process (vLLM pads it)
    ids = torch.tensor([0, 5, 257])
    assert torch.equal(emb(ids), emb.weight[ids])
    with pytest.raises(RuntimeError, match="sampler"):
        ParallelLMHead(258, 6)(ids)
    layer = ColumnParallelLinear(12, 8, skip_bias_add=True)  # vLLM's default: (output, bias)
    out, bias = layer(x)
    assert torch.equal(out, F.linear(x, layer.weight)) and bias is layer.bias


@pytest.fixture(scope="module")
def whole():
    """The trained tiny Llama, whole, and its checkpoint tensors."""
    lm = load_model("tiny-llama")
    return lm, checkpoint_tensors(lm.model, lm.lm_head, lm.config)


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def _shard(lm, tensors, rank, size):
    with as_rank(rank, size):
        from minivllm_compile.models import _make

        model, head = _make(lm.config, None, None, None)
        load_checkpoint_shards(model, head, lm.config, tensors, "test")
    return model, head


def test_checkpoint_tensors_round_trip(whole):
    """checkpoint_tensors is the inverse of the loader: reloading them gives the same model."""
    lm, tensors = whole
    model, head = _shard(lm, tensors, 0, 1)
    assert _same(model, lm.model)
    assert torch.equal(head.weight, lm.lm_head.weight)


def test_each_rank_loads_its_slice_of_the_same_checkpoint(whole):
    """tiny-llama (6 heads, 2 KV heads, head_dim 32, intermediate 512, vocab 258) at TP=2: every
    sharded parameter is the right slice, and the slices add up to the whole computation."""
    lm, tensors = whole
    ranks = [_shard(lm, tensors, r, 2) for r in range(2)]
    full = lm.model.layers[0]
    x = torch.randn(7, 192)
    q_all, k_all, v_all = F.linear(x, full.self_attn.qkv_proj.weight).split([192, 64, 64], dim=-1)
    h, g = torch.randn(7, 192), torch.randn(7, 512)  # inputs of o_proj and down_proj
    partial_o, partial_down = [], []
    for r, (model, head) in enumerate(ranks):
        layer = model.layers[0]
        attn = layer.self_attn
        assert (attn.num_heads, attn.num_kv_heads, attn.attn.num_heads) == (3, 1, 3)
        # column parallel: rank r's q heads [3r, 3r+3) and KV head r, side by side in one matmul
        q, k, v = F.linear(x, attn.qkv_proj.weight).split([96, 32, 32], dim=-1)
        torch.testing.assert_close(q, q_all[:, 96 * r:96 * (r + 1)], rtol=0, atol=1e-5)
        torch.testing.assert_close(k, k_all[:, 32 * r:32 * (r + 1)], rtol=0, atol=1e-5)
        torch.testing.assert_close(v, v_all[:, 32 * r:32 * (r + 1)], rtol=0, atol=1e-5)
        # merged gate/up: rank r's halves of gate and of up, [gate_r | up_r]
        gate_up = layer.mlp.gate_up_proj.weight
        assert gate_up.shape == (512, 192)
        assert torch.equal(gate_up[:256], full.mlp.gate_up_proj.weight[256 * r:256 * (r + 1)])
        assert torch.equal(gate_up[256:], full.mlp.gate_up_proj.weight[512 + 256 * r:][:256])
        # row parallel: rank r's input columns; the partial products sum to the whole
        partial_o.append(F.linear(h[:, 96 * r:96 * (r + 1)], attn.o_proj.weight))
        partial_down.append(F.linear(g[:, 256 * r:256 * (r + 1)], layer.mlp.down_proj.weight))
        # the vocabulary: 258 padded to 320, 160 ids per rank, the last rank's tail zero
        emb = model.embed_tokens.weight
        assert emb.shape == head.weight.shape == (160, 192)
        n = 160 if r == 0 else 98
        assert torch.equal(emb[:n], lm.model.embed_tokens.weight[160 * r:160 * r + n])
        assert torch.equal(head.weight[:n], lm.lm_head.weight[160 * r:160 * r + n])
        assert not emb[n:].any()
        # replicated: the norms
        assert torch.equal(layer.input_layernorm.weight, full.input_layernorm.weight)
    torch.testing.assert_close(sum(partial_o), F.linear(h, full.self_attn.o_proj.weight),
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sum(partial_down), F.linear(g, full.mlp.down_proj.weight),
                               rtol=1e-5, atol=1e-5)


def test_hybrid_conv_channels_are_sharded():
    """The short conv's in_proj (B, C, x stacked in the checkpoint), depthwise kernel and out_proj
    split by channel: rank r holds channels [48r, 48r+48) of a 96-wide hybrid."""
    whole_lm = build_model("hybrid", num_layers=2, seed=3)
    tensors = checkpoint_tensors(whole_lm.model, whole_lm.lm_head, whole_lm.config)
    conv = whole_lm.model.layers[0].conv
    for r in range(2):
        model, _ = _shard(whole_lm, tensors, r, 2)
        mine = model.layers[0].conv
        rows = slice(48 * r, 48 * (r + 1))
        assert torch.equal(mine.conv_weight, conv.conv_weight[rows])
        b, c, x = conv.in_proj.weight.chunk(3)
        assert torch.equal(mine.in_proj.weight, torch.cat([b[rows], c[rows], x[rows]]))
        assert torch.equal(mine.out_proj.weight, conv.out_proj.weight[:, rows])


def test_replicated_kv_heads_and_rank0_bias():
    """More ranks than KV heads: each KV head is loaded on tp / num_kv_heads ranks (vLLM's
    num_kv_head_replicas). RowParallelLinear adds its bias on rank 0 only, so the sum of the ranks'
    outputs (what the all-reduce computes) holds it once."""
    k_proj = torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(8, 3)  # 2 KV heads of size 4
    torch.manual_seed(0)
    whole = RowParallelLinear(8, 3, bias=True, return_bias=False)
    x = torch.randn(5, 8)
    outputs = []
    for r in range(4):
        with as_rank(r, 4):
            qkv = QKVParallelLinear(3, 4, total_num_heads=4, total_num_kv_heads=2, bias=False)
            row = RowParallelLinear(8, 3, bias=True, return_bias=False)
        assert (qkv.num_heads, qkv.num_kv_heads, qkv.num_kv_head_replicas) == (1, 1, 2)
        qkv.weight_loader(qkv.weight, k_proj, "k")
        assert torch.equal(qkv.weight[4:8], k_proj[4 * (r // 2):4 * (r // 2) + 4])
        row.weight_loader(row.weight, whole.weight.data)
        row.weight_loader(row.bias, whole.bias.data)
        with as_rank(r, 4):
            outputs.append(row(x[:, 2 * r:2 * r + 2]))
    torch.testing.assert_close(sum(outputs), whole(x), rtol=1e-6, atol=1e-6)


def test_a_layer_built_for_a_tp_size_it_cannot_take_names_the_dimension():
    with as_rank(0, 4), pytest.raises(ValueError, match="num_attention_heads=6 is not divisible "
                                                          "by the tensor-parallel size 4"):
        QKVParallelLinear(192, 32, 6, 2)
    with as_rank(0, 3), pytest.raises(ValueError, match="mlp.down_proj: input_size=512 is not"):
        RowParallelLinear(512, 192, prefix="mlp.down_proj")


@pytest.mark.parametrize("sizes, tp, message", [
    ({}, 4, "num_attention_heads=6 is not divisible by the tensor-parallel size 4"),
    ({}, 3, "intermediate_size=512 is not divisible by the tensor-parallel size 3"),
    ({"num_attention_heads": 6, "num_key_value_heads": 6, "intermediate_size": 96}, 3,
     r"vocab_size=258, padded to 320 .* not divisible by the tensor-parallel size 3"),
    ({"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96}, 8,
     "num_attention_heads=4"),
    ({"num_attention_heads": 6, "num_key_value_heads": 3, "intermediate_size": 96}, 2,
     "num_key_value_heads=3 and the tensor-parallel size 2"),
])
def test_a_tp_size_the_model_cannot_take_names_the_dimension(sizes, tp, message):
    cfg = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 258, "hidden_size": 192,
                                 "intermediate_size": 512, "num_hidden_layers": 1,
                                 "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32,
                                 **sizes})
    with pytest.raises(ValueError, match=message) as e:
        check_tensor_parallel_size(cfg, tp)
    assert "tensor-parallel sizes this model can take: [1" in str(e.value)


def test_fp8_and_hybrid_channels_are_checked_too():
    with pytest.raises(ValueError, match="FP8 checkpoints run on one rank"):
        check_tensor_parallel_size(load_model("tiny-llama-fp8").config, 2)
    hybrid = ModelConfig.from_dict({"model_type": "minivllm_hybrid", "vocab_size": 258,
                                    "hidden_size": 90, "intermediate_size": 96,
                                    "num_hidden_layers": 2, "num_attention_heads": 4,
                                    "head_dim": 16, "layer_types": ["conv", "full_attention"]})
    with pytest.raises(ValueError, match=r"hidden_size \(the short conv's channels\)=90 .* 4"):
        check_tensor_parallel_size(hybrid, 4)


def test_a_misshaped_checkpoint_tensor_is_named_on_every_rank(whole):
    lm, tensors = whole
    up = "model.layers.1.mlp.up_proj.weight"
    bad = {**tensors, up: tensors[up][:-2]}
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.up_proj.weight.*shape \(510, 192\), "
                                         r"expected \(512, 192\)"):
        _shard(lm, bad, 1, 2)
    del bad["model.norm.weight"]
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        _shard(lm, bad, 0, 2)


def test_build_model_inside_tp_disabled_is_the_single_process_model():
    with as_rank(1, 2), tensor_parallel_disabled():
        lm = build_model("llama", num_layers=1, seed=5)
    ref = build_model("llama", num_layers=1, seed=5)
    assert _same(lm.model, ref.model)


# --- sending a function to the ranks -----------------------------------------------------------

SCALE = 3


def _helper(x):
    return x * SCALE


def test_a_function_from_a_notebook_cell_travels_by_value():
    """A function the ranks cannot import (here a closure; a notebook cell's is in __main__) goes
    by value, with its globals (a module, a constant, another such function), defaults, closure,
    and recursion; an importable one goes by reference."""
    offset = 10

    def fact(n):
        return 1 if n <= 1 else n * fact(n - 1)

    def cell_fn(x, k=2):
        return math.floor(_helper(x) + offset + k) + fact(3) + helper2(1)

    helper2 = lambda v: v + 100  # noqa: E731  (a lambda is one of the kinds that must travel)
    sent = by_value.loads(by_value.dumps(cell_fn))
    assert sent is not cell_fn and sent(1.5) == cell_fn(1.5) == math.floor(4.5 + 12) + 6 + 101
    assert by_value.loads(by_value.dumps(_helper)) is _helper  # by reference

    class Local:
        pass

    def uses_class():
        return Local()

    with pytest.raises(TypeError, match="class 'Local'.*move the class into a module"):
        by_value.dumps(uses_class)
    lock = __import__("threading").Lock()

    def uses_lock():
        return lock

    with pytest.raises(TypeError, match="uses 'lock', a lock that cannot be sent"):
        by_value.dumps(uses_lock)
