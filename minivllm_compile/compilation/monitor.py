"""Compile-time monitoring (vLLM's compilation/monitor.py): how long Dynamo and the whole compile
took, and the switch that allows CUDA-graph capture (vLLM 0.33's: 0.34 has none, see below).

vLLM logs "Dynamo bytecode transform time: %.2f s" from the start of the first compiled call to the
moment Dynamo hands the graph to the backend (seed §14): the trace alone, before any Inductor work.
STOCK_TORCH_COMPILE is compiled by its caller, outside monitor_torch_compile (vLLM logs no such
line there): its time runs from the start of Dynamo's compile of the frame, which Dynamo announces
to its compile-start callbacks. Whether a call enters Dynamo at all is measured by
viz.count_dynamo_entries (notebook 04).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from minivllm_compile.config import CompilationConfig, CompilationMode

logger = logging.getLogger("minivllm_compile")

# when the compile monitor_torch_compile is timing began (None: none is being timed), and when
# Dynamo last began compiling a frame (for a compile outside it)
torch_compile_start_time: float | None = None
_dynamo_compile_start: float | None = None


@contextmanager
def monitor_torch_compile(compilation_config: CompilationConfig,
                          message: str = "%storch.compile took %.2f s in total",
                          tag: str = "") -> Iterator[None]:
    """Time a compile (vLLM's, in compilation/monitor.py): the start time the backend's Dynamo
    log line measures from, and on success one line with the whole compile's time (VLLM_COMPILE
    only, as in vLLM). A failed compile logs nothing here: its exception says enough. With
    debug_dump_path set, depyf dumps the compile there, as vLLM's does (depyf_debug)."""
    global torch_compile_start_time
    outer, torch_compile_start_time = torch_compile_start_time, time.perf_counter()
    try:
        with depyf_debug(compilation_config):
            yield
        if compilation_config.mode == CompilationMode.VLLM_COMPILE:
            elapsed = time.perf_counter() - torch_compile_start_time
            logger.info(message, f"[{tag}] " if tag else "", elapsed)
    finally:
        torch_compile_start_time = outer  # a later compile outside it must not measure from here


def dynamo_transform_time() -> float | None:
    """Seconds since monitor_torch_compile began, or, outside it, since Dynamo began compiling the
    frame; the backend calls it when Dynamo hands over. None where neither is known (this torch
    has no compile-start callbacks): then nothing is logged."""
    start = (torch_compile_start_time if torch_compile_start_time is not None
             else _dynamo_compile_start)
    if start is None:
        return None
    elapsed = time.perf_counter() - start
    logger.info("Dynamo bytecode transform time: %.2f s", elapsed)
    return elapsed


def _note_dynamo_start(*args: object) -> None:
    global _dynamo_compile_start
    _dynamo_compile_start = time.perf_counter()


def watch_dynamo_compiles() -> None:
    """Note when Dynamo begins compiling a frame (its compile-start callbacks run at the start of
    the outermost compile), for dynamo_transform_time outside monitor_torch_compile. Registered
    again if gone: torch._dynamo.reset() clears the callbacks."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # a torch without them: the time stays unknown
        return
    if _note_dynamo_start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_note_dynamo_start)


@contextmanager
def depyf_debug(compilation_config: CompilationConfig) -> Iterator[None]:
    """Inside monitor_torch_compile, as in vLLM's: with debug_dump_path set under
    VLLM_COMPILE, depyf dumps what Dynamo and the backend produce there (the transformed code, the
    Dynamo graph before and after the split, each piece's graph). Without depyf, the dump still
    gets transformed_code.py (disassembled) and computation_graph_<tag>.py."""
    path = compilation_config.compile_debug_dump_path()
    if not path or compilation_config.mode != CompilationMode.VLLM_COMPILE:
        yield
        return
    from minivllm_compile.compilation import depyf_compat  # depyf's one way in, as in vLLM

    if not depyf_compat.available():
        logger.info("debug_dump_path: depyf is not installed (pip install depyf), so the dump "
                    "holds the disassembled transformed code and the split graph only")
        yield
        return
    Path(path).mkdir(parents=True, exist_ok=True)
    logger.debug("Dumping depyf output to %s", path)
    cm = depyf_compat.prepare_debug(str(path))
    cm.__enter__()
    try:
        yield
    finally:
        try:
            cm.__exit__(None, None, None)
        except Exception:  # depyf's cleanup must not hide the compile's own outcome
            logger.warning("Exception during depyf cleanup.", exc_info=True)


# vLLM 0.33's switch for CUDA-graph capture (its compilation/monitor.py): the model runner turned it
# on around its capture at start-up and off after; a wrapper asked to capture while it is off
# refuses, since a capture while serving is a request waiting for it (and, on CUDA, a stall). 0.33
# started with it on and turned it off after the first capture; here it starts off, so a capture
# before LM.capture_model is refused too. vLLM 0.34 has neither function: its model runner V2
# captures every graph in CudaGraphManager.capture() at start-up and dispatches only to captured
# ones (v1/worker/gpu/cudagraph_utils.py).
cudagraph_capturing_enabled: bool = False


def validate_cudagraph_capturing_enabled() -> None:
    if not cudagraph_capturing_enabled:
        raise RuntimeError("CUDA graph capturing detected at an inappropriate time: capture is "
                           "only allowed at start-up (LM.capture_model turns it on with "
                           "set_cudagraph_capturing_enabled(True), and off after)")


def set_cudagraph_capturing_enabled(enabled: bool) -> None:
    global cudagraph_capturing_enabled
    cudagraph_capturing_enabled = enabled
