"""The Triton kernels compile for a GPU (sm_90, the H200) on this GPU-less machine: the interpreter
the other kernel tests use never meets Triton's compiler, so a kernel could pass them all and still
fail to build on a GPU (kernels/gpu_compile.py)."""

import os
import re
import subprocess
import sys

import pytest

from minivllm_compile.kernels._compat import HAS_TRITON


@pytest.mark.compiles
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_every_kernel_variant_compiles_for_sm90():
    # a fresh process: the kernels must be decorated with the interpreter off
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-m", "minivllm_compile.kernels.gpu_compile",
                           "--arch", "90"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    done, total = map(int, re.search(r"(\d+) of (\d+) kernel variants compiled for sm_90",
                                     proc.stdout).groups())
    # every kernel, fp32 and bf16, the decode kernel's spec-decoding and varlen branches, and
    # gelu_and_mul_sparse's (the IR op's triton provider), fp32 and bf16
    assert done == total == 20
    for name in ("_rms_norm_kernel", "_fused_add_rms_norm_kernel", "_rotary_embedding_kernel",
                 "_silu_and_mul_kernel", "_fused_qk_norm_rope_kernel", "_causal_conv1d_fwd_kernel",
                 "_causal_conv1d_update_kernel", "_gelu_and_mul_sparse_kernel"):
        assert re.search(rf"^{name}\s.*\d+ B cubin$", proc.stdout, re.MULTILINE), name
