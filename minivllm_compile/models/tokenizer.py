"""A byte-level tokenizer: every UTF-8 byte is a token, plus BOS and EOS. Nothing to download."""

from __future__ import annotations

import torch

BOS_TOKEN_ID = 256
EOS_TOKEN_ID = 257
VOCAB_SIZE = 258  # deliberately not a power of two: the kernels must not assume one


class ByteTokenizer:
    bos_token_id = BOS_TOKEN_ID
    eos_token_id = EOS_TOKEN_ID
    vocab_size = VOCAB_SIZE

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_TOKEN_ID, *ids] if add_bos else ids

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        # special tokens carry no text; a byte sequence cut mid-character decodes with U+FFFD
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
