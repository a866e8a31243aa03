"""gelu_and_mul_sparse's Triton kernel (kernels/activation.py, vLLM 0.34's) against its plain-torch
reference: rows with a stride of their own, and what the launcher refuses. The IR provider that
calls it is tested in tests/ir/test_gelu_and_mul_sparse.py. On the CPU the kernel runs in Triton's
interpreter (conftest.py)."""

from __future__ import annotations

import pytest
import torch

from minivllm_compile.kernels._compat import HAS_TRITON
from minivllm_compile.kernels.activation import (
    GELU_AND_MUL_SPARSE_MAX_D,
    gelu_and_mul_sparse_ref,
    gelu_and_mul_sparse_triton,
)

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
STD = 1.6448536269514722


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_with_a_stride_of_their_own_match_the_reference(dtype, kernel_device):
    torch.manual_seed(0)
    wide = torch.randn(6, 2 * 200 + 24, dtype=dtype, device=kernel_device)
    x = wide[:, : 2 * 200]  # each row 424 apart: the kernel reads its rows by their stride
    out = torch.empty(6, 300, dtype=dtype, device=kernel_device)[:, :200]
    gelu_and_mul_sparse_triton(out, x, STD)
    want = torch.empty(6, 200, dtype=dtype, device=kernel_device)
    gelu_and_mul_sparse_ref(want, x, STD)
    torch.testing.assert_close(out, want, atol=1e-5 if dtype == torch.float32 else 1e-3,
                               rtol=1.3e-6 if dtype == torch.float32 else 1.6e-2)
    assert torch.equal(out == 0, want == 0) and 0 < torch.count_nonzero(want) < want.numel() / 4


def test_the_launcher_refuses_what_the_kernel_cannot_do(kernel_device, monkeypatch):
    x = torch.randn(2, 64, device=kernel_device)
    out = torch.empty(2, 32, device=kernel_device)
    with pytest.raises(ValueError, match="last dimension must be even"):
        gelu_and_mul_sparse_triton(out, x[:, :63], STD)
    with pytest.raises(ValueError, match=r"out shape \(2, 31\) != \(2, 32\)"):
        gelu_and_mul_sparse_triton(out[:, :31], x, STD)
    with pytest.raises(ValueError, match="out dtype torch.float64 != input dtype torch.float32"):
        gelu_and_mul_sparse_triton(out.double(), x, STD)
    d = GELU_AND_MUL_SPARSE_MAX_D + 1
    with pytest.raises(ValueError, match=f"d = {d} > {GELU_AND_MUL_SPARSE_MAX_D}: one program"):
        gelu_and_mul_sparse_triton(torch.empty(1, d, device=kernel_device),
                                   torch.empty(1, 2 * d, device=kernel_device), STD)
    if kernel_device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="input is on the CPU; Triton kernels need a GPU"):
            gelu_and_mul_sparse_triton(out, x, STD)
