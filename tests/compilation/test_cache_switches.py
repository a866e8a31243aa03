"""The cache's switches do what they say, or refuse with a reason: VLLM_FORCE_AOT_LOAD where nothing
can be loaded, Inductor's force_disable_caches, a cache root with a space in it, and the files a
failed save leaves behind."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch import nn

from minivllm_compile import (
    CompilationConfig,
    CompilationMode,
    compilation_counter,
    support_torch_compile,
)
from minivllm_compile.compilation import aot
from minivllm_compile.models import build_model


@support_torch_compile
class Toy(nn.Module):
    def __init__(self, *, compilation_config=None):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2


@pytest.fixture
def cache_on(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "0")
    for var in ("VLLM_USE_AOT_COMPILE", "VLLM_USE_STANDALONE_COMPILE", "VLLM_FORCE_AOT_LOAD"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path


@pytest.mark.parametrize("env,inductor_config,named", [
    ({"VLLM_DISABLE_COMPILE_CACHE": "1"}, {}, "VLLM_DISABLE_COMPILE_CACHE=1"),
    ({"VLLM_USE_AOT_COMPILE": "0"}, {}, "VLLM_USE_AOT_COMPILE=0"),
    ({"VLLM_USE_STANDALONE_COMPILE": "0"}, {}, "VLLM_USE_STANDALONE_COMPILE=0"),
    ({}, {"force_disable_caches": True}, "force_disable_caches"),
])
def test_force_aot_load_where_nothing_can_be_loaded_is_refused(cache_on, monkeypatch, env,
                                                               inductor_config, named):
    """Each of these turns the AOT load off, so a forced load used to compile silently (vLLM skips
    the load there too: its VLLM_FORCE_AOT_LOAD only acts inside the load). Refused before
    anything is traced, naming both switches."""
    monkeypatch.setenv("VLLM_FORCE_AOT_LOAD", "1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    lm = build_model("llama", num_layers=1, compilation_config=CompilationConfig(
        max_num_batched_tokens=16, inductor_compile_config=inductor_config))
    with (compilation_counter.expect(num_dynamo_traces=0, num_aot_compiles=0, num_graphs_seen=0),
          pytest.raises(RuntimeError, match=f"VLLM_FORCE_AOT_LOAD=1 with .*{named}.*unset one")):
        lm(torch.arange(5), torch.arange(5))


@pytest.mark.compiles
def test_force_disable_caches_acts_as_the_cache_switch(cache_on, caplog):
    """Inductor's force_disable_caches in inductor_compile_config turns the compile cache off, as
    VLLM_DISABLE_COMPILE_CACHE=1 does (vLLM's is_compile_cache_enabled). The AOT save used to run
    anyway and warn "'NoneType' object is not callable" on every start."""
    model = Toy(compilation_config=CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, splitting_ops=[], max_num_batched_tokens=16,
        inductor_compile_config={"force_disable_caches": True}))
    x = torch.ones(4, 2)
    with (caplog.at_level(logging.WARNING, logger="minivllm_compile"),
          compilation_counter.expect(num_aot_artifacts_saved=0, num_aot_artifacts_loaded=0)):
        out = model(x)
    assert torch.allclose(out, model.lin(x) * 2)
    assert "cannot save" not in caplog.text and "NoneType" not in caplog.text, caplog.text
    assert not [p for p in (cache_on / "torch_compile_cache").rglob("*") if p.is_file()]


SPACE_CHILD = r"""
import json, os, sys, torch
from torch import nn
from minivllm_compile import CompilationConfig, CompilationMode, envs, support_torch_compile

@support_torch_compile
class Toy(nn.Module):
    def __init__(self, *, compilation_config=None, k=2.0):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.k = nn.Linear(2, 2), k
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.k

x, errors = torch.ones(4, 2), {}
for k, switch in ((2.0, "VLLM_USE_AOT_COMPILE"), (3.0, "VLLM_USE_STANDALONE_COMPILE")):
    with envs.override(**{switch: "0"}):
        m = Toy(k=k, compilation_config=CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, splitting_ops=[], max_num_batched_tokens=16))
        try:
            errors[switch] = (m(x) - m.lin(x) * k).abs().max().item()
        except Exception as e:
            errors[switch] = f"{type(e).__name__}: {str(e)[-300:]}"
print("RESULT " + json.dumps({"errors": errors,
                              "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}))
"""


@pytest.mark.compiles
def test_a_cache_root_with_a_space_compiles_with_aot_or_standalone_off(tmp_path):
    """With AOT or standalone_compile off, Inductor's own cache moves into the compile cache; its
    C++ compile command does not quote paths, so a space there failed every compile with
    CppCompileError. Inductor's cache then stays where it was, and the compile works."""
    root = tmp_path / "my cache"
    env = {**os.environ, "VLLM_CACHE_ROOT": str(root), "VLLM_DISABLE_COMPILE_CACHE": "0"}
    env.pop("VLLM_USE_AOT_COMPILE", None)
    env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="minivllm_test_inductor_")
    proc = subprocess.run([sys.executable, "-c", SPACE_CHILD], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
    result = next((json.loads(line[7:]) for line in proc.stdout.splitlines()
                   if line.startswith("RESULT ")), None)
    assert proc.returncode == 0 and result is not None, proc.stderr[-3000:]
    assert result["errors"] == {"VLLM_USE_AOT_COMPILE": 0.0,
                                "VLLM_USE_STANDALONE_COMPILE": 0.0}, result
    assert " " not in result["inductor"]
    assert "has a space" in proc.stderr and "Inductor's own cache stays in" in proc.stderr


class _FailingSave:
    """Stands in for an AOTCompiledFunction whose save fails half-way, as torch's does on a full
    disk: its atomic_write_binary leaves the NamedTemporaryFile it was writing behind."""

    def __init__(self, fail: bool):
        self.fail = fail

    def save_compiled_function(self, path: str) -> None:
        with tempfile.NamedTemporaryFile(dir=os.path.dirname(path), delete=False) as f:
            f.write(b"half an artifact")
        if self.fail:
            raise OSError(28, "No space left on device")
        os.replace(f.name, path)


def test_a_failed_save_leaves_no_partial_file_and_the_next_save_sweeps_old_ones(cache_on, caplog):
    """A failed (or killed) save of the AOT file left torch's partial tmpXXXX file beside it, one
    more per start on a full disk. A failed save now removes what it wrote, and a save removes what
    an earlier killed one left."""
    folder = cache_on / "torch_compile_cache" / "torch_aot_compile" / "k" / "rank_0_0"
    folder.mkdir(parents=True)
    (folder / "tmpab12cd34").write_bytes(b"left by a killed save")  # torch's name for it
    (folder / ".model.4242.tmp").write_bytes(b"left by a killed save")  # ours, before this fix
    model = type("M", (), {})()
    model.compilation_config = CompilationConfig()
    model.aot_path = folder / "model"
    model.aot_compiled_fn = _FailingSave(fail=True)
    with caplog.at_level(logging.WARNING, logger="minivllm_compile"):
        aot.save_aot_compiled_function(model)
    assert "cannot save the AOT artifact" in caplog.text and "No space left" in caplog.text
    assert sorted(p.name for p in folder.iterdir() if p.name != ".lock") == []
    (folder / "tmpzz99yy88").write_bytes(b"left by a killed save")
    model.aot_compiled_fn = _FailingSave(fail=False)
    with compilation_counter.expect(num_aot_artifacts_saved=1):
        aot.save_aot_compiled_function(model)
    assert sorted(p.name for p in folder.iterdir() if p.name != ".lock") == ["model"]
    assert Path(model.aot_path).read_bytes() == b"half an artifact"
