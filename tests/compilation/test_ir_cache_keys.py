"""The vLLM IR priority and the source of each provider it names are compile-cache factors, proven
as a user meets them: one process compiles, the next starts on the same caches (ours and
Inductor's). A change of priority, or an edit to a provider's body, must compile afresh; nothing
changed, it loads. Dynamo never traces a lowered provider (the lowering runs inside Inductor), so no
traced file would notice the edit: only these factors do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm_compile import CompilationConfig, CompilationMode
from minivllm_compile.compilation import cache_keys
from minivllm_compile.config import hash_config
from minivllm_compile.config.kernel import IrOpPriorityConfig, KernelConfig

CHILD = r"""
import importlib, json, sys, torch
spec = json.loads(sys.argv[1])
sys.path[:0] = spec.get("path", [])
for name in spec.get("imports", []):
    importlib.import_module(name)  # registers a provider of the user's own
from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter
from minivllm_compile.config.kernel import IrOpPriorityConfig, KernelConfig
from minivllm_compile.models import build_model

def cc(mode):
    kernels = KernelConfig(IrOpPriorityConfig.with_default(spec["priority"]))
    return CompilationConfig(mode=CompilationMode[mode], max_num_batched_tokens=16,
                             kernel_config=kernels)

ids, pos = torch.arange(7), torch.arange(7)
out = build_model("llama", num_layers=1, compilation_config=cc("VLLM_COMPILE"))(ids, pos)
eager = build_model("llama", num_layers=1, compilation_config=cc("NONE"))(ids, pos)  # same priority
print("RESULT " + json.dumps({**vars(compilation_counter), "diff": (out - eager).abs().max().item(),
                              "logit": out[0, 0].item()}))
"""

PROVIDER = '''
from torch import Tensor

from minivllm_compile import ir

SCALE = 1.0


@ir.ops.rms_norm.register_impl("mine")
def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float,
             variance_size: int | None = None) -> Tensor:
    return ir.ops.rms_norm.impls["native"].impl_fn(x, weight, epsilon, variance_size) * SCALE


@ir.ops.fused_add_rms_norm.register_impl("mine")
def fused_add_rms_norm(x: Tensor, x_residual: Tensor, weight: Tensor | None, epsilon: float,
                       variance_size: int | None = None) -> tuple[Tensor, Tensor]:
    out, residual = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x, x_residual, weight,
                                                                      epsilon)
    return out * SCALE, residual
'''


def run(tmp: Path, spec: dict) -> dict:
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp / "cache"), "VLLM_DISABLE_COMPILE_CACHE": "0",
           # Inductor's FX-graph cache must miss too
           "TORCHINDUCTOR_CACHE_DIR": str(tmp / "inductor")}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return next(json.loads(line[7:]) for line in proc.stdout.splitlines()
                if line.startswith("RESULT "))


def loaded(result: dict) -> bool:
    assert result["diff"] <= 1e-5, result  # compiled or loaded, it computes what eager does
    assert result["num_aot_artifacts_loaded"] + result["num_aot_compiles"] == 1, result
    return result["num_aot_artifacts_loaded"] == 1


@pytest.mark.compiles
def test_a_changed_priority_compiles_afresh(tmp_path, seed_isa_record):
    seed_isa_record(tmp_path / "cache")
    assert not loaded(run(tmp_path, {"priority": ["native"]}))
    assert not loaded(run(tmp_path, {"priority": ["vllm_c", "native"]}))
    assert loaded(run(tmp_path, {"priority": ["native"]}))
    assert loaded(run(tmp_path, {"priority": ["vllm_c", "native"]}))


@pytest.mark.compiles
def test_an_edited_provider_compiles_afresh_and_runs_the_new_body(tmp_path, seed_isa_record):
    """A provider of the user's own, outside this package (whose source is a factor already): with
    the edit, the next start must not load the kernels lowered from the old body. The edit changes
    what the body computes, so an old artifact would show (diff from eager,
    which runs the new one)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "my_norms.py").write_text(PROVIDER)
    seed_isa_record(tmp_path / "cache")
    spec = {"priority": ["mine", "native"], "path": [str(src)], "imports": ["my_norms"]}
    first = run(tmp_path, spec)
    assert not loaded(first)
    assert loaded(run(tmp_path, spec))
    (src / "my_norms.py").write_text(PROVIDER.replace("SCALE = 1.0", "SCALE = 2.0"))
    edited = run(tmp_path, spec)
    assert not loaded(edited) and edited["logit"] != first["logit"]
    assert loaded(run(tmp_path, spec))


def test_the_priority_the_wrap_and_the_provider_sources_change_the_key():
    """The same factors, in one process: the config's hash, the pass manager's uuid (Inductor's
    FX-graph key) and the backend key all move, and the key names the field."""
    from minivllm_compile.viz.debugging import changed_factors

    def cc(priority=("native",), **kw):
        kernels = KernelConfig(IrOpPriorityConfig.with_default(list(priority)))
        return CompilationConfig(mode=CompilationMode.VLLM_COMPILE, kernel_config=kernels, **kw)

    native, vllm_c, unwrapped = cc(), cc(["vllm_c"]), cc(ir_enable_torch_wrap=False)
    assert len({hash_config(c) for c in (native, vllm_c, unwrapped)}) == 3
    assert cache_keys.passes_uuid(native) != cache_keys.passes_uuid(vllm_c)
    (k_native, f_native), (k_vllm_c, f_vllm_c) = (cache_keys.backend_cache_key(c, "cpu")
                                                  for c in (native, vllm_c))
    assert k_native != k_vllm_c
    priority = "config.compilation.kernel_config.ir_op_priority"
    changed = changed_factors(f_native, f_vllm_c)
    assert f"{priority}.rms_norm" in changed and f"{priority}._impls.rms_norm.vllm_c" in changed
    before, before_cc = hash_config(native.kernel_config.ir_op_priority), hash_config(native)
    # an implementation's uuid is what its provider contributes (edited above, for real)
    from minivllm_compile import ir

    impl = ir.ops.rms_norm.impls["native"]
    old = impl.uuid()
    try:
        impl._uuid = "edited"
        assert hash_config(native.kernel_config.ir_op_priority) != before
        assert hash_config(native) != before_cc
        assert set(changed_factors(f_native, cache_keys.backend_cache_key(native, "cpu")[1])) == {
            f"{priority}._impls.rms_norm.native"}
    finally:
        impl._uuid = old
    assert hash_config(native) == before_cc
