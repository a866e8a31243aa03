"""`QKNormRoPEFusionPass`: per-head q/k RMSNorm + RoPE -> one `fused_qk_norm_rope` call
(vLLM's passes/fusion/qk_norm_rope_fusion.py).

A Qwen3/LFM2 attention normalises every q and k head before rotating it:

    q, k, v = qkv.split([q_size, kv_size, kv_size], -1)
    q = rms_norm(q.view(T, num_heads, head_dim)).view(q.shape)        # k alike, num_kv_heads
    q, k = rotary_embedding(positions, q, k, head_dim, cos_sin_cache, is_neox)

Three ops and two temporaries per layer; `fused_qk_norm_rope(qkv, ...)` does the same work in
place on qkv in one pass over it. The replacement is written functionally,
`auto_functionalized(fused_qk_norm_rope, qkv=qkv, ...)`, and split again; FixFunctionalization
(last in the pipeline) then makes it a direct in-place call.

The norms are matched as vLLM 0.34 matches them: the vLLM IR op `torch.ops.minivllm_ir.rms_norm`,
one node whatever provider the priority will lower it to (this pass runs before
VllmIRLoweringPass). RoPE comes in two forms: the custom op (`custom_ops` "all", an
`auto_functionalized` node) and its plain-torch form (`custom_ops` "none", RotaryEmbedding's
native path). Both are registered, so one pass serves any `custom_ops`. vLLM registers the one
form its config selects (matcher_utils' MatcherCustomOp traces forward_custom when the op is
enabled, forward_native otherwise), and since it cannot match RoPE's native form yet, turning this
fusion on adds "+rotary_embedding" to custom_ops (in CompilationConfig's __post_init__,
config/compilation.py).

The geometry (heads, kv heads, head_dim, eps, dtype) is burned into a pattern: the split sizes,
the per-head view, the eps constant, the casts. vLLM reads it from the model's Attention layers
through the VllmConfig. This pass is built from the CompilationConfig alone (by the backend, and
again for the cache key), so it reads the geometry from the graph it is given: every
`split_with_sizes` into [q, kv, kv] whose q part is viewed as [T, heads, head_dim] is a candidate
site, and each eps an RMSNorm in the graph uses is a candidate eps. The patterns for a new
geometry are registered on first sight and kept. A candidate that is not really this pattern
costs a registration and never matches: Inductor's check re-traces each match with its real
values (eps included) and compares. The uuid need not name the geometries (vLLM's does): they are
a function of the graph, which Inductor's cache key already holds.
"""

from __future__ import annotations

import logging
import operator
from dataclasses import dataclass

import torch
import torch._inductor.pattern_matcher as pm
from torch import fx
from torch._higher_order_ops.auto_functionalize import auto_functionalized
from torch._inductor.pattern_matcher import PatternMatcherPass

import minivllm_compile.ir.kernels  # noqa: F401  (the IR ops and their providers)
import minivllm_compile.ops  # noqa: F401  (registers torch.ops.minivllm.*)
from minivllm_compile.compilation.passes.fx_utils import is_func, rms_norm_ir
from minivllm_compile.compilation.passes.inductor_pass import enable_fake_mode
from minivllm_compile.compilation.passes.ir.utils import find_rms_norm_eps
from minivllm_compile.compilation.passes.utility.noop_elimination import NoOpEliminationPass
from minivllm_compile.compilation.passes.vllm_inductor_pass import (
    VllmInductorPass,
    VllmPatternMatcherPass,
)
from minivllm_compile.config import Range
from minivllm_compile.ir.op import enable_torch_wrap

logger = logging.getLogger(__name__)
aten = torch.ops.aten
minivllm = torch.ops.minivllm


@dataclass(frozen=True)
class QkNormRopeGeometry:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    eps: float
    dtype: torch.dtype  # of qkv; the norm weights and the cos/sin cache are taken to share it

    @property
    def sizes(self) -> list[int]:
        kv = self.num_kv_heads * self.head_dim
        return [self.num_heads * self.head_dim, kv, kv]


# --- RoPE's plain-torch form, as RotaryEmbedding traces with custom_ops "none" -------------------
# The core may not import models/, so this restates the native path of RotaryEmbedding
# (kernels/rotary_embedding.py's rotary_embedding_ref on copies) functionally. It must trace to
# the ops that does: tests/compilation/passes/test_qk_norm_rope_fusion.py fails if they drift.


def rotary_embedding_native(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                            head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool):
    # full rotary (rotary_dim == head_size), the only kind RotaryEmbedding builds: the reference's
    # write into heads[..., :rotary_dim] of a copy then overwrites it whole, and Inductor's
    # functionalization leaves just the rotated value
    cos, sin = cos_sin_cache.index_select(0, positions.flatten()).float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        heads = x.view(x.shape[0], x.shape[-1] // head_size, head_size).float()
        if is_neox:
            x1, x2 = heads.chunk(2, dim=-1)
        else:
            x1, x2 = heads[..., 0::2], heads[..., 1::2]
        o1, o2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        out = torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
        return out.to(x.dtype).view(x.shape)

    return rotate(query), rotate(key)


# --- RoPE's custom-op form, as functionalization leaves it ---------------------------------------

def rotary_embedding_custom(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                            head_size: int, cos_sin_cache: torch.Tensor, is_neox: bool):
    res = auto_functionalized(minivllm.rotary_embedding.default, positions=positions, query=query,
                              key=key, head_size=head_size, cos_sin_cache=cos_sin_cache,
                              is_neox=is_neox)
    return res[1], res[2]


def _normalise(gm: fx.GraphModule) -> None:
    """What the model's graph went through before this pass, done to the traced pattern too:
    Inductor's view -> reshape, then NoOpElimination (which folds the view back to
    [T, q_size] into the rotation's view to [T, heads, head_dim])."""
    from torch._inductor.fx_passes.post_grad import view_to_reshape

    view_to_reshape(gm)
    NoOpEliminationPass()(gm.graph)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def trace_fn(*args, **kwargs) -> fx.GraphModule:
    gm = pm.fwd_only(*args, **kwargs)
    _normalise(gm)
    return gm


class QkNormRopePattern:
    """One geometry, one is_neox, one form of RoPE: the unfused sequence and its fused
    replacement, registered into a PatternMatcherPass."""

    def __init__(self, geometry: QkNormRopeGeometry, is_neox: bool, custom_rope: bool):
        self.g, self.is_neox = geometry, is_neox
        self.rms_norm = rms_norm_ir
        self.rope = rotary_embedding_custom if custom_rope else rotary_embedding_native

    def get_inputs(self) -> list[torch.Tensor]:
        # any token count serves: sizes are ignored by the first match and checked afterwards
        g, t = self.g, 5
        return [torch.empty(t, sum(g.sizes), dtype=g.dtype),             # qkv
                torch.zeros(t, dtype=torch.int64),                       # positions
                torch.empty(g.head_dim, dtype=g.dtype),                  # q_norm weight
                torch.empty(g.head_dim, dtype=g.dtype),                  # k_norm weight
                torch.empty(16, g.head_dim, dtype=g.dtype)]              # cos_sin_cache

    def pattern(self, qkv, positions, q_weight, k_weight, cos_sin_cache):
        g = self.g
        try:
            q, k, v = qkv.split(g.sizes, dim=-1)
        except ValueError as e:  # the matcher takes a RuntimeError for "does not match"
            raise RuntimeError(str(e)) from e
        # what HybridAttention.forward (and vLLM's Qwen3Attention) writes
        q = self.rms_norm(q.view(*q.shape[:-1], q.shape[-1] // g.head_dim, g.head_dim), q_weight,
                          g.eps).view(q.shape)
        k = self.rms_norm(k.view(*k.shape[:-1], k.shape[-1] // g.head_dim, g.head_dim), k_weight,
                          g.eps).view(k.shape)
        q, k = self.rope(positions, q, k, g.head_dim, cos_sin_cache, self.is_neox)
        return q, k, v

    def replacement(self, qkv, positions, q_weight, k_weight, cos_sin_cache):
        g = self.g
        res = auto_functionalized(
            minivllm.fused_qk_norm_rope.default, qkv=qkv, num_heads_q=g.num_heads,
            num_heads_k=g.num_kv_heads, num_heads_v=g.num_kv_heads, head_dim=g.head_dim, eps=g.eps,
            q_weight=q_weight, k_weight=k_weight, cos_sin_cache=cos_sin_cache, is_neox=self.is_neox,
            position_ids=positions)
        return res[1].split(g.sizes, dim=-1)

    def register(self, pm_pass: PatternMatcherPass) -> None:
        # plain functions, not bound methods: the matcher reads the argument names off them
        def pattern(qkv, positions, q_weight, k_weight, cos_sin_cache):
            return self.pattern(qkv, positions, q_weight, k_weight, cos_sin_cache)

        def replacement(qkv, positions, q_weight, k_weight, cos_sin_cache):
            return self.replacement(qkv, positions, q_weight, k_weight, cos_sin_cache)

        pm.register_replacement(pattern, replacement, self.get_inputs(), trace_fn, pm_pass)


def find_geometries(graph: fx.Graph) -> set[QkNormRopeGeometry]:
    """Candidate sites: qkv split into [q, kv, kv] along its last dim whose q part is viewed per
    head, [T, heads, head_dim], with each RMSNorm eps the graph uses."""
    shapes = set()
    for split in graph.find_nodes(op="call_function", target=aten.split_with_sizes.default):
        qkv = split.args[0].meta.get("val") if isinstance(split.args[0], fx.Node) else None
        sizes, dim = split.args[1], split.args[2] if len(split.args) > 2 else 0
        if (qkv is None or qkv.dim() != 2 or dim not in (-1, 1) or len(sizes) != 3
                or sizes[1] != sizes[2]):
            continue
        q = next((u for u in split.users if is_func(u, operator.getitem) and u.args[1] == 0), None)
        for view in (q.users if q is not None else ()):
            shape = view.args[1] if view.target in (aten.reshape.default, aten.view.default) else ()
            if len(shape) == 3 and isinstance(shape[1], int) and isinstance(shape[2], int):
                heads, head_dim = shape[1], shape[2]
                if heads * head_dim == sizes[0] and sizes[1] % head_dim == 0:
                    shapes.add((heads, sizes[1] // head_dim, head_dim, qkv.dtype))
    eps = find_rms_norm_eps(graph) if shapes else set()
    return {QkNormRopeGeometry(h, kv, d, e, dt) for h, kv, d, dt in shapes for e in eps}


class QKNormRoPEFusionPass(VllmPatternMatcherPass):
    def __init__(self, pass_config=None, records=None):
        super().__init__(pass_config, records)
        self.patterns = PatternMatcherPass(pass_name="qk_norm_rope_fusion_pass")
        self.geometries: set[QkNormRopeGeometry] = set()  # those registered so far

    def is_applicable_for_range(self, compile_range: Range | None) -> bool:
        """Only ranges that end at or below qk_norm_rope_fusion_max_token_num (None: all)."""
        limit = self.pass_config.qk_norm_rope_fusion_max_token_num
        return limit is None or compile_range is None or compile_range.end <= limit

    @enable_fake_mode
    def register_patterns(self, geometry: QkNormRopeGeometry) -> None:
        # traced on fake example inputs (with the IR ops' torch wrap on, so the norm traces to
        # its one node)
        with torch.no_grad(), enable_torch_wrap(True):
            for is_neox in (True, False):
                for custom_rope in (True, False):
                    QkNormRopePattern(geometry, is_neox, custom_rope).register(self.patterns)
        self.geometries.add(geometry)
        logger.debug("QKNormRoPEFusionPass: registered patterns for %s", geometry)

    @VllmInductorPass.time_and_log
    def __call__(self, graph: fx.Graph) -> None:
        for geometry in find_geometries(graph) - self.geometries:
            self.register_patterns(geometry)
        self.record_matches(self.patterns.apply(graph))

    def uuid(self) -> str:
        # the class alone would miss the patterns and the helpers that trace them
        return VllmInductorPass.hash_source(
            self, QkNormRopePattern, QkNormRopeGeometry, rms_norm_ir, rotary_embedding_native,
            rotary_embedding_custom, _normalise, trace_fn, find_rms_norm_eps, find_geometries)
