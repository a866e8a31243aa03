"""A saved artifact is loaded only if it is what was saved, for this model: a flipped bit, another
model's file at this model's key path, or swapped piece files are each noticed on load, reported
once, and rebuilt, and the next start loads the rebuilt file with nobody deleting anything.
Each case saves in one process and loads in another; the loading process runs each step on a fresh
model, first with VLLM_FORCE_AOT_LOAD=1 (a refused load is an error naming why, a trusted bad one
gives wrong numbers), then without it (warn, rebuild), then forced again
(the rebuilt file loads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TOY = '''
import torch
from torch import nn
from minivllm_compile import support_torch_compile


@support_torch_compile
class Toy(nn.Module):
    def __init__(self, *, compilation_config=None, k=2.0):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.k = nn.Linear(2, 2), k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * self.k
'''

CHILD = r"""
import json, os, sys, torch
sys.path.insert(0, sys.argv[2])
import toy_integrity
from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter

spec = json.loads(sys.argv[1])
results = []
for k, force in spec["steps"]:
    os.environ["VLLM_FORCE_AOT_LOAD"] = force
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, splitting_ops=[],
                           max_num_batched_tokens=16, compile_sizes=spec.get("sizes", []))
    m = toy_integrity.Toy(compilation_config=cc, k=k)
    before = dict(vars(compilation_counter))
    try:
        diff = max((m(x) - toy_integrity.Toy.forward(m, x)).abs().max().item()
                   for x in (torch.arange(8.0).view(4, 2), torch.arange(12.0).view(6, 2) - 5))
        error = None
    except Exception as e:
        diff, error = None, f"{type(e).__name__}: {e}"
    results.append({"diff": diff, "error": error, "aot_path": str(getattr(m, "aot_path", "")), **{
        n: compilation_counter.__dict__[n] - before[n]
        for n in ("num_aot_artifacts_loaded", "num_aot_compiles", "num_inductor_compiles")}})
print("RESULT " + json.dumps(results))
"""


@pytest.fixture
def toy(tmp_path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    (src / "toy_integrity.py").write_text(TOY)
    return src


def run(root: Path, src: Path, inductor: Path, steps: list, sizes: list | None = None,
        mega: str = "1") -> tuple[subprocess.CompletedProcess, list]:
    env = {**os.environ, "VLLM_CACHE_ROOT": str(root), "VLLM_DISABLE_COMPILE_CACHE": "0",
           "TORCHINDUCTOR_CACHE_DIR": str(inductor), "VLLM_USE_MEGA_AOT_ARTIFACT": mega}
    env.pop("VLLM_USE_AOT_COMPILE", None)
    spec = {"steps": steps, "sizes": sizes or []}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec), str(src)], env=env,
                          capture_output=True, text=True, timeout=600,
                          check=False)
    results = next((json.loads(line[7:]) for line in proc.stdout.splitlines()
                    if line.startswith("RESULT ")), None)
    assert proc.returncode == 0 and results is not None, proc.stderr[-3000:]
    return proc, results


def aot_files(root: Path) -> list[Path]:
    return sorted((root / "torch_compile_cache" / "torch_aot_compile").glob("*/rank_0_0/model"))


def refused_then_rebuilt_then_loaded(proc, results, why: str) -> None:
    forced, rebuilt, loaded = results
    assert forced["error"] and why in forced["error"], forced  # it used to load, and be wrong
    assert forced["num_aot_compiles"] == 0, forced
    assert why in proc.stderr and "afresh" in proc.stderr, proc.stderr[-2000:]  # warned, once
    assert rebuilt["error"] is None and rebuilt["diff"] == 0.0, rebuilt
    assert loaded["error"] is None and loaded["diff"] == 0.0, loaded
    assert loaded["num_aot_artifacts_loaded"] == 1 and loaded["num_inductor_compiles"] == 0, loaded


@pytest.mark.compiles
def test_a_flipped_bit_in_the_aot_file_is_noticed_and_the_file_rebuilt(tmp_path, toy,
                                                                       seed_isa_record):
    """Loaded where Inductor's own cache is empty (another machine, after a reboot), a flipped bit
    in an artifact's bytes used to give wrong numbers with no warning: the artifact's SHA-256 was
    recorded but never checked. The saved state's SHA-256 and each artifact's are checked now."""
    seed_isa_record(tmp_path / "cache")  # conftest.py: no ISA probe in the first start
    root = tmp_path / "cache"
    _, (first,) = run(root, toy, tmp_path / "inductor1", [(2.0, "0")])
    assert first["num_aot_compiles"] == 1 and first["diff"] == 0.0, first
    (path,) = aot_files(root)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10  # the middle of the file: the pieces' bytes are most of it
    path.write_bytes(bytes(data))
    proc, results = run(root, toy, tmp_path / "inductor2", [(2.0, "1"), (2.0, "0"), (2.0, "1")])
    refused_then_rebuilt_then_loaded(proc, results, "SHA-256")


@pytest.mark.compiles
def test_another_models_file_at_this_models_key_path_is_noticed(tmp_path, toy, seed_isa_record):
    """A file copied to the wrong key path (a cache assembled by hand, a bad sync) used to load and
    compute the other model's function. The artifact records which model
    and key it was built for."""
    seed_isa_record(tmp_path / "cache")  # conftest.py: no ISA probe in the first start
    root, inductor = tmp_path / "cache", tmp_path / "inductor"
    _, results = run(root, toy, inductor, [(2.0, "0"), (3.0, "0")])
    assert [r["num_aot_compiles"] for r in results] == [1, 1]
    mine, other = (Path(r["aot_path"]) for r in results)
    assert mine != other and aot_files(root) == sorted([mine, other])  # k is in the key
    mine.write_bytes(other.read_bytes())
    proc, results = run(root, toy, inductor, [(2.0, "1"), (2.0, "0"), (2.0, "1")])
    refused_then_rebuilt_then_loaded(proc, results, "it was built for another model")


@pytest.mark.compiles
def test_swapped_piece_files_without_the_mega_artifact_are_noticed(tmp_path, toy, seed_isa_record):
    """VLLM_USE_MEGA_AOT_ARTIFACT=0 keeps each piece's artifact in a file of its own, found through
    the CompilerManager's index. Two of them swapped used to load, and then fail at every call of
    every start until someone deleted them. The index records each file's SHA-256 now."""
    seed_isa_record(tmp_path / "cache")  # conftest.py: no ISA probe in the first start
    root, inductor = tmp_path / "cache", tmp_path / "inductor"
    _, (first,) = run(root, toy, inductor, [(2.0, "0")], sizes=[4], mega="0")
    assert first["num_aot_compiles"] == 1 and first["diff"] == 0.0, first
    pieces = sorted((root / "torch_compile_cache").glob(
        "*/rank_0_0/backbone/artifact_compile_range_*"))
    assert [p.name for p in pieces] == ["artifact_compile_range_1_16_subgraph_0",
                                        "artifact_compile_range_4_4_subgraph_0"]
    a, b = (p.read_bytes() for p in pieces)
    pieces[0].write_bytes(b)
    pieces[1].write_bytes(a)
    proc, results = run(root, toy, inductor, [(2.0, "1"), (2.0, "0"), (2.0, "1")],
                        sizes=[4], mega="0")
    refused_then_rebuilt_then_loaded(proc, results, "is not the one saved")
    assert results[1]["num_inductor_compiles"] == 2  # both pieces compiled again, and saved
