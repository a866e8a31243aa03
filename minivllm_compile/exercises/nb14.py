"""Notebook 14's exercises: the runtime mode and padded size the CudagraphDispatcher picks for a
step, and the static-buffer hazard, fixed in a function of the student's, on the CPU stand-in
(cuda_graph.StaticBufferReplay, which keeps a CUDA graph's contract and is not a CUDA graph)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from minivllm_compile.exercises import ExerciseFailed, exercise

# ---------------------------------------------------------------------------------------------
# 14.1: what the dispatcher picks

DISPATCH_MODE, CAPTURE_SIZES, MAX_TOKENS = "FULL_DECODE_ONLY", [1, 2, 4, 8, 16, 24], 32
# (num_tokens, uniform_decode): uniform_decode=True is a pure decode batch,
# False a mixed (prefill) one
STEPS = ((3, True), (3, False), (13, True), (17, True), (24, True), (25, True))


def _dispatch_config():
    from minivllm_compile import CompilationConfig, CompilationMode

    return CompilationConfig(mode=CompilationMode.VLLM_COMPILE, max_num_batched_tokens=MAX_TOKENS,
                             cudagraph_mode=DISPATCH_MODE, cudagraph_capture_sizes=CAPTURE_SIZES)


def _mode_name(value: Any, where: str) -> str:
    from minivllm_compile import CUDAGraphMode

    if isinstance(value, CUDAGraphMode):
        return value.name
    if isinstance(value, str) and value.upper() in CUDAGraphMode.__members__:
        return value.upper()
    raise ExerciseFailed(f"{where}: a runtime mode is a CUDAGraphMode (or its name): NONE, "
                         f"PIECEWISE or FULL; got {value!r}")


def _grade_dispatch(answer: Any) -> str:
    from minivllm_compile.compilation.cuda_graph import CudagraphDispatcher

    if not isinstance(answer, dict) or set(answer) != set(STEPS):
        raise ExerciseFailed("give {(num_tokens, uniform_decode): (mode, padded num_tokens)} for "
                             f"the steps {list(STEPS)}; got {answer!r}")
    said = {}
    for step, value in answer.items():
        if not (isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[1], int)):
            raise ExerciseFailed(f"step {step}: give (mode, padded num_tokens), e.g. "
                                 f"('FULL', 8); got {value!r}")
        said[step] = (_mode_name(value[0], f"step {step}"), value[1])
    cc = _dispatch_config()
    dispatcher = CudagraphDispatcher(cc)
    sizes, largest = cc.cudagraph_capture_sizes, cc.max_cudagraph_capture_size
    mode = cc.cudagraph_mode
    truth = {}
    for n, uniform in STEPS:
        got_mode, desc = dispatcher.dispatch(n, uniform_decode=uniform)
        truth[n, uniform] = (got_mode.name, desc.num_tokens)
    problems = []
    for (n, uniform), (said_mode, said_padded) in said.items():
        if (said_mode, said_padded) == truth[n, uniform]:
            continue
        kind = "a decode batch" if uniform else "a mixed batch"
        if n > largest:
            why = ("is there a captured graph for a step above the largest capture size "
                   f"({largest})? And is a step that replays no graph padded?")
        elif said_mode != truth[n, uniform][0]:
            which = "decode_mode()" if uniform else "mixed_mode()"
            why = (f"what is {mode.name}'s {which}? (the modes table) And is a step "
                   "that replays no graph padded?")
        else:
            why = ("a step that replays a graph pads up to the next capture size "
                   f">= num_tokens, of {sizes}")
        problems.append(f"num_tokens={n}, {kind}: not {said_mode} padded to {said_padded}. {why}")
    if problems:
        raise ExerciseFailed(f"CudagraphDispatcher(cudagraph_mode={mode.name}, capture sizes "
                             f"{sizes}) says otherwise (notebook 14, the modes table and §1):\n  "
                             "- " + "\n  - ".join(problems),
                             measured="dispatch gives " + ", ".join(
                                 f"({n}, {u}) -> {m}, {p}" for (n, u), (m, p) in truth.items()))
    return (f"{mode.name}: a decode batch up to {largest} tokens replays the FULL graph "
            f"of the next capture size; a mixed batch, and anything above {largest}, "
            "runs with no graph, unpadded.")


_DISPATCH_SOLUTION = {(3, True): ("FULL", 4), (3, False): ("NONE", 3), (13, True): ("FULL", 16),
                      (17, True): ("FULL", 24), (24, True): ("FULL", 24), (25, True): ("NONE", 25)}


@exercise("14.1", "the runtime mode and padded size of a step", section="notebook 14, the modes "
          "table and §1 (the dispatcher: pad up to a captured size)",
          hint="look up FULL_DECODE_ONLY's decode_mode() and mixed_mode() in the modes "
               "table; then how a step that replays a graph is padded, and what happens "
               "above the largest capture size",
          deeper_hint="In a cell: M = CUDAGraphMode; print(M.FULL_DECODE_ONLY.decode_mode(), "
                      "M.FULL_DECODE_ONLY.mixed_mode()). A decode batch (uniform_decode=True) gets "
                      "the first, a mixed batch the second. A graph exists only for the capture "
                      "sizes, so a step that replays one is padded up to a capture size (which "
                      "one? §1's table); a step with no graph runs as it is, whatever its size.",
          solution=lambda: dict(_DISPATCH_SOLUTION),
          wrong=lambda: {**_DISPATCH_SOLUTION, (3, False): ("PIECEWISE", 4)},
          wrong_says="mixed_mode()",
          gives_away="(3, False) -> NONE, 3")
def grade_dispatch(answer: Any) -> str:
    return _grade_dispatch(answer)


# ---------------------------------------------------------------------------------------------
# 14.2: keep every step's output, on a captured (stand-in) graph

BATCH, WIDTH, NUM_STEPS = 4, 8, 3


def _collect_solution() -> Callable:
    def collect(step: Callable, static_x: torch.Tensor,
                batches: list[torch.Tensor]) -> list[torch.Tensor]:
        outputs = []
        for batch in batches:
            static_x.copy_(batch)  # the graph reads the buffer it was captured on
            outputs.append(step(static_x).clone())  # the next replay overwrites the static output
        return outputs

    return collect


def _collect_wrong() -> Callable:
    def collect(step: Callable, static_x: torch.Tensor,
                batches: list[torch.Tensor]) -> list[torch.Tensor]:
        return [step(batch) for batch in batches]

    return collect


def _grade_collect(collect: Any) -> str:
    from minivllm_compile import CompilationConfig, CompilationMode, CUDAGraphMode
    from minivllm_compile.compilation.cuda_graph import (
        BatchDescriptor,
        CUDAGraphWrapper,
        StaticBufferReplay,
    )
    from minivllm_compile.compilation.monitor import set_cudagraph_capturing_enabled
    from minivllm_compile.forward_context import set_forward_context

    if not callable(collect):
        raise ExerciseFailed(f"give the function collect(step, static_x, batches); got {collect!r}")
    torch.manual_seed(0)
    piece = torch.nn.Linear(WIDTH, WIDTH)  # stands in for a compiled piece
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, max_num_batched_tokens=16,
                           cudagraph_mode="FULL",
                           cudagraph_capture_sizes=[BATCH])
    # vLLM's default: the caller writes into the captured buffers
    assert cc.cudagraph_copy_inputs is False
    wrapper = CUDAGraphWrapper(piece, cc, CUDAGraphMode.FULL)
    desc = BatchDescriptor(BATCH, num_reqs=BATCH)
    calls = []

    def step(x: torch.Tensor) -> torch.Tensor:
        calls.append(x)
        with torch.no_grad(), set_forward_context(None, {}, CUDAGraphMode.FULL, desc):
            return wrapper(x)

    static_x = torch.zeros(BATCH, WIDTH)
    set_cudagraph_capturing_enabled(True)
    try:
        step(static_x)  # captured at start-up, on static_x
    finally:
        set_cudagraph_capturing_enabled(False)
    calls.clear()
    (entry,) = wrapper.concrete_cudagraph_entries.values()
    assert isinstance(entry.cudagraph, StaticBufferReplay)  # the CPU stand-in, not a CUDA graph
    batches = [torch.randn(BATCH, WIDTH) for _ in range(NUM_STEPS)]
    with torch.no_grad():
        expected = [piece(b) for b in batches]
        # what a replay computes when nothing was copied in
        stale = piece(torch.zeros(BATCH, WIDTH))
    given = [b.clone() for b in batches]
    with torch.no_grad():
        outputs = collect(step, static_x, given)

    if not isinstance(outputs, (list, tuple)) or len(outputs) != NUM_STEPS \
            or not all(isinstance(o, torch.Tensor) for o in outputs):
        raise ExerciseFailed(f"collect must return a list of {NUM_STEPS} tensors, one "
                             f"per batch; got {outputs!r}")
    if len(calls) != NUM_STEPS:
        raise ExerciseFailed(f"collect called step {len(calls)} times for {NUM_STEPS} "
                             "batches: run one step (one replay) per batch, through "
                             "step(...), not the piece itself")
    if any(o.data_ptr() == entry.output.data_ptr() for o in outputs):
        kept = sum(o.data_ptr() == entry.output.data_ptr() for o in outputs)
        raise ExerciseFailed(f"{kept} of your {NUM_STEPS} outputs are the same tensor, the "
                             "graph's static output (entry.output): every replay overwrites it, "
                             "so what you kept from step 1 now holds the last step's values. "
                             "Each output must keep its values after the next replay (notebook "
                             "14 §3, the outputs' hazard)")
    if all(torch.allclose(o, stale) for o in outputs) or any(c.data_ptr() != static_x.data_ptr()
                                                             for c in calls):
        raise ExerciseFailed("the graph never saw your batches: it reads the buffer it was "
                             "captured on (static_x), and a new tensor passed to step is "
                             "ignored (cudagraph_copy_inputs=False, vLLM's default). How "
                             "does a batch get into the memory the graph reads? (notebook 14 "
                             "§3, the inputs' contract)")
    for i, (o, e) in enumerate(zip(outputs, expected)):
        if not torch.allclose(o, e, atol=1e-6):
            raise ExerciseFailed(f"step {i + 1}'s output differs from the piece run eagerly on "
                                 f"batch {i + 1} (max |difference| "
                                 f"{(o - e).abs().max().item():.2e}): did you change a batch, or "
                                 "keep a step's output before the next one overwrote it?")
    if any(not torch.equal(g, b) for g, b in zip(given, batches)):
        raise ExerciseFailed("collect changed the batches it was given: copy them into "
                             "static_x, do not edit them")
    return (f"{NUM_STEPS} replays of one captured graph, each batch copied into its static "
            "input, each output cloned before the next replay overwrote it: the same values "
            "as the piece run eagerly.")


@exercise("14.2", "keep every step's output from a captured graph", section="notebook 14 §3 (the "
          "static-buffer hazard, shown and fixed)",
          hint="two hazards (§3): where does the captured graph read its input from, and what "
               "happens to the tensor a replay returns when the next replay runs?",
          deeper_hint="Run §3's two demonstrations again and watch the addresses: the tensor "
                      "the graph reads is the one it was captured on, whatever you pass to "
                      "step, and every replay returns the very same output tensor (compare "
                      "data_ptr()). So, per batch: put the batch where the graph reads, "
                      "replay, and keep a tensor of your own with the output's values before "
                      "the next replay overwrites them.",
          solution=_collect_solution, wrong=_collect_wrong, wrong_says="the same tensor",
          gives_away="static_x.copy_(batch)")
def grade_collect(collect: Any) -> str:
    return _grade_collect(collect)
