"""Compile-time monitoring: how long Dynamo took, and whether Dynamo is entered at all on a call.

vLLM logs "Dynamo bytecode transform time: %.2f s" from the start of the first compiled call to the
moment Dynamo hands the graph to the backend (seed §14): the trace alone, before any Inductor work.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator


logger = logging.getLogger("minivllm_compile")

torch_compile_start_time: float = 0.0


def start_monitoring_torch_compile() -> None:
    global torch_compile_start_time
    torch_compile_start_time = time.perf_counter()


def dynamo_transform_time() -> float:
    """Seconds since start_monitoring_torch_compile; the backend calls it when Dynamo hands over."""
    elapsed = time.perf_counter() - torch_compile_start_time
    logger.info("Dynamo bytecode transform time: %.2f s", elapsed)
    return elapsed


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
