"""The three ways a second process starts from the compile cache, as in vLLM 0.34 (seed §10, §11):

    mega AOT artifact (default)  the AOT file holds the pieces' artifacts: no backend, no compile
    AOT, no mega artifact        the AOT file holds the Dynamo graph: the backend runs again, and
                                 each piece and entry is loaded through the CompilerManager's index
    AOT off                      Dynamo traces again; every compile is a hit in Inductor's own
                                 cache, which the standalone adaptor moved into the compile cache

Each start is a real subprocess (a fresh process is the only honest second start)."""

import ast
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CHILD = r"""
import json, os, sys, torch
from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter
from minivllm_compile.models import build_model
if os.environ.get("READ_ONLY_CACHE") == "1":  # a cache this process may read but not write
    from minivllm_compile.compilation import cache_files
    def refuse(path, data):
        raise PermissionError(13, "Permission denied", str(path))
    cache_files.atomic_write = refuse
cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, max_num_batched_tokens=16,
                       compile_sizes=[4])
lm = build_model("llama", num_layers=int(os.environ.get("LAYERS", "1")), compilation_config=cc)
out = lm(torch.arange(7), torch.arange(7))
torch.save(out, sys.argv[1])
from torch._dynamo.utils import counters
print("COUNTERS " + json.dumps({**vars(compilation_counter), "inductor": dict(counters["inductor"]),
                                "aot_autograd": dict(counters["aot_autograd"]),
                                "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}))
"""

# one layer: two compiled pieces around the attention; size 4 and range [1, 16]
PIECES, ENTRIES = 2, 2


def start(root: Path, out: Path, env: dict
          | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    environ = {**os.environ, "VLLM_CACHE_ROOT": str(root), "VLLM_DISABLE_COMPILE_CACHE": "0",
               **(env or {})}
    for var in ("VLLM_USE_AOT_COMPILE", "VLLM_USE_MEGA_AOT_ARTIFACT", "VLLM_FORCE_AOT_LOAD"):
        if var not in (env or {}):
            environ.pop(var, None)  # the defaults, unless the test sets one
    proc = subprocess.run([sys.executable, "-c", CHILD, str(out)], env=environ, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, next(json.loads(line[9:]) for line in proc.stdout.splitlines()
                      if line.startswith("COUNTERS "))


def rank_dirs(root: Path) -> list[Path]:
    return sorted((root / "torch_compile_cache").glob("*/rank_0_0"))


def same(a: Path, b: Path) -> bool:
    return torch.equal(torch.load(a), torch.load(b))  # bitwise


@pytest.mark.compiles
def test_the_mega_artifact_loads_without_the_backend(tmp_path, seed_isa_record):
    """The default on torch >= 2.12: the pieces are compiled with standalone_compile(aot=True) and
    their bytes go into the AOT file; nothing of them is saved beside it, and a load rebuilds the
    stitching graph's pieces from the file alone."""
    seed_isa_record(tmp_path)  # conftest.py: no ISA probe in the first start
    _, first = start(tmp_path, tmp_path / "1.pt")
    assert (first["num_inductor_compiles"] == PIECES * ENTRIES
            and first["num_aot_artifacts_saved"] == 1)
    # counted as vLLM counts them: one per distinct artifact put into the AOT file's store
    assert (first["num_compiled_artifacts_saved"] == PIECES * ENTRIES
            and first["num_cache_entries_updated"] == 0)
    (backbone,) = [d / "backbone" for d in rank_dirs(tmp_path)]
    assert not list(backbone.glob("artifact_*")) and not (
        backbone / "vllm_compile_cache.py").exists()
    for d in rank_dirs(tmp_path):
        shutil.rmtree(d)  # the AOT file alone must do
    _, second = start(tmp_path, tmp_path / "2.pt")
    assert second["num_aot_artifacts_loaded"] == 1 and second["num_aot_compiles"] == 0
    assert second["num_graphs_seen"] == 0 and second["num_backend_compilations"] == 0
    assert second["num_inductor_compiles"] == 0
    assert second["num_compiled_artifacts_loaded"] == PIECES * ENTRIES
    assert same(tmp_path / "1.pt", tmp_path / "2.pt")


@pytest.mark.compiles
def test_the_mega_artifact_holds_identical_layers_once(tmp_path, seed_isa_record):
    """vLLM's StandaloneCompiledArtifacts keys each entry by its bytes' SHA-256: the middle pieces
    of identical layers compile to one artifact (CompilerManager reuses it), stored, counted and
    loaded once. Three layers: pieces first, middle x2, last, each for 2 entries; 3
    x 2 distinct artifacts."""
    seed_isa_record(tmp_path)  # conftest.py: no ISA probe in the first start
    env = {"LAYERS": "3"}
    _, first = start(tmp_path, tmp_path / "1.pt", env)
    assert first["num_inductor_compiles"] == 4 * ENTRIES  # every compile call, as vLLM counts them
    assert first["num_compiled_artifacts_saved"] == 3 * ENTRIES
    _, second = start(tmp_path, tmp_path / "2.pt", env)
    assert second["num_aot_artifacts_loaded"] == 1 and second["num_inductor_compiles"] == 0
    assert second["num_compiled_artifacts_loaded"] == 3 * ENTRIES
    assert same(tmp_path / "1.pt", tmp_path / "2.pt")


@pytest.mark.compiles
def test_without_the_mega_artifact_the_backend_runs_again_and_loads_from_its_index(tmp_path,
                                                                                   seed_isa_record):
    seed_isa_record(tmp_path / "a")  # conftest.py: no ISA probe in the first start
    env = {"VLLM_USE_MEGA_AOT_ARTIFACT": "0"}
    _, first = start(tmp_path / "a", tmp_path / "1.pt", env)
    assert first["num_inductor_compiles"] == PIECES * ENTRIES
    assert (first["num_compiled_artifacts_saved"] == first["num_cache_entries_updated"]
            == PIECES * ENTRIES)
    (rank,) = rank_dirs(tmp_path / "a")
    index = ast.literal_eval((rank / "backbone" / "vllm_compile_cache.py").read_text())
    assert sorted(index) == sorted(((r, i, "inductor_standalone") for r in ((1, 16), (4, 4))
                                    for i in range(PIECES)))
    for (r, i, _), value in index.items():
        key, path = value["graph_handle"]
        assert key == f"artifact_compile_range_{r[0]}_{r[1]}_subgraph_{i}" and (
            rank / "backbone" / key).exists()
        assert not Path(path).is_absolute()  # relative to the cache root: a moved cache still loads
    shutil.move(tmp_path / "a", tmp_path / "b")
    proc, second = start(tmp_path / "b", tmp_path / "2.pt", env)
    assert second["num_aot_artifacts_loaded"] == 1 and second["num_aot_compiles"] == 0
    assert second["num_graphs_seen"] == 1  # VllmBackend ran on the saved Dynamo graph
    # every piece and entry went through it
    assert second["num_backend_compilations"] == PIECES * ENTRIES
    # ... and was found in the index
    assert second["num_compiled_artifacts_loaded"] == PIECES * ENTRIES
    assert second["num_inductor_compiles"] == 0 and second["num_cache_entries_updated"] == 0
    assert "unusable" not in proc.stderr
    assert same(tmp_path / "1.pt", tmp_path / "2.pt")


@pytest.mark.compiles
def test_a_cache_that_cannot_be_written_is_still_read(tmp_path, seed_isa_record):
    """A shared cache another user filled: this process cannot write into it (its first write, the
    backend's cache_key_factors.json, fails), so it says so once and loads every piece from it."""
    seed_isa_record(tmp_path)  # conftest.py: no ISA probe in the first start
    env = {"VLLM_USE_MEGA_AOT_ARTIFACT": "0"}
    start(tmp_path, tmp_path / "1.pt", env)
    proc, c = start(tmp_path, tmp_path / "2.pt", {**env, "READ_ONLY_CACHE": "1"})
    assert proc.stderr.count("reading from it only") == 1
    assert c["num_aot_artifacts_loaded"] == 1 and c["num_inductor_compiles"] == 0
    assert c["num_compiled_artifacts_loaded"] == PIECES * ENTRIES
    assert same(tmp_path / "1.pt", tmp_path / "2.pt")


@pytest.mark.compiles
def test_a_corrupt_piece_or_index_is_reported_once_and_rebuilt(tmp_path, seed_isa_record):
    seed_isa_record(tmp_path)  # conftest.py: no ISA probe in the first start
    env = {"VLLM_USE_MEGA_AOT_ARTIFACT": "0"}
    start(tmp_path, tmp_path / "1.pt", env)
    (rank,) = rank_dirs(tmp_path)
    piece = rank / "backbone" / "artifact_compile_range_1_16_subgraph_1"
    piece.write_bytes(b"not an artifact")
    proc, c = start(tmp_path, tmp_path / "2.pt", env)
    assert proc.stderr.count("is unusable") == 1  # that piece alone: the AOT file still loads
    assert c["num_aot_artifacts_loaded"] == 1 and c["num_inductor_compiles"] == 1
    assert (c["num_compiled_artifacts_loaded"] == PIECES * ENTRIES - 1
            and c["num_compiled_artifacts_saved"] == 1)
    assert same(tmp_path / "1.pt", tmp_path / "2.pt")
    proc, c = start(tmp_path, tmp_path / "3.pt", env)  # rebuilt: everything loads again
    assert "unusable" not in proc.stderr and c["num_inductor_compiles"] == 0
    index = rank / "backbone" / "vllm_compile_cache.py"
    index.write_text(index.read_text()[:60])  # truncated
    proc, c = start(tmp_path, tmp_path / "4.pt", env)
    assert proc.stderr.count("is unusable") == 1 and c["num_inductor_compiles"] == PIECES * ENTRIES
    assert len(ast.literal_eval(index.read_text())) == PIECES * ENTRIES  # rewritten
    assert same(tmp_path / "1.pt", tmp_path / "4.pt")
    piece.write_bytes(b"not an artifact")  # and a forced load does not compile: an error
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "5.pt")],
                          capture_output=True, text=True,
                          env={**os.environ, "VLLM_CACHE_ROOT": str(tmp_path),
                               "VLLM_DISABLE_COMPILE_CACHE": "0",
                               "VLLM_FORCE_AOT_LOAD": "1", **env}, timeout=600)
    assert proc.returncode != 0 and "VLLM_FORCE_AOT_LOAD=1 and the AOT artifact" in proc.stderr


@pytest.mark.compiles
def test_without_aot_compile_inductors_own_cache_serves_the_second_start(tmp_path, seed_isa_record):
    """VLLM_USE_AOT_COMPILE=0: as vLLM's standalone adaptor, nothing of ours is saved to load (no
    artifact, no index, no AOT file), and Inductor's and Triton's caches move into the rank's
    folder: the second process traces again, and every standalone_compile hits Inductor's cache."""
    seed_isa_record(tmp_path / "root")  # conftest.py: no ISA probe in the first start
    env = {"VLLM_USE_AOT_COMPILE": "0", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "elsewhere")}
    _, first = start(tmp_path / "root", tmp_path / "1.pt", env)
    assert first["num_aot_compiles"] == 0 and first["num_inductor_compiles"] == PIECES * ENTRIES
    assert first["num_compiled_artifacts_saved"] == first["num_cache_entries_updated"] == 0
    (rank,) = rank_dirs(tmp_path / "root")
    assert first["inductor_cache_dir"] == str(rank / "inductor_cache") and (
        rank / "triton_cache").is_dir()
    assert not list(rank.glob("*/artifact_*")) and not list(rank.glob("*/vllm_compile_cache.py"))
    assert not (tmp_path / "root" / "torch_compile_cache" / "torch_aot_compile").exists()
    assert not list((tmp_path / "elsewhere").rglob("*"))  # nothing went where the variable pointed
    _, second = start(tmp_path / "root", tmp_path / "2.pt", env)
    assert second["num_graphs_seen"] == 1 and second["num_aot_artifacts_loaded"] == 0
    assert second["num_backend_compilations"] == second["num_inductor_compiles"] == PIECES * ENTRIES
    assert second["num_compiled_artifacts_loaded"] == 0
    # every compile found in Inductor's caches under the rank's folder
    assert second["aot_autograd"].get("autograd_cache_hit") == PIECES * ENTRIES
    assert second["inductor"].get("fxgraph_cache_hit") == PIECES * ENTRIES
    assert not second["inductor"].get(
        "fxgraph_cache_miss") and not second["aot_autograd"].get("autograd_cache_miss")
    assert same(tmp_path / "1.pt", tmp_path / "2.pt")


def test_the_switches_default_as_vllms(monkeypatch):
    """use_aot_compile(): on for torch >= 2.10 unless the cache is off; use_mega_aot_artifact(): on
    for torch >= 2.12 when AOT compile is on. A value set explicitly wins."""
    from minivllm_compile import envs

    for var in ("VLLM_USE_AOT_COMPILE", "VLLM_USE_MEGA_AOT_ARTIFACT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "0")
    assert envs.VLLM_USE_AOT_COMPILE and envs.VLLM_USE_MEGA_AOT_ARTIFACT  # torch 2.13 here
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "0")
    assert not envs.VLLM_USE_MEGA_AOT_ARTIFACT
    monkeypatch.setenv("VLLM_USE_MEGA_AOT_ARTIFACT", "1")
    assert envs.VLLM_USE_MEGA_AOT_ARTIFACT
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE")
    monkeypatch.setenv("VLLM_USE_MEGA_AOT_ARTIFACT", "0")
    assert envs.VLLM_USE_AOT_COMPILE and not envs.VLLM_USE_MEGA_AOT_ARTIFACT
    monkeypatch.delenv("VLLM_USE_MEGA_AOT_ARTIFACT")
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    assert not envs.VLLM_USE_AOT_COMPILE and not envs.VLLM_USE_MEGA_AOT_ARTIFACT
