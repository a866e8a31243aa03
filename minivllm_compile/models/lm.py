"""`LM`: a decoder, its lm_head and tokenizer, the caches, and generate() (a tiny engine step loop).

Each step packs the new tokens of every running sequence into one 1-D batch, builds the metadata the
opaque ops read (forward_context.py) and calls the decoder once. Prefill and decode steps differ in
their number of tokens, which is exactly what a compiled model must absorb without recompiling.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from pathlib import Path

import torch
from torch import nn

from minivllm_compile import envs
from minivllm_compile.compilation.cuda_graph import (
    CudagraphDispatcher,
    CUDAGraphWrapper,
    min_cudagraph_support,
)
from minivllm_compile.compilation.monitor import set_cudagraph_capturing_enabled
from minivllm_compile.compilation.wrapper import compile_model_with_stock_torch
from minivllm_compile.config import CompilationMode, CUDAGraphMode
from minivllm_compile.distributed import LogitsProcessor
from minivllm_compile.forward_context import AttentionMetadata, set_forward_context
from minivllm_compile.models.config import ModelConfig
from minivllm_compile.models.inputs import check_generate_args, check_prefill_inputs
from minivllm_compile.models.layers import Attention, ShortConv
from minivllm_compile.models.tokenizer import ByteTokenizer

BLOCK_SIZE = 16

# What two LMs in two threads must still do one at a time: a call through Dynamo's frame
# evaluation (the bytecode hook off, or STOCK_TORCH_COMPILE) patches Dynamo's process-wide config
# for its length, and CUDA-graph capture turns a process-wide switch on and off. A compiled call
# with the hook on, or an AOT-loaded one, runs a function of its model's own (wrapper.py) and goes
# side by side with others; so do eager calls, their only shared state, the forward context,
# being per thread. (First calls, which compile, take turns in the decorator.)
_PROCESS_WIDE = threading.RLock()


def _one_call_at_a_time(method):
    """One LM serves one call at a time, whichever thread makes it: its caches (KV blocks, conv
    state) live on its layers, and two calls at once would overwrite each other's."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return locked


class LM:
    def __init__(self, model: nn.Module, lm_head: nn.Module, cfg: ModelConfig,
                 checkpoint_dir: Path | None = None):
        self.model, self.lm_head, self.config = model, lm_head, cfg
        # the LM head's matmul, and under TP the gather of every rank's share of the vocabulary
        self.logits_processor = LogitsProcessor(cfg.vocab_size)
        self.tokenizer = ByteTokenizer()
        self.checkpoint_dir = checkpoint_dir
        if cfg.vocab_size < self.tokenizer.vocab_size:
            where = f"{checkpoint_dir / 'config.json'}: " if checkpoint_dir is not None else ""
            raise ValueError(
                f"{where}vocab_size={cfg.vocab_size} is smaller than the byte tokenizer's "
                f"{self.tokenizer.vocab_size} ids (bytes 0-255, BOS 256, EOS 257): generate() "
                f"would feed the model ids its embedding does not have. Use vocab_size >= "
                f"{self.tokenizer.vocab_size}.")
        # STOCK_TORCH_COMPILE is the model runner's job in vLLM: plain torch.compile of the model
        cc = getattr(model, "compilation_config", None)
        self._run_model = model
        if cc is not None and cc.mode == CompilationMode.STOCK_TORCH_COMPILE:
            self._run_model = compile_model_with_stock_torch(model, cc)
        # CUDA graphs are the model runner's job in vLLM: resolved, dispatched and captured here
        self.cudagraph_dispatcher: CudagraphDispatcher | None = None
        self._cudagraphs_ready = cc is None or cc.cudagraph_mode == CUDAGraphMode.NONE
        self._dynamo_evaluated = cc is not None and cc.mode == CompilationMode.STOCK_TORCH_COMPILE
        self._compiled = getattr(model, "do_not_compile", True) is False
        self._lock = threading.RLock()

    @property
    def _call_lock(self) -> contextlib.AbstractContextManager:
        """The process-wide lock for a call that goes through Dynamo's frame evaluation."""
        through_dynamo = self._dynamo_evaluated or (
            self._compiled and getattr(self.model, "aot_compiled_fn", None) is None
            and not envs.VLLM_USE_BYTECODE_HOOK)
        return _PROCESS_WIDE if through_dynamo else contextlib.nullcontext()

    def _init_cudagraphs(self) -> None:
        """Before the first compile: resolve the mode down to what the splitting ops support (the
        pieces are wrapped while they compile), build the dispatcher, wrap the forward for FULL."""
        cc = self.model.compilation_config
        support, name = min_cudagraph_support(self.model.static_forward_context.values(),
                                              self.device)
        cc.resolve_cudagraph_mode(support, name)
        self.cudagraph_dispatcher = CudagraphDispatcher(cc)
        if cc.cudagraph_mode.has_full_cudagraphs():
            self._run_model = CUDAGraphWrapper(self._run_model, cc, CUDAGraphMode.FULL)
        # persistent inputs, as vLLM's model runner keeps: a graph reads the
        # buffers it was captured on
        n = max(cc.max_num_batched_tokens, cc.max_cudagraph_capture_size)
        self._input_ids = torch.zeros(n, dtype=torch.long, device=self.device)
        self._positions = torch.zeros(n, dtype=torch.long, device=self.device)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    # --- caches -------------------------------------------------------------------------------

    def allocate_caches(self, max_seq_lens: list[int]) -> torch.Tensor:
        """Fresh KV blocks and conv-state lines for a batch; returns the
        block table [seqs, blocks]."""
        blocks_per_seq = [(n + BLOCK_SIZE - 1) // BLOCK_SIZE for n in max_seq_lens]
        width = max(blocks_per_seq)
        table = torch.zeros(len(max_seq_lens), width, dtype=torch.int32)
        start = 0
        for i, n in enumerate(blocks_per_seq):
            table[i, :n] = torch.arange(start, start + n, dtype=torch.int32)
            start += n
        for layer in self.model.static_forward_context.values():
            if isinstance(layer, Attention):
                layer.kv_cache = torch.zeros(2, start, BLOCK_SIZE, layer.num_kv_heads,
                                             layer.head_size,
                                             dtype=self.dtype, device=self.device)
            elif isinstance(layer, ShortConv):
                dim, width_ = layer.conv_weight.shape
                layer.conv_state = torch.zeros(len(max_seq_lens), dim, width_ - 1,
                                               dtype=self.dtype, device=self.device)
        return table.to(self.device)

    def metadata(self, query_lens: list[int], seq_lens: list[int], seq_ids: list[int],
                 block_table: torch.Tensor) -> AttentionMetadata:
        """Metadata for one step: sequence seq_ids[i] adds query_lens[i]
        tokens, reaching seq_lens[i]."""
        dev = self.device
        slots = []
        host_table = block_table.cpu()  # once per step (per sequence it would sync a GPU each time)
        for q, s, sid in zip(query_lens, seq_lens, seq_ids):
            pos = torch.arange(s - q, s)
            slots.append(host_table[sid][pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE)
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
        qsl[1:] = torch.tensor(query_lens).cumsum(0)
        return AttentionMetadata(
            query_start_loc=qsl.to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            slot_mapping=torch.cat(slots).to(dev),
            block_table=block_table[seq_ids],
            state_indices=torch.tensor(seq_ids, dtype=torch.int32, device=dev),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens))

    # --- forward ------------------------------------------------------------------------------

    @_one_call_at_a_time
    def forward_step(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     attn_metadata: AttentionMetadata | None) -> torch.Tensor:
        """One call of the decoder inside its forward context; returns hidden states."""
        if getattr(self.model, "compiled", True) is False or not self._cudagraphs_ready:
            self.warmup()
        n = input_ids.shape[0]
        mode, desc = CUDAGraphMode.NONE, None
        if self.cudagraph_dispatcher is not None:
            uniform = attn_metadata is not None and attn_metadata.is_decode_only
            mode, desc = self.cudagraph_dispatcher.dispatch(n, uniform_decode=uniform)
        if mode != CUDAGraphMode.NONE:
            input_ids, positions, attn_metadata = self._pad(input_ids, positions, attn_metadata,
                                                            desc.num_tokens)
        with self._call_lock, torch.inference_mode(), set_forward_context(
                attn_metadata, self.model.static_forward_context, mode, desc):
            return self._run_model(input_ids, positions)[:n]

    def _pad(self, input_ids, positions, md, num_padded: int):
        """The step in the persistent buffers, padded as vLLM's model runner pads: token id 0 and
        position 0 after the real tokens, slot PAD_SLOT_ID (-1) so that no cache slot is written,
        and the metadata's sequences covering the real tokens only."""
        n = input_ids.shape[0]
        ids, pos = self._input_ids[:num_padded], self._positions[:num_padded]
        with torch.inference_mode():
            ids[:n], pos[:n] = input_ids, positions
            ids[n:], pos[n:] = 0, 0
        if md is not None:
            pad = torch.full((num_padded - n,), -1, dtype=md.slot_mapping.dtype,
                             device=md.slot_mapping.device)
            md = dataclasses.replace(md, slot_mapping=torch.cat([md.slot_mapping, pad]),
                                     num_actual_tokens=n)
        return ids, pos, md

    @_one_call_at_a_time
    def warmup(self, num_tokens: int | None = None) -> None:
        """Compile now, as vLLM does before serving: one dummy run at max_num_batched_tokens with no
        attention metadata (the splitting ops then write zeros), so the trace never sees a size
        Dynamo would specialise (0 or 1) and no request waits for a compile."""
        n = num_tokens or min(self.model.compilation_config.max_num_batched_tokens,
                              self.config.max_position_embeddings)
        ids = torch.zeros(n, dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device)
        if not self._cudagraphs_ready:
            self._init_cudagraphs()
        with _PROCESS_WIDE, torch.inference_mode(), set_forward_context(
                None, self.model.static_forward_context):
            self._run_model(ids, pos)
        if not self._cudagraphs_ready:
            self.capture_model()

    @_one_call_at_a_time
    def capture_model(self) -> None:
        """Capture every graph now, after the warm-up compile (vLLM's capture_model): largest size
        first, each after one plain run at its size (vLLM's cudagraph_num_of_warmups=1), with dummy
        inputs and no attention metadata. generate() never captures: the wrappers refuse it."""
        with _PROCESS_WIDE:  # the capture switch is process-wide: one LM captures at a time
            set_cudagraph_capturing_enabled(True)  # as vLLM 0.33's model runner, around its capture
            try:
                with torch.inference_mode():
                    for mode, descs in self.cudagraph_dispatcher.get_capture_descs():
                        for desc in descs:
                            n = desc.num_tokens
                            ids, pos = self._input_ids[:n], self._positions[:n]
                            ids.zero_(), pos.zero_()
                            for m in (CUDAGraphMode.NONE, mode):
                                ctx = self.model.static_forward_context
                                with set_forward_context(None, ctx, m, desc):
                                    self._run_model(ids, pos)
            finally:
                set_cudagraph_capturing_enabled(False)
        self._cudagraphs_ready = True

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self.logits_processor(self.lm_head, hidden_states)

    @_one_call_at_a_time
    def __call__(self, input_ids: torch.Tensor | list[int],
                 positions: torch.Tensor | list[int]) -> torch.Tensor:
        """One prefill of one new sequence: logits [num_tokens, vocab] for every token. The ids and
        positions are 1-D tensors of any integer dtype, or lists of ints."""
        input_ids, positions = check_prefill_inputs(input_ids, positions, self.config, self.device)
        n = input_ids.shape[0]
        # the tokens fill cache slots 0..n-1 in order; `positions` only feeds RoPE
        md = self.metadata([n], [n], [0], self.allocate_caches([n]))
        return self.compute_logits(self.forward_step(input_ids, positions, md))

    # --- generation ---------------------------------------------------------------------------

    @_one_call_at_a_time
    def generate(self, prompts: list[str], max_new_tokens: int, temperature: float = 0.0,
                 seed: int = 0) -> list[str]:
        """KV-cached prefill of all prompts in one step, then one decode step per new token.
        Returns each prompt's continuation (greedy at temperature 0, sampled otherwise)."""
        prompts, max_new_tokens, temperature, seed = check_generate_args(
            prompts, max_new_tokens, temperature, seed)
        if not prompts:
            return []
        tok = self.tokenizer
        outputs = self.generate_ids([tok.encode(p) for p in prompts], max_new_tokens, temperature,
                                    seed)
        return [tok.decode(o) for o in outputs]

    @_one_call_at_a_time
    def generate_ids(self, prompts: list[list[int]], max_new_tokens: int,
                     temperature: float = 0.0, seed: int = 0) -> list[list[int]]:
        """generate() on token ids: each prompt's continuation as ids (stopping after EOS), with
        nothing lost to UTF-8 decoding. The prompts are lists of ids inside the vocabulary."""
        cfg = self.config
        seqs = [list(s) for s in prompts]
        if not seqs:
            return []
        if min(len(s) for s in seqs) < 1:
            raise ValueError("every prompt needs at least one token id")
        limit = cfg.max_position_embeddings
        if max(len(s) for s in seqs) + max_new_tokens > limit:
            raise ValueError(f"prompt plus max_new_tokens exceeds max_position_embeddings={limit}")
        table = self.allocate_caches([len(s) + max_new_tokens for s in seqs])
        gen = torch.Generator().manual_seed(seed)
        outputs: list[list[int]] = [[] for _ in seqs]
        running = list(range(len(seqs)))
        query_lens = [len(s) for s in seqs]  # first step: the whole prompt of every sequence
        while running:
            ids = torch.tensor([t for i, q in zip(running, query_lens) for t in seqs[i][-q:]],
                               device=self.device)
            pos = torch.cat([torch.arange(len(seqs[i]) - q, len(seqs[i]))
                             for i, q in zip(running, query_lens)])
            md = self.metadata(query_lens, [len(seqs[i]) for i in running], running, table)
            hidden = self.forward_step(ids, pos.to(self.device), md)
            last = md.query_start_loc[1:].long() - 1  # logits only where a token is sampled
            next_ids = self._sample(self.compute_logits(hidden[last]).float(), temperature, gen)
            still = []
            for i, t in zip(running, next_ids.tolist()):
                seqs[i].append(t)
                outputs[i].append(t)
                if t != cfg.eos_token_id and len(outputs[i]) < max_new_tokens:
                    still.append(i)
            running, query_lens = still, [1] * len(still)
        return outputs

    @staticmethod
    def _sample(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
        if temperature == 0:
            return logits.argmax(-1)
        probs = torch.softmax(logits.cpu() / temperature, dim=-1)
        return torch.multinomial(probs, 1, generator=gen).squeeze(-1)
