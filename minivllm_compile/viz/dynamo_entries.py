"""Whether a call enters Dynamo at all (notebook 04): the bytecode hook's whole point, measured."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


@dataclass
class DynamoEntries:
    count: int = 0


@contextmanager
def count_dynamo_entries() -> Iterator[DynamoEntries]:
    """Count how often a call installs Dynamo's frame-evaluation callback.

    Every call through a torch.compile'd function does (even when its guards are all dropped and the
    cache hits at once); a call dispatched by the bytecode hook straight to the transformed code
    never does. Counted at torch._dynamo.eval_frame._callback_from_stance, the one function every
    entry goes through in torch 2.11-2.14.
    """
    import torch._dynamo.eval_frame as eval_frame

    entries = DynamoEntries()
    original = eval_frame._callback_from_stance

    def counting(callback):
        # callback None/False is torch._dynamo.disable's context (the transformed code calls the
        # compiled graph through one): that turns frame evaluation off, it does not enter it
        if callback not in (None, False):
            entries.count += 1
        return original(callback)

    eval_frame._callback_from_stance = counting
    try:
        yield entries
    finally:
        eval_frame._callback_from_stance = original
