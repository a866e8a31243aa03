"""The README's first command runs the tour: the trained models write text, the compiled model
writes the same text, every kernel matches its reference."""

import os
import subprocess
import sys

import pytest

from minivllm_compile.tour import PROMPTS


@pytest.mark.compiles
def test_the_tour_runs(tmp_path):
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path), "VLLM_DISABLE_COMPILE_CACHE": "0"}
    env.pop("TRITON_INTERPRET", None)  # the tour must set it up itself
    env.pop("OMP_NUM_THREADS", None)  # the tour chooses one thread itself
    proc = subprocess.run([sys.executable, "-m", "minivllm_compile.tour"], env=env,
                          capture_output=True,
                          text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("=== tiny-") == 3 and "def fibonacci(n):" in out
    assert "torch threads: 1 (torch's default here" in out or "device cuda" in out
    # the hybrid writes text (greedy, it printed only spaces after two of the three prompts)
    hybrid = out.split("=== tiny-hybrid")[1].split("=== tiny-llama under")[0]
    assert "sampled at temperature 0.8" in hybrid
    written = [block.split("\n", 1)[1] for block in hybrid.split("--- prompt ")[1:]]
    assert len(written) == len(PROMPTS)
    for prompt, text in zip(PROMPTS, written):
        assert text.startswith(prompt), repr(text)
        assert sum(c.isalpha() for c in text[len(prompt):]) > 20, repr(text)
    assert "split into 9 pieces" in out and "greedy text identical to eager: True" in out
    assert "16 of 16 kernel checks passed" in out
    proc = subprocess.run([sys.executable, "-m", "minivllm_compile.tour"], env=env,
                          capture_output=True,
                          text=True, timeout=900, check=False)
    # the second tour
    assert proc.returncode == 0 and "loaded the saved AOT artifact" in proc.stdout
