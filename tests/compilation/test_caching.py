"""AOT compile and the persistent cache (seed §10, §11): save in one process, load in another,
invalidate, and survive bad files and concurrent writers. Each process is a real subprocess."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter
from minivllm_compile.compilation import cache_keys, cpu_isa
from minivllm_compile.config import hash_factors
from minivllm_compile.models import build_model
from minivllm_compile.viz.cache import describe_cache

# every test here compiles, or shares a module fixture that does: whole suite only
pytestmark = pytest.mark.compiles

CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[3]) if len(sys.argv) > 3 else None
from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter
spec = json.loads(sys.argv[1])
cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, max_num_batched_tokens=16,
                       **spec.get("cc", {}))
base_probes = []  # Inductor's per-process CPU ISA probe, the base check of each ISA (cpu_isa.py)
from torch._inductor import cpu_vec_isa
check_build = cpu_vec_isa.VecISA.check_build
def counting(self, code):
    base_probes.append(code == cpu_vec_isa.VecISA._avx_code)
    return check_build(self, code)
cpu_vec_isa.VecISA.check_build = counting
if spec.get("toy"):
    import toy_model
    model = toy_model.Toy(compilation_config=cc)
    out = model(torch.arange(12, dtype=torch.float32).view(6, 2))
else:
    from minivllm_compile.models import build_model
    lm = build_model("llama", num_layers=1, compilation_config=cc)
    out = lm(torch.arange(7), torch.arange(7))
torch.save(out, sys.argv[2])
import os
from torch._dynamo.utils import counters
print("COUNTERS " + json.dumps({**vars(compilation_counter), "base_isa_probes": sum(base_probes),
                                **{k: counters["inductor"][k]
                                   for k in ("fxgraph_cache_hit", "fxgraph_cache_miss")},
                                "inductor_cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}))
"""


def run_child(root: Path, out: Path, spec: dict | None = None, env: dict | None = None,
              extra_path: str = ""):
    environ = {**os.environ, "VLLM_CACHE_ROOT": str(root), "VLLM_DISABLE_COMPILE_CACHE": "0",
               **(env or {})}
    args = [sys.executable, "-c", CHILD, json.dumps(spec or {}), str(out)] + (
        [extra_path] if extra_path else [])
    proc = subprocess.run(args, env=environ, capture_output=True, text=True, timeout=600)
    counters = next((json.loads(line[9:]) for line in proc.stdout.splitlines()
                     if line.startswith("COUNTERS ")), None)
    return proc, counters


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Process 1: compile the 1-layer tiny Llama and save everything."""
    root = tmp_path_factory.mktemp("cache")
    proc, counters = run_child(root, root / "out1.pt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root, counters


def test_process_two_loads_without_tracing_or_compiling(saved, tmp_path):
    root, first = saved
    assert first["num_aot_compiles"] == 1 and first["num_aot_artifacts_saved"] == 1
    # the mega artifact (the default on torch >= 2.12): the pieces' bytes are in the AOT file
    # (counted there, as vLLM counts them), none saved beside it
    assert first["num_inductor_compiles"] == 2 and first["num_compiled_artifacts_saved"] == 2
    proc, c = run_child(root, tmp_path / "out2.pt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert c["num_aot_artifacts_loaded"] == 1
    assert (c["num_inductor_compiles"] == 0 and c["num_graphs_seen"] == 0
            and c["num_aot_compiles"] == 0)
    assert c["num_compiled_artifacts_loaded"] == 2
    assert torch.equal(torch.load(root / "out1.pt"), torch.load(tmp_path / "out2.pt"))  # bitwise


def test_the_compile_fx_adaptor_keeps_inductors_own_cache_in_the_compile_cache(tmp_path):
    """VLLM_USE_STANDALONE_COMPILE=0: compile_fx saves no artifact an AOT file could point at, so
    none is saved (a warning says so); and, as vLLM's InductorAdaptor.initialize_cache does,
    Inductor's and Triton's caches move under the rank's directory. A second process traces again,
    and every Inductor compile is an FX-graph-cache hit found there."""
    elsewhere = tmp_path / "elsewhere"
    env = {"VLLM_USE_STANDALONE_COMPILE": "0", "TORCHINDUCTOR_CACHE_DIR": str(elsewhere)}
    root = tmp_path / "root"
    proc, first = run_child(root, tmp_path / "out1.pt", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "VLLM_USE_AOT_COMPILE is ignored with VLLM_USE_STANDALONE_COMPILE=0" in proc.stderr
    assert first["num_aot_compiles"] == 0 and first["num_aot_artifacts_saved"] == 0
    assert (first["num_inductor_compiles"] == first["fxgraph_cache_miss"] == 2
            and first["fxgraph_cache_hit"] == 0)
    (rank,) = (root / "torch_compile_cache").glob("*/rank_0_0")
    assert first["inductor_cache_dir"] == str(rank / "inductor_cache")
    assert (rank / "inductor_cache" / "fxgraph").is_dir() and (rank / "triton_cache").is_dir()
    assert not list(elsewhere.rglob("*"))  # nothing went to where the variable pointed before
    assert not (root / "torch_compile_cache" / "torch_aot_compile").exists()
    tree = describe_cache(root / "torch_compile_cache")  # Inductor's cache is one line there
    assert ("inductor_cache/" in tree and "fxgraph" not in tree
            and "files: Inductor's FX graph cache" in tree)

    proc, second = run_child(root, tmp_path / "out2.pt", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert second["num_graphs_seen"] == 1 and second["num_aot_artifacts_loaded"] == 0
    assert (second["num_inductor_compiles"] == second["fxgraph_cache_hit"] == 2
            and second["fxgraph_cache_miss"] == 0)
    assert torch.equal(torch.load(tmp_path / "out1.pt"), torch.load(tmp_path / "out2.pt"))


def test_which_adaptors_redirect_inductors_cache(tmp_path, monkeypatch):
    """As vLLM 0.34: compile_fx's adaptor always (its graphs live in Inductor's cache), the
    standalone one only with AOT compile off (with it on, its own artifacts are what
    a later process loads). A Triton cache the caller chose is kept; one this function chose for
    an earlier model is not."""
    from minivllm_compile.compilation.compiler_interface import (
        InductorAdaptor,
        InductorStandaloneAdaptor,
    )

    rank, before = tmp_path / "h" / "rank_0_0", str(tmp_path / "before")
    for make in (InductorAdaptor, lambda: InductorStandaloneAdaptor(use_aot_compile=False)):
        for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            # restored after the test: the redirection is process-wide
            monkeypatch.setenv(var, before)
        make().initialize_cache(str(rank / "backbone"), disable_cache=True, prefix="backbone")
        InductorStandaloneAdaptor(use_aot_compile=True).initialize_cache(str(rank / "backbone"),
                                                                         prefix="backbone")
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == os.environ["TRITON_CACHE_DIR"] == before
        adaptor = make()
        adaptor.initialize_cache(str(rank / "backbone"), prefix="backbone")
        assert adaptor.cache_dir == str(rank / "backbone")
        # shared by every prefix
        assert Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) == rank / "inductor_cache"
        assert os.environ["TRITON_CACHE_DIR"] == before  # the caller's, kept
        monkeypatch.delenv("TRITON_CACHE_DIR")
        make().initialize_cache(str(rank / "backbone"), prefix="backbone")
        assert Path(os.environ["TRITON_CACHE_DIR"]) == rank / "triton_cache"
        assert (rank / "inductor_cache").is_dir() and (rank / "triton_cache").is_dir()
        other = tmp_path / "h2" / "rank_0_0"  # another model: this function's own default moves
        make().initialize_cache(str(other / "backbone"), prefix="backbone")
        assert Path(os.environ["TRITON_CACHE_DIR"]) == other / "triton_cache"


def test_the_cache_is_laid_out_as_vllm_lays_it(saved):
    root, _ = saved
    base = root / "torch_compile_cache"
    aot_files = list((base / "torch_aot_compile").glob("*/rank_0_0/model"))
    assert len(aot_files) == 1
    backend_dirs = [d for d in base.glob("*/rank_0_0/backbone")]
    assert len(backend_dirs) == 1
    d = backend_dirs[0]
    assert (d / "computation_graph.py").read_text().count("class GraphModule") >= 1
    text = (d / "cache_key_factors.json").read_text()
    factors = json.loads(text)
    # vLLM 0.34's top-level keys: the factors themselves, and the hashes of three of them
    assert list(factors) == ["code", "code_hash", "compiler", "compiler_hash", "config",
                             "config_hash", "env"]
    assert text == json.dumps(json.loads(text, object_pairs_hook=lambda kv: dict(sorted(kv))),
                              indent=1)  # sorted at every level, as vLLM writes it
    for part in ("config", "code", "compiler"):
        assert factors[f"{part}_hash"] == hash_factors(factors[part])
    assert d.parent.parent.name == hash_factors(
        {k: factors[k] for k in ("env", "config", "code", "compiler")})[:10]  # the folder's name
    assert "VLLM_USE_AOT_COMPILE" in factors["env"] and "VLLM_CACHE_ROOT" not in factors["env"]
    config = factors["config"]
    assert set(config) == {"model", "compilation", "parallel", "device", "version"}
    assert config["model"]["tag"] == "backbone"
    assert config["model"]["inputs"]["input_ids"]["dtype"] == "torch.int64"
    assert config["model"]["constants"]["norm.eps"] == repr(1e-5)
    assert config["compilation"]["max_num_batched_tokens"] == 16
    assert config["compilation"]["pass_config"]["fuse_norm_quant"] is False
    assert config["parallel"] == {"tensor_parallel_size": 1}
    assert config["device"] == {"device_type": "cpu"}  # where the traced graph's inputs live
    assert list(factors["code"]) == ["files"]
    files = factors["code"]["files"]
    assert [f["path"] for f in files] == sorted(f["path"] for f in files)
    assert all(set(f) == {"path", "hash"} for f in files if not f["path"].startswith("<"))
    assert any(f["path"].endswith("models/llama.py") and len(f["hash"]) == 64 for f in files)
    assert list(factors["compiler"]) == ["inductor"]
    assert factors["compiler"]["inductor"]["torch_version"] == torch.__version__
    # the mega artifact: the pieces are inside the AOT file (the other
    # layout: tests/compilation/test_aot_paths.py)
    assert not list(d.glob("artifact_*")) and not (d / "vllm_compile_cache.py").exists()
    text = describe_cache(root / "torch_compile_cache")
    assert "cache_key_factors.json" in text and "· code: " in text and "· config.model: " in text


def test_a_corrupt_artifact_is_reported_once_and_rebuilt(saved, tmp_path):
    import shutil

    root = tmp_path / "cache"
    shutil.copytree(saved[0], root)
    model_file = next((root / "torch_compile_cache" / "torch_aot_compile").glob("*/rank_0_0/model"))
    model_file.write_bytes(model_file.read_bytes()[:100])  # truncated
    proc, c = run_child(root, tmp_path / "out.pt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("is unusable") == 1
    assert c["num_aot_compiles"] == 1 and c["num_aot_artifacts_loaded"] == 0
    assert torch.equal(torch.load(saved[0] / "out1.pt"), torch.load(tmp_path / "out.pt"))
    proc, c = run_child(root, tmp_path / "out3.pt")  # and the rebuilt one loads
    assert c["num_aot_artifacts_loaded"] == 1
    # ... and is an error when the load is forced (a corrupt piece or index without the mega
    # artifact: tests/compilation/test_aot_paths.py)
    model_file.write_bytes(model_file.read_bytes()[:100])
    proc, _ = run_child(root, tmp_path / "out5.pt", env={"VLLM_FORCE_AOT_LOAD": "1"})
    assert proc.returncode != 0 and "VLLM_FORCE_AOT_LOAD=1 and the AOT artifact" in proc.stderr


@pytest.mark.skipif(cpu_isa._claimed() is None, reason="Inductor probes vector ISAs only on x86 "
                                                       "Linux")
def test_the_cpu_isa_probe_runs_once_per_machine_not_once_per_process(saved, tmp_path):
    import shutil

    root, first = saved
    record = root / cpu_isa.RECORD_NAME
    stored = json.loads(record.read_text())
    assert list(stored) == [cpu_isa.probe_key()]
    assert first["base_isa_probes"] > 0  # the compiling process probed, and stored the answer
    proc, c = run_child(root, tmp_path / "out.pt")  # a loading process replays it
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert c["num_aot_artifacts_loaded"] == 1 and c["base_isa_probes"] == 0
    assert torch.equal(torch.load(root / "out1.pt"), torch.load(tmp_path / "out.pt"))
    # an unreadable record: reported once, Inductor probes, the record is rewritten
    copy = tmp_path / "cache"
    shutil.copytree(root, copy)
    (copy / cpu_isa.RECORD_NAME).write_text("{not json")
    proc, c = run_child(copy, tmp_path / "out2.pt")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("is unreadable") == 1 and c["base_isa_probes"] > 0
    assert json.loads((copy / cpu_isa.RECORD_NAME).read_text()) == stored


def test_the_isa_record_obeys_disable_compile_cache(tmp_path, monkeypatch):
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    valid_vec_isa_list()  # this process has probed (or had already)
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "0")
    assert cpu_isa.replay() is False  # nothing to replay once the list is settled
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    cpu_isa.remember()
    assert not (tmp_path / cpu_isa.RECORD_NAME).exists()
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "0")
    cpu_isa.remember()
    if cpu_isa._claimed() is not None:
        assert json.loads((tmp_path / cpu_isa.RECORD_NAME).read_text()) == {
            cpu_isa.probe_key(): [str(isa) for isa in valid_vec_isa_list()]}


def test_a_failing_isa_shortcut_never_fails_the_compile(tmp_path, monkeypatch):
    def no_compiler():
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "0")
    monkeypatch.setattr(cpu_isa, "probe_key", no_compiler)
    ran = []
    with cpu_isa.remembered_probe():
        ran.append(True)
    assert ran == [True] and not (tmp_path / cpu_isa.RECORD_NAME).exists()


def test_two_processes_compiling_at_once_leave_a_loadable_cache(tmp_path):
    environ = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path), "VLLM_DISABLE_COMPILE_CACHE": "0"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, "{}", str(tmp_path / f"o{i}.pt")],
                              env=environ,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    for p in procs:
        p.wait(timeout=600)
        assert p.returncode == 0, p.stderr.read()[-3000:]
    proc, c = run_child(tmp_path, tmp_path / "o3.pt")
    assert c["num_aot_artifacts_loaded"] == 1 and c["num_inductor_compiles"] == 0
    # no half files: our temporaries are ".<name>.*", torch's are "tmp*"; only the locks stay
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and p.name != ".lock"
                 and p.name.startswith((".", "tmp"))]
    assert not leftovers, leftovers


def test_mega_artifact_is_one_file(tmp_path):
    import shutil

    env = {"VLLM_USE_MEGA_AOT_ARTIFACT": "1"}
    proc, c = run_child(tmp_path, tmp_path / "o1.pt", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for d in (tmp_path / "torch_compile_cache").glob("*/rank_0_0"):
        shutil.rmtree(d)  # the backend's folders are gone: the AOT file alone must do
    proc, c = run_child(tmp_path, tmp_path / "o2.pt", env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert c["num_aot_artifacts_loaded"] == 1 and c["num_inductor_compiles"] == 0
    assert c["num_graphs_seen"] == 0 and c["num_backend_compilations"] == 0  # no backend ran
    assert torch.equal(torch.load(tmp_path / "o1.pt"), torch.load(tmp_path / "o2.pt"))


TOY = '''
import torch
from torch import nn
from minivllm_compile import support_torch_compile


def helper(x):
    return x * SCALE


SCALE = 2.0


@support_torch_compile
class Toy(nn.Module):
    def __init__(self, *, compilation_config=None):
        super().__init__()
        torch.manual_seed(0)  # the same weights in every process
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return helper(self.lin(x))
'''


def test_editing_a_traced_file_invalidates_the_cache(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "toy_model.py").write_text(TOY)
    root = tmp_path / "cache"
    spec = {"toy": True, "cc": {"splitting_ops": []}}
    proc, c = run_child(root, tmp_path / "a.pt", spec, extra_path=str(src))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc, c = run_child(root, tmp_path / "b.pt", spec, extra_path=str(src))
    assert c["num_aot_artifacts_loaded"] == 1  # unchanged source: loaded
    (src / "toy_model.py").write_text(TOY.replace("return x * SCALE", "return x * SCALE + 1"))
    proc, c = run_child(root, tmp_path / "c.pt", spec, extra_path=str(src))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "traced source changed" in proc.stderr and c["num_aot_compiles"] == 1
    torch.testing.assert_close(torch.load(tmp_path / "c.pt"), torch.load(tmp_path / "a.pt") + 1)
    backend_dirs = list((root / "torch_compile_cache").glob("*/rank_0_0/backbone"))
    assert len(backend_dirs) == 2  # the traced file's content is a factor of the backend's key


def test_force_aot_load_with_nothing_saved_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "0")
    monkeypatch.setenv("VLLM_FORCE_AOT_LOAD", "1")
    lm = build_model("llama", num_layers=1,
                     compilation_config=CompilationConfig(max_num_batched_tokens=16))
    with pytest.raises(FileNotFoundError, match="no AOT artifact at .*run once "
                                                "without VLLM_FORCE_AOT_LOAD"):
        lm(torch.arange(5), torch.arange(5))


def test_force_aot_load_with_the_cache_disabled_is_refused(tmp_path, monkeypatch):
    """vLLM skips the load and compiles; a forced load that compiles is what the switch forbids."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    monkeypatch.setenv("VLLM_FORCE_AOT_LOAD", "1")
    lm = build_model("llama", num_layers=1,
                     compilation_config=CompilationConfig(max_num_batched_tokens=16))
    with pytest.raises(RuntimeError, match="VLLM_FORCE_AOT_LOAD=1 with "
                                           "VLLM_DISABLE_COMPILE_CACHE=1"):
        lm(torch.arange(5), torch.arange(5))


def test_disable_compile_cache_saves_nothing(tmp_path, monkeypatch):
    """With the cache off, AOT compile is off by default too (vLLM's use_aot_compile): the JIT path,
    nothing on disk."""
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    monkeypatch.delenv("VLLM_USE_AOT_COMPILE", raising=False)
    lm = build_model("llama", num_layers=1,
                     compilation_config=CompilationConfig(max_num_batched_tokens=16))
    with compilation_counter.expect(num_aot_compiles=0, num_graphs_seen=1,
                                    num_aot_artifacts_saved=0,
                                    num_compiled_artifacts_saved=0):
        lm(torch.arange(5), torch.arange(5))
    assert lm.model.aot_compiled_fn is None and lm.model.compiled
    assert not any(p.is_file() for p in tmp_path.rglob("*"))


def test_the_aot_artifact_is_saved_before_the_first_run(tmp_path, monkeypatch):
    """As vLLM's decorator (save_aot_compiled_function right after aot_compile): every piece is
    compiled by then, and a warm-up run that fails still leaves the next start an artifact."""
    from minivllm_compile.compilation import aot
    from minivllm_compile.compilation.wrapper import TorchCompileWithNoGuardsWrapper

    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "0")
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    events = []

    class FailingFirstRun:  # the compiled function, whose first run crashes
        def __init__(self, fn):
            self.fn = fn

        def __call__(self, *args, **kwargs):
            events.append("run")
            raise RuntimeError("warm-up run failed")

        def __getattr__(self, name):
            return getattr(self.fn, name)

    real_compile = TorchCompileWithNoGuardsWrapper.aot_compile
    real_save = aot.save_aot_compiled_function
    monkeypatch.setattr(TorchCompileWithNoGuardsWrapper, "aot_compile",
                        lambda self, *a, **k: FailingFirstRun(real_compile(self, *a, **k)))
    monkeypatch.setattr(aot, "save_aot_compiled_function",
                        lambda model: (events.append("save"), real_save(model)))
    lm = build_model("llama", num_layers=1,
                     compilation_config=CompilationConfig(max_num_batched_tokens=16))
    with pytest.raises(RuntimeError, match="warm-up run failed"):
        lm(torch.arange(5), torch.arange(5))
    assert events == ["save", "run"]
    assert list(tmp_path.glob("torch_compile_cache/torch_aot_compile/*/rank_0_0/model"))


def test_disable_compile_cache_with_aot_asked_for_saves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "1")
    monkeypatch.setenv("VLLM_USE_AOT_COMPILE", "1")
    lm = build_model("llama", num_layers=1,
                     compilation_config=CompilationConfig(max_num_batched_tokens=16))
    with compilation_counter.expect(num_aot_compiles=1, num_aot_artifacts_saved=0,
                                    num_compiled_artifacts_saved=0):
        lm(torch.arange(5), torch.arange(5))
    assert not any(p.is_file() for p in tmp_path.rglob("*"))
    # the guards were dropped, so the fresh AOT function skips its guard check, as a loaded one does
    assert lm.model.aot_compiled_fn._guard_check_enabled is False


def test_an_unwritable_cache_degrades_to_memory(tmp_path, monkeypatch, caplog):
    (tmp_path / "afile").write_text("")
    # cannot be a directory
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "afile" / "cache"))
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "0")
    lm = build_model("llama", num_layers=1,
                     compilation_config=CompilationConfig(max_num_batched_tokens=16))
    eager = build_model("llama", num_layers=1)
    with caplog.at_level("WARNING", logger="minivllm_compile"):
        out = lm(torch.arange(5), torch.arange(5))
    torch.testing.assert_close(out, eager(torch.arange(5), torch.arange(5)), atol=1e-4, rtol=1e-4)
    assert any("cannot" in r.message for r in caplog.records)


def test_which_config_fields_change_the_key():
    lm = build_model("llama", num_layers=1)
    key = lambda **kw: cache_keys.aot_cache_key(lm.model, CompilationConfig(**kw))[0]  # noqa: E731
    base = key()
    for field in ("debug_dump_path", "cache_dir"):  # documented as not mattering
        assert key(**{field: "/tmp/elsewhere"}) == base
    # a guard_filter_fn compiles nothing differently; its repr (an address) must not reach the key
    assert key(inductor_compile_config={"guard_filter_fn": lambda entries: [True]
                                        * len(entries)}) == base
    assert key(inductor_compile_config={"max_autotune": True}) != base
    assert key(compile_sizes=[4]) != base
    assert key(mode=CompilationMode.DYNAMO_TRACE_ONCE) != base
    assert key(splitting_ops=["minivllm::short_conv"]) != base
    other = build_model("llama", num_layers=1, hidden_size=64, intermediate_size=96)
    # other weights' shapes
    assert cache_keys.aot_cache_key(other.model, CompilationConfig())[0] != base
    # the same model on another device: other kernels (the parameters' device types)
    assert cache_keys.aot_cache_key(lm.model.to("meta"), CompilationConfig())[0] != base
    cc = CompilationConfig()
    assert cache_keys.backend_cache_key(cc, "cpu")[0] != cache_keys.backend_cache_key(cc, "cuda")[0]


def test_unpacked_artifacts_hold_readable_code(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    monkeypatch.setenv("VLLM_DISABLE_COMPILE_CACHE", "0")
    # the mega artifact keeps its pieces' bytes inline
    monkeypatch.setenv("VLLM_USE_MEGA_AOT_ARTIFACT", "0")
    cc = CompilationConfig(max_num_batched_tokens=16, compile_cache_save_format="unpacked")
    build_model("llama", num_layers=1, compilation_config=cc)(torch.arange(5), torch.arange(5))
    sources = [p for p in tmp_path.rglob("*.py") if "artifact_compile_range" in str(p)]
    assert sources and any("def call(" in p.read_text() for p in sources)


def test_the_serializable_function_exposes_the_traces_shape_env():
    """As vLLM's VllmSerializableFunction.shape_env: the ShapeEnv of the trace, from its first
    SymInt input, where num_tokens' symbol and its range live."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from minivllm_compile.compilation.backends import VllmBackend

    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="eager", compile_sizes=[],
                           max_num_batched_tokens=16)
    backend, made = VllmBackend(cc), []

    def keep(gm, example_inputs):
        made.append(backend(gm, example_inputs))
        made.append(example_inputs)
        return made[0]

    x = torch.randn(6, 4)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.reset()
    torch.compile(lambda t: t * 2, backend=keep, fullgraph=True)(x)
    torch._dynamo.reset()
    fn, inputs = made
    (sym,) = [i for i in inputs if isinstance(i, torch.SymInt)]
    assert isinstance(fn.shape_env, ShapeEnv) and fn.shape_env is sym.node.shape_env
    assert sym.node.expr in fn.shape_env.var_to_range
