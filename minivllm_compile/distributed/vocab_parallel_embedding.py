"""The vocabulary-parallel embedding and LM head, and the logits gathered from them (vLLM's
model_executor/layers/vocab_parallel_embedding.py and logits_processor.py, without LoRA's added
vocabulary).

Rank r holds the rows of token ids [r * V/tp, (r+1) * V/tp). The embedding looks up the ids it
holds, writes zeros for the others, and all-reduces: each id has exactly one owner, so the sum is
its row. The LM head multiplies by the same kind of shard, so each rank computes the logits of its
ids; LogitsProcessor all-gathers them into the whole vocabulary on every rank (each rank samples).

vLLM pads the vocabulary to a multiple of 64 first, so that any power-of-two TP divides it, and
cuts the padded logits off after the gather. It pads at every TP size; here a single process keeps
the checkpoint's exact shape (258 rows, not 320), so its graphs, cache keys and printed shapes are
what they were before the layers were parallel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from minivllm_compile.distributed.communication_op import (
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)
from minivllm_compile.distributed.parallel_state import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from minivllm_compile.distributed.utils import check_shape, set_weight_attrs

DEFAULT_VOCAB_PADDING_SIZE = 64


def pad_vocab_size(vocab_size: int, pad_to: int = DEFAULT_VOCAB_PADDING_SIZE) -> int:
    return ((vocab_size + pad_to - 1) // pad_to) * pad_to


class VocabParallelEmbedding(nn.Embedding):
    """An nn.Embedding of this rank's rows; at TP=1, nn.Embedding itself."""

    # per rank, so left out of the cache key (as LinearBase's)
    _rank_dependent_attrs = ("tp_rank", "vocab_start_index", "vocab_end_index")

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 params_dtype: torch.dtype | None = None,
                 padding_size: int = DEFAULT_VOCAB_PADDING_SIZE, prefix: str = "", *,
                 disable_tp: bool = False, reduce_results: bool = True):
        self.tp_rank, self.tp_size = (0, 1) if disable_tp else (
            get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size())
        self.org_vocab_size, self.reduce_results = num_embeddings, reduce_results
        padded = (num_embeddings if self.tp_size == 1
                  else pad_vocab_size(num_embeddings, padding_size))
        self.num_embeddings_padded = padded
        if padded % self.tp_size:
            raise ValueError(f"vocab_size={num_embeddings}, padded to {padded} (a multiple of "
                             f"{padding_size}), is not divisible by the tensor-parallel size "
                             f"{self.tp_size}: every rank must hold an equal share of the "
                             "vocabulary")
        self.num_embeddings_per_partition = padded // self.tp_size
        # the ids this rank owns; the last rank's rows past the real vocabulary are padding
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition,
                                   num_embeddings)
        self.prefix = prefix
        super().__init__(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype)
        set_weight_attrs(self.weight, {"weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        check_shape(f"{self.prefix}: weight" if self.prefix else "weight", loaded_weight,
                    (self.org_vocab_size, self.embedding_dim))
        n = self.vocab_end_index - self.vocab_start_index
        param.data[:n].copy_(loaded_weight[self.vocab_start_index:self.vocab_end_index])
        param.data[n:].zero_()

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(input_)
        # ids this rank does not own look up row 0 and are zeroed after (vLLM's masked input)
        mask = (input_ >= self.vocab_start_index) & (input_ < self.vocab_end_index)
        output = F.embedding((input_ - self.vocab_start_index) * mask, self.weight)
        output = output.masked_fill(~mask.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(output) if self.reduce_results else output

    def extra_repr(self) -> str:
        return (f"num_embeddings={self.org_vocab_size}, num_embeddings_per_partition="
                f"{self.num_embeddings_per_partition}, embedding_dim={self.embedding_dim}, "
                f"num_embeddings_padded={self.num_embeddings_padded}, tp_size={self.tp_size}")


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head's weight, sharded as the embedding's: LogitsProcessor multiplies by it."""

    def reset_parameters(self) -> None:
        # Initialised as the nn.Linear that was the LM head before, so that build_model's seeded
        # weights (it draws from the same generator after construction) are unchanged at TP=1.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, input_):
        raise RuntimeError("LMHead's weights should be used in the sampler.")  # vLLM's words


class LogitsProcessor(nn.Module):
    """Hidden states -> logits over the whole vocabulary, on every rank (vLLM gathers with
    all_gather on every platform but a few, so that each rank can sample)."""

    def __init__(self, vocab_size: int, org_vocab_size: int | None = None, scale: float = 1.0):
        super().__init__()
        self.vocab_size, self.scale = vocab_size, scale
        self.org_vocab_size = org_vocab_size or vocab_size

    def forward(self, lm_head: VocabParallelEmbedding, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, lm_head.weight)
        if getattr(lm_head, "tp_size", 1) > 1:  # (an nn.Linear head is one rank's whole head)
            logits = tensor_model_parallel_all_gather(logits)
        if logits.shape[-1] != self.org_vocab_size:  # the padding rows' logits
            logits = logits[..., :self.org_vocab_size]
        if self.scale != 1.0:
            logits = logits * self.scale
        return logits
