"""Per-step state the opaque splitting ops read, set around each forward
(vLLM's forward_context.py).

The compiled graph never sees the KV cache or the per-step metadata: the attention and short-conv
custom ops take only tensors that flow through the graph plus a `layer_name` string, and look the
rest up here at run time. That is what lets one graph serve every batch composition.

vLLM keeps the context in one module global: one engine steps one model per process. Here a
notebook may run two models from two threads, and their layers share names
("model.layers.0.self_attn.attn"), so one global would let one thread's attention read the other
model's KV cache and metadata. The context is kept per thread instead (threading.local): each
thread sees only what it set itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """What one step's batch looks like. Tokens of all sequences are packed along one dimension.

    query_start_loc: int32 [num_seqs + 1], where each sequence's new tokens start in the batch.
    seq_lens: int32 [num_seqs], each sequence's length including the tokens of this step.
    slot_mapping: int64 [num_tokens], the KV-cache slot (block * block_size + offset) of each token.
    block_table: int32 [num_seqs, max_blocks], the cache blocks of each sequence, in order.
    state_indices: int32 [num_seqs], each sequence's line in the conv-state cache (hybrid models).
    """

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    state_indices: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # the real tokens when the batch is padded to a CUDA-graph size (vLLM's num_actual_tokens);
    # the padded ones sit after them, with slot PAD_SLOT_ID (-1) and in no sequence
    num_actual_tokens: int | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_real_tokens(self) -> int:
        return self.num_tokens if self.num_actual_tokens is None else self.num_actual_tokens

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def context_lens(self) -> torch.Tensor:
        """Tokens each sequence already has in the cache before this step."""
        return self.seq_lens - self.query_lens

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1 and bool((self.context_lens > 0).all())


@dataclass
class ForwardContext:
    # layer_name -> the module that owns that layer's cache (vLLM: static_forward_context)
    no_compile_layers: dict[str, Any] = field(default_factory=dict)
    # None during a dummy run (vLLM's profile run): the splitting ops then write zeros
    attn_metadata: AttentionMetadata | None = None
    # what the CUDA-graph wrappers read this step (vLLM's names): the mode the dispatcher picked
    # and the padded batch's key; the wrappers trust them blindly
    cudagraph_runtime_mode: Any = None  # config.CUDAGraphMode; None is NONE
    batch_descriptor: Any = None  # cuda_graph.BatchDescriptor


class _ThreadState(threading.local):
    context: ForwardContext | None = None  # the class default: every new thread starts with none


_state = _ThreadState()


def is_forward_context_available() -> bool:
    return _state.context is not None


def get_forward_context() -> ForwardContext:
    ctx = _state.context
    if ctx is None:
        raise RuntimeError(
            "no forward context is set in this thread: call the model through lm(...) / "
            "lm.generate(...), or wrap the call in `with set_forward_context(attn_metadata, "
            "model.static_forward_context):` (a context set in another thread is not seen here)"
        )
    return ctx


@contextmanager
def set_forward_context(
    attn_metadata: AttentionMetadata | None, no_compile_layers: dict[str, Any],
    cudagraph_runtime_mode: Any = None, batch_descriptor: Any = None,
) -> Iterator[ForwardContext]:
    prev = _state.context
    ctx = _state.context = ForwardContext(
        no_compile_layers=no_compile_layers, attn_metadata=attn_metadata,
        cudagraph_runtime_mode=cudagraph_runtime_mode, batch_descriptor=batch_descriptor)
    try:
        yield ctx
    finally:
        _state.context = prev
