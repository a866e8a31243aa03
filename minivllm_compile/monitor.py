"""Compile-time monitoring: how long Dynamo took, and whether Dynamo is entered at all on a call.

vLLM logs "Dynamo bytecode transform time: %.2f s" from the start of the first compiled call to the
moment Dynamo hands the graph to the backend (seed §14): the trace alone, before any Inductor work.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
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


@contextmanager
def depyf_debug(compilation_config) -> Iterator[None]:
    """Around the first compile, as vLLM's monitor_torch_compile: with debug_dump_path set under
    VLLM_COMPILE, depyf dumps what Dynamo and the backend produce there (the transformed code, the
    Dynamo graph before and after the split, each piece's graph). Without depyf, the dump still
    gets transformed_code.py (disassembled) and computation_graph_<tag>.py."""
    from minivllm_compile.config import CompilationMode

    path = compilation_config.debug_dump_path
    if not path or compilation_config.mode != CompilationMode.VLLM_COMPILE:
        yield
        return
    try:
        import depyf
    except ImportError:
        logger.info("debug_dump_path: depyf is not installed (pip install depyf), so the dump "
                    "holds the disassembled transformed code and the split graph only")
        yield
        return
    Path(path).mkdir(parents=True, exist_ok=True)
    logger.debug("Dumping depyf output to %s", path)
    cm = depyf.prepare_debug(str(path))
    cm.__enter__()
    try:
        yield
    finally:
        try:
            cm.__exit__(None, None, None)
        except Exception:  # depyf's cleanup must not hide the compile's own outcome
            logger.warning("Exception during depyf cleanup.", exc_info=True)


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
