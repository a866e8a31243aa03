import itertools

import pytest
from torch.library import Library

from minivllm_compile.ir import op as op_module
from minivllm_compile.ir.op import IrOp

_scratch = itertools.count()


@pytest.fixture
def scratch_registry(monkeypatch):
    """A library and a registry of its own for the ops a test registers, dropped afterwards (vLLM's
    tests monkeypatch vllm_ir_torch_lib the same way: their `fake_vllm_ir` fixture). A namespace
    of its own each time: an op name defined again in a destroyed library's namespace crashes the
    process at its first call."""
    lib = Library(f"minivllm_ir_test{next(_scratch)}", "FRAGMENT")
    monkeypatch.setattr(op_module, "ir_torch_lib", lib)
    monkeypatch.setattr(IrOp, "registry", dict(IrOp.registry))
    monkeypatch.setattr(op_module, "_warned", set())  # every warning logged again
    yield lib
    lib._destroy()
