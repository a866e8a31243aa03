"""startup.run_in_fresh_process, the package's one way to run something in a fresh process, and
notebook 12's mode runs on it (compare_modes.py)."""

import pytest
import torch

from minivllm_compile.bench.compare_modes import PROMPTS, run_mode
from minivllm_compile.bench.startup import run_in_fresh_process, start_child
from minivllm_compile.models import load_model


@pytest.mark.compiles
@pytest.mark.compiles  # the child traces with Dynamo (eager backend: no Inductor)
def test_a_mode_runs_in_its_own_process_and_reports_its_counters(tmp_path):
    r = run_mode("STOCK_TORCH_COMPILE", backend="eager", device="cpu", work_dir=tmp_path,
                 inductor_cache="ind", logits_file="logits.pt", max_new_tokens=4, repeats=2)
    # stock torch.compile traces on the first call, and again at the later shapes (its guards):
    # each counted where it happened
    first, after = r["counters_first_call"], r["counters_after"]
    assert first["num_dynamo_traces"] == 1 and after["num_dynamo_traces"] >= 1
    assert first["num_graphs_seen"] == 0  # (a counter that did not move reads 0)
    assert set(r["latency_s"]) == set(r["first_at_shape_s"]) == {"decode", "prefill"}
    assert 0 < r["first_call_s"] and 0 < r["import_build_s"]
    assert all(v > 0 for v in r["latency_s"].values())
    eager = load_model("tiny-llama")
    assert r["texts"] == eager.generate(PROMPTS, max_new_tokens=4)  # the same greedy text as here
    logits = torch.load(r["logits_path"])
    # one row per sequence per step
    assert logits.shape == (4 * len(PROMPTS), eager.config.vocab_size)


@pytest.mark.compiles
def test_a_child_that_fails_raises_with_its_error():
    # the child's environment is this one with the overrides: this one fails at the package's import
    with pytest.raises(RuntimeError, match=r"(?s)start_child failed in a fresh process \(exit 1\).*"
                                           r"VLLM_LOGGING_LEVEL='bogus' is not a level"):
        run_in_fresh_process(start_child, {}, {"VLLM_LOGGING_LEVEL": "bogus"}, timeout_s=300)


def test_only_an_importable_function_can_run_in_a_fresh_process():
    with pytest.raises(ValueError, match="pass a module-level function of an importable module"):
        run_in_fresh_process(lambda spec: spec, {})
