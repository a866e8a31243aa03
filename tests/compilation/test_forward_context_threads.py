"""Two models used from two threads each get their own logits, eager and compiled.

Their layers share names ("model.layers.0.self_attn.attn"), and the splitting ops find a layer's
KV cache and metadata through the forward context: one process-wide context let one thread's
attention read the other model's cache. The context is per thread now (forward_context.py). A
compiled model calls Dynamo's transformed code as a function of its own (wrapper.py): vLLM swaps it
into the class's shared `forward.__code__` for the length of each call, which let one thread run
another model's compiled code.
"""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from minivllm_compile import CompilationConfig, CompilationMode
from minivllm_compile.forward_context import (
    get_forward_context,
    is_forward_context_available,
    set_forward_context,
)
from minivllm_compile.models import build_model
from minivllm_compile.models.llama import LlamaModel

CALLS = 60  # per thread: the old global context failed within the first few


def run_side_by_side(lms, ids, pos) -> list[str]:
    """Each model called CALLS times from its own thread, all starting together; what went wrong."""
    refs = [lm(ids, pos) for lm in lms]
    problems: list[str] = []
    start = threading.Barrier(len(lms))

    def work(i: int) -> None:
        try:
            start.wait(timeout=60)
            for n in range(CALLS):
                if not torch.equal(lms[i](ids, pos), refs[i]):
                    problems.append(f"model {i}, call {n}: another model's logits")
        except Exception as e:  # noqa: BLE001  (reported below, with the thread it came from)
            problems.append(f"model {i}: {e!r}")

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(len(lms))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread is still running after 300 s"
    return problems


def test_a_forward_context_is_seen_only_by_the_thread_that_set_it():
    seen = []
    with set_forward_context(None, {"layer": "mine"}):
        t = threading.Thread(target=lambda: seen.append(is_forward_context_available()))
        t.start()
        t.join(timeout=10)
        assert get_forward_context().no_compile_layers == {"layer": "mine"}
    assert seen == [False] and not is_forward_context_available()
    with pytest.raises(RuntimeError, match="no forward context is set in this thread"):
        get_forward_context()


def test_two_eager_models_in_two_threads_each_get_their_own_logits():
    lms = [build_model("llama", num_layers=1, seed=s) for s in (0, 1)]
    ids, pos = torch.arange(1, 40), torch.arange(39)
    assert not torch.allclose(lms[0](ids, pos), lms[1](ids, pos))
    assert run_side_by_side(lms, ids, pos) == []


@pytest.mark.compiles
def test_two_compiled_models_in_two_threads_each_get_their_own_logits():
    """A Llama and a hybrid: two classes sharing one `forward` (HybridModel inherits it), whose
    __code__ the bytecode hook swaps during each call. Eager backend: Dynamo is what is tested."""
    def cc():
        return CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="eager",
                                 max_num_batched_tokens=64)

    original = LlamaModel.forward.__code__
    lms = [build_model("llama", num_layers=1, compilation_config=cc()),
           build_model("hybrid", num_layers=2, compilation_config=cc(), seed=1)]
    for lm in lms:
        lm.warmup()
    ids, pos = torch.arange(1, 40), torch.arange(39)
    assert run_side_by_side(lms, ids, pos) == []
    # no thread left its compiled code in the shared function (an eager instance would run it)
    assert LlamaModel.forward.__code__ is original


def test_one_model_called_from_two_threads_serves_each_call_whole():
    """Its KV caches live on its layers: calls from two threads take turns (models/lm.py)."""
    lm = build_model("llama", num_layers=1)
    inputs = [(torch.arange(1, 40), torch.arange(39)), (torch.arange(50, 70), torch.arange(20))]
    prompts = ["def f(", "class A:"]
    refs = [lm(*x) for x in inputs]
    texts = [lm.generate([p], 8) for p in prompts]
    problems: list[str] = []
    start = threading.Barrier(2)

    def work(i: int) -> None:
        try:
            start.wait(timeout=60)
            for n in range(CALLS // 2):
                if not torch.equal(lm(*inputs[i]), refs[i]):
                    problems.append(f"thread {i}, call {n}: wrong logits")
            if lm.generate([prompts[i]], 8) != texts[i]:
                problems.append(f"thread {i}: wrong text")
        except Exception as e:  # noqa: BLE001  (reported below, with the thread it came from)
            problems.append(f"thread {i}: {e!r}")

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a thread is still running after 300 s"
    assert problems == []


@pytest.mark.compiles
def test_two_compiled_decoders_called_straight_from_two_threads_each_get_their_own_output():
    """lm.model(...) itself, from two threads at once, no LM and no lock in between: a Llama and a
    hybrid, whose classes share one forward (HybridModel inherits it). With the shared
    forward.__code__ swapped for each call, one thread ran the other model's compiled code
    (wrong outputs, or errors from a graph fed another model's layers)."""
    def cc():
        return CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="eager",
                                 max_num_batched_tokens=64)

    original = LlamaModel.forward.__code__
    lms = [build_model("llama", num_layers=1, compilation_config=cc()),
           build_model("hybrid", num_layers=2, compilation_config=cc(), seed=1)]
    ids, pos = torch.arange(1, 40), torch.arange(39)

    def call(lm):
        with torch.inference_mode(), set_forward_context(None, lm.model.static_forward_context):
            return lm.model(ids, pos)

    refs = [call(lm) for lm in lms]  # the first calls compile
    problems: list[str] = []
    start = threading.Barrier(2)

    def work(i: int) -> None:
        try:
            start.wait(timeout=60)
            for n in range(CALLS * 2):
                if not torch.equal(call(lms[i]), refs[i]):
                    problems.append(f"model {i}, call {n}: another model's output")
        except Exception as e:  # noqa: BLE001  (reported below, with the thread it came from)
            problems.append(f"model {i}: {e!r}")

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch often: a race shows within a few calls
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads), "a thread is still running after 300 s"
    assert problems == []
    assert LlamaModel.forward.__code__ is original  # never swapped
