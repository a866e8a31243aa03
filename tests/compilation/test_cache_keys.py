"""The compile cache never serves kernels compiled for something else. Each case compiles in one
process and starts another on the same cache, as a user's next run would: the second process must
compile afresh where anything that changes the compiled code differs (the model, a constant the
trace baked in, a pass's source, the inputs), load where nothing does, and
match eager either way."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from minivllm_compile import CompilationConfig
from minivllm_compile.compilation import cache_keys

CHILD = r"""
import json, sys, torch
spec = json.loads(sys.argv[1])
sys.path[:0] = spec.get("path", [])
from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter

def config():
    kw = dict(spec.get("cc", {}))
    if "user_pass" in kw:
        import toy_pass
        kw["inductor_compile_config"] = {"post_grad_custom_post_pass": toy_pass.user_pass}
        del kw["user_pass"]
    return CompilationConfig(mode=CompilationMode[spec.get("mode", "VLLM_COMPILE")],
                             max_num_batched_tokens=16, **kw)

for name, value in spec.get("inductor", {}).items():  # a process-wide Inductor setting
    setattr(torch._inductor.config, name, value)
results = {}
if spec.get("toy"):
    import toy_model
    x = torch.arange(12, dtype=torch.float32).view(6, 2)
    for name in spec["toy"]:
        compiled, eager = (toy_model.make(name, cc) for cc in (config(), None))
        results[name] = (compiled(x), eager(x))
else:
    from minivllm_compile.models import build_model
    sizes = spec.get("sizes", {})
    lm = build_model("llama", num_layers=spec.get("layers", 1), compilation_config=config(),
                     **sizes)
    eager = build_model("llama", num_layers=spec.get("layers", 1), **sizes)
    ids = torch.arange(7, dtype=getattr(torch, spec.get("ids_dtype", "int64")))
    if spec.get("raw"):  # the decorated model itself, first called with these ids (the LM converts)
        from minivllm_compile.forward_context import set_forward_context
        def raw(m, ids, n):
            with torch.inference_mode(), set_forward_context(None, m.model.static_forward_context):
                return m.model(ids, torch.arange(n))
        results["lm"] = (raw(lm, ids, 7), raw(eager, ids.long(), 7))
    else:
        results["lm"] = (lm(ids, torch.arange(7)), eager(ids, torch.arange(7)))
    if spec.get("then_ids_dtype"):  # later calls with other inputs: another dtype, then strided ids
        for later in (torch.arange(5, dtype=getattr(torch, spec["then_ids_dtype"])),
                      torch.arange(10)[::2]):
            try:
                raw(lm, later, 5)
            except ValueError as e:
                print("REFUSED " + str(e).replace("\n", " "))
diffs = {k: (c - e).abs().max().item() for k, (c, e) in results.items()}
print("RESULT " + json.dumps({**vars(compilation_counter), "diffs": diffs}))
"""


def run(root: Path, spec: dict, env: dict
        | None = None) -> tuple[subprocess.CompletedProcess, dict | None]:
    environ = {**os.environ, "VLLM_CACHE_ROOT": str(root), "VLLM_DISABLE_COMPILE_CACHE": "0",
               **(env or {})}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(spec)], env=environ,
                          capture_output=True, text=True, timeout=600)
    result = next((json.loads(line[7:]) for line in proc.stdout.splitlines()
                   if line.startswith("RESULT ")), None)
    return proc, result


def ok(proc: subprocess.CompletedProcess, result: dict | None, loaded: bool,
       tol: float = 1e-4) -> dict:
    """The process ended well, loaded (or compiled) as expected, and matched eager."""
    assert proc.returncode == 0 and result is not None, proc.stderr[-3000:]
    assert result["num_aot_artifacts_loaded"] == (1 if loaded else 0), (result, proc.stderr[-2000:])
    assert result["num_aot_compiles"] == (0 if loaded else 1), result
    assert all(d <= tol for d in result["diffs"].values()), result["diffs"]
    return result


def backend_dirs(root: Path) -> list[Path]:
    return sorted((root / "torch_compile_cache").glob("*/rank_0_0/*"))


@pytest.mark.compiles
@pytest.mark.parametrize("mega", ["1", "0"])
def test_a_second_model_never_overwrites_the_first_ones_pieces(tmp_path, mega, seed_isa_record):
    """1 layer, then 2 layers of the same architecture, then 1 layer again: the third process loads
    the first model's own pieces. (The pieces' folder used to be keyed without the model, so the
    2-layer model overwrote them, and every later 1-layer process crashed or computed garbage.)
    Both load paths: without the mega artifact the pieces are loaded from that folder, which is
    where the crash was ("not enough values to unpack (expected 12, got 8)")."""
    seed_isa_record(tmp_path)  # conftest.py: no ISA probe in the first start
    env = {"VLLM_USE_MEGA_AOT_ARTIFACT": mega}
    ok(*run(tmp_path, {"layers": 1}, env), loaded=False)
    ok(*run(tmp_path, {"layers": 2}, env), loaded=False)
    assert len(backend_dirs(tmp_path)) == 2
    ok(*run(tmp_path, {"layers": 1}, env), loaded=True)
    ok(*run(tmp_path, {"layers": 2}, env), loaded=True)


@pytest.mark.compiles
def test_a_constant_baked_into_the_trace_is_in_the_key(tmp_path, seed_isa_record):
    """rms_norm_eps is a Python float Dynamo makes a constant; with the guards dropped nothing would
    notice another value. A model differing only in it compiles afresh (it used to load the first
    model's artifact, and its logits differed from eager by 0.38 on tiny-llama)."""
    seed_isa_record(tmp_path)  # conftest.py: no ISA probe in the first start
    ok(*run(tmp_path, {}), loaded=False)
    ok(*run(tmp_path, {"sizes": {"rms_norm_eps": 0.1}}), loaded=False)
    assert len(backend_dirs(tmp_path)) == 2
    ok(*run(tmp_path, {"sizes": {"rms_norm_eps": 0.1}}), loaded=True)


TOY = '''
import types

import torch
from torch import nn
from minivllm_compile import support_torch_compile


class Base(nn.Module):
    def __init__(self, *, compilation_config=None, scale=1.0):
        super().__init__()
        torch.manual_seed(0)  # the same weights in every process, for every class
        self.lin = nn.Linear(2, 2)
        self.scale = scale


@support_torch_compile
class Double(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2


@support_torch_compile
class AddThree(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) + 3


@support_torch_compile
class Scale(Base):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


class Options(nn.Module):
    """Reads constants kept in a dict, a plain object and a tuple holding None."""

    def __init__(self, *, compilation_config=None, s=2.0, shift=1.0, pair=(None, 1.0)):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(2, 2)
        self.opts = {"s": s}
        self.ns = types.SimpleNamespace(shift=shift)
        self.pair = pair

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * self.opts["s"] + self.ns.shift
                + (self.pair[1] if self.pair[0] is None else 0.0))


Options = support_torch_compile(Options)


def make(name, cc):
    options = {"opts_a": {}, "opts_b": {"s": 3.0}, "ns_b": {"shift": 2.0},
               "pair_b": {"pair": (None, 2.0)}}
    if name in options:
        return Options(compilation_config=cc, **options[name])
    cls, scale = {"double": (Double, 1.0), "add_three": (AddThree, 1.0),
                  "scale2": (Scale, 2.0), "scale3": (Scale, 3.0)}[name]
    return cls(compilation_config=cc, scale=scale)
'''


@pytest.mark.compiles
def test_two_compiled_modules_in_one_process_keep_their_own_pieces(tmp_path, seed_isa_record):
    """Two decorated classes with one config in the same file, and two instances of one class that
    differ only in a float attribute: each loads its own compiled code in the next process."""
    seed_isa_record(tmp_path / "cache")  # conftest.py: no ISA probe in the first start
    src = tmp_path / "src"
    src.mkdir()
    (src / "toy_model.py").write_text(TOY)
    spec = {"toy": ["double", "add_three", "scale2", "scale3"], "path": [str(src)],
            "cc": {"splitting_ops": []}}
    proc, first = run(tmp_path / "cache", spec)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert first["num_aot_compiles"] == 4 and max(first["diffs"].values()) < 1e-5
    proc, second = run(tmp_path / "cache", spec)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert second["num_aot_artifacts_loaded"] == 4 and second["num_aot_compiles"] == 0
    assert max(second["diffs"].values()) < 1e-5, second["diffs"]
    assert len(backend_dirs(tmp_path / "cache")) == 4


@pytest.mark.compiles
def test_constants_in_dicts_objects_and_tuples_with_none_are_in_the_key(tmp_path, seed_isa_record):
    """A dict of options, a SimpleNamespace and a tuple holding None: Dynamo bakes what forward
    reads from them into the graph as surely as a float attribute. Four instances differing only
    there each compile, then each loads its own code (a dict used to be left out of the key: the
    s=3.0 model loaded the s=2.0 one's artifact and differed from eager by 11)."""
    seed_isa_record(tmp_path / "cache")  # conftest.py: no ISA probe in the first start
    src = tmp_path / "src"
    src.mkdir()
    (src / "toy_model.py").write_text(TOY)
    spec = {"toy": ["opts_a", "opts_b", "ns_b", "pair_b"], "path": [str(src)],
            "cc": {"splitting_ops": []}}
    proc, first = run(tmp_path / "cache", spec)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert first["num_aot_compiles"] == 4 and max(first["diffs"].values()) < 1e-5, first["diffs"]
    proc, second = run(tmp_path / "cache", spec)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert second["num_aot_artifacts_loaded"] == 4 and max(
        second["diffs"].values()) < 1e-5, second["diffs"]


USER_PASS = '''
import sys


def user_pass(graph):
    print("USER PASS v1", file=sys.stderr)
'''


@pytest.mark.compiles
def test_editing_a_users_pass_recompiles(tmp_path, seed_isa_record):
    """A pass given as inductor_compile_config["post_grad_custom_post_pass"] is keyed by its source,
    not by its repr (an address, new in every process): unchanged it loads, edited it compiles and
    the edited pass runs."""
    seed_isa_record(tmp_path / "cache")  # conftest.py: no ISA probe in the first start
    src = tmp_path / "src"
    src.mkdir()
    (src / "toy_pass.py").write_text(USER_PASS)
    spec = {"path": [str(src)], "cc": {"user_pass": True}}
    # a pass runs on an FX-cache miss only
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    proc, _ = run(tmp_path / "cache", spec, env)
    ok(proc, _, loaded=False)
    assert "USER PASS v1" in proc.stderr
    ok(*run(tmp_path / "cache", spec, env), loaded=True)
    (src / "toy_pass.py").write_text(USER_PASS.replace("v1", "v2"))
    proc, result = run(tmp_path / "cache", spec, env)
    ok(proc, result, loaded=False)
    assert "USER PASS v2" in proc.stderr


@pytest.mark.compiles
def test_editing_the_compilers_own_pass_recompiles(tmp_path, seed_isa_record):
    """An edit to this package's passes (here: NoOpEliminationPass's module) invalidates what was
    compiled before it: the package's compiler source is a factor of the key, as vLLM's release is
    of its. An edit under bench/ or viz/ (the compiler's users, by folder) keeps it. Run on a copy
    of the package, put first on sys.path."""
    seed_isa_record(tmp_path / "cache")  # conftest.py: no ISA probe in the first start
    import minivllm_compile
    import minivllm_compile.kernels

    pkg = tmp_path / "pkg" / "minivllm_compile"
    ignore = shutil.ignore_patterns("__pycache__", "checkpoints", "*.ipynb")
    shutil.copytree(Path(minivllm_compile.__file__).parent, pkg, ignore=ignore)
    if not (pkg / "kernels").exists():  # an editable install keeps kernels/ beside the package
        shutil.copytree(Path(minivllm_compile.kernels.__file__).parent,
                        pkg / "kernels", ignore=ignore)
    spec = {"path": [str(tmp_path / "pkg")]}
    env = {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    ok(*run(tmp_path / "cache", spec, env), loaded=False)
    ok(*run(tmp_path / "cache", spec, env), loaded=True)
    for user in ("bench/common.py", "viz/cache.py"):  # not the compiler: the cache still serves
        (pkg / user).write_text((pkg / user).read_text() + "\n# edited\n")
    ok(*run(tmp_path / "cache", spec, env), loaded=True)
    noop = pkg / "compilation" / "passes" / "utility" / "noop_elimination.py"
    noop.write_text(noop.read_text() + '''

_call = NoOpEliminationPass.__call__


def _edited(self, graph):
    import sys
    print("EDITED NOOP PASS RAN", file=sys.stderr)
    return _call(self, graph)


NoOpEliminationPass.__call__ = _edited
''')
    # the edit is outside the pass's class: its uuid (vLLM's, the class's source) does not move,
    # the compiler's source does, in our key and in Inductor's (through the pass manager's uuid)
    proc, result = run(tmp_path / "cache", spec, env)
    ok(proc, result, loaded=False)
    assert "EDITED NOOP PASS RAN" in proc.stderr


@pytest.mark.compiles
@pytest.mark.parametrize("mode", ["VLLM_COMPILE", "DYNAMO_TRACE_ONCE"])
def test_int32_ids_are_refused_or_converted_never_abort_the_process(tmp_path, mode,
                                                                    seed_isa_record):
    """Compiled for int64 ids, the model used to read int32 ids as int64 and the process died
    (SIGABRT, no Python exception). The decorated model now refuses them (and strided ids) naming
    the fix, and the LM converts them. A process whose first call has int32 ids compiles for int32
    (the inputs are in the key) instead of loading the int64 artifact."""
    seed_isa_record(tmp_path)  # conftest.py: no ISA probe in the first start
    env = {"VLLM_DISABLE_COMPILE_CACHE": "1"} if mode == "DYNAMO_TRACE_ONCE" else {}
    spec = {"mode": mode, "raw": True, "then_ids_dtype": "int32"}
    proc, result = run(tmp_path, spec, env)
    assert proc.returncode == 0 and result is not None, proc.stderr[-3000:]
    assert ("REFUSED LlamaModel was compiled once, on its first call, "
            "for input_ids: torch.int64" in proc.stdout)
    assert "pass input_ids.to(torch.int64)" in proc.stdout
    # non-contiguous ids used to fail with an AssertionError blaming a custom op's fake kernel
    assert ("not contiguous (strides [2])" in proc.stdout
            and "pass input_ids.contiguous()" in proc.stdout)
    assert result["diffs"]["lm"] < 1e-4
    # the LM converts int32 ids itself
    proc, result = run(tmp_path, {"mode": mode, "ids_dtype": "int32"}, env)
    assert proc.returncode == 0 and result["diffs"]["lm"] < 1e-4, proc.stderr[-3000:]
    if mode == "VLLM_COMPILE":  # the decorated model called with int32 first: its own artifact
        proc, result = run(tmp_path, {"ids_dtype": "int32", "raw": True})
        ok(proc, result, loaded=False)
        assert len(list((tmp_path / "torch_compile_cache" / "torch_aot_compile").glob("*"))) == 2


@pytest.mark.compiles
def test_a_moved_cache_still_loads_and_a_shared_one_is_readable(tmp_path, seed_isa_record):
    """Piece paths in the AOT file are relative to the cache root, so a cache moved (or copied to
    another machine) loads where VLLM_CACHE_ROOT now points; files get the mode an ordinary open()
    gives them (0666 less the umask, as torch and vLLM write theirs), not mkstemp's 0600, so another
    user of a shared cache can read them."""
    seed_isa_record(tmp_path / "a")  # conftest.py: no ISA probe in the first start
    ok(*run(tmp_path / "a", {}), loaded=False)
    mask = os.umask(0)
    os.umask(mask)
    files = [p for p in (tmp_path / "a").rglob("*") if p.is_file() and p.name != ".lock"]
    assert files and all(p.stat().st_mode & 0o777 == 0o666 & ~mask for p in files), \
        {str(p.relative_to(tmp_path)): oct(p.stat().st_mode & 0o777) for p in files}
    shutil.move(tmp_path / "a", tmp_path / "b")
    proc, result = run(tmp_path / "b", {})
    ok(proc, result, loaded=True)
    assert "unusable" not in proc.stderr


@pytest.mark.compiles
def test_a_cuda_graph_field_a_switch_and_an_inductor_setting_each_get_a_folder(tmp_path,
                                                                              seed_isa_record):
    """vLLM 0.34 hashes the CUDA-graph fields (config.compilation), every switch but an ignore list
    (env) and Inductor's own settings (compiler): a start that differs from the first in one of
    them compiles afresh, into a folder of its own, and changed_factors names the field. (The
    other groups: the model above, code in test_caching.py, the IR priority in
    test_ir_cache_keys.py, the TP size in tests/distributed/test_tp_compile.py.)"""
    from minivllm_compile.viz.debugging import changed_factors

    seed_isa_record(tmp_path)  # conftest.py: no ISA probe in the first start
    ok(*run(tmp_path, {}), loaded=False)
    (base,) = seen = backend_dirs(tmp_path)
    for spec, env, field in (
            ({"cc": {"cudagraph_mode": "PIECEWISE"}}, {}, "config.compilation.cudagraph_mode"),
            ({}, {"VLLM_USE_BYTECODE_HOOK": "0"}, "env.VLLM_USE_BYTECODE_HOOK"),
            ({"inductor": {"comment_origin": True}}, {},
             "compiler.inductor.inductor_config.comment_origin")):
        ok(*run(tmp_path, spec, env), loaded=False)
        (new,) = set(backend_dirs(tmp_path)) - set(seen)
        seen.append(new)
        changed = changed_factors(base, new)
        changed.pop("config.version", None)  # the compiler's source, should it be edited meanwhile
        assert field in changed and all(f.startswith(field.rpartition(".")[0]) for f in changed), \
            changed


def test_the_key_covers_every_factor():
    """In-process: which changes move the AOT key (the fresh-process tests
    above show it matters)."""
    from minivllm_compile.models import build_model
    from minivllm_compile.viz.debugging import changed_factors

    lm = build_model("llama", num_layers=1)
    base = cache_keys.aot_cache_key(lm.model, CompilationConfig())
    assert set(base[1]) == {"env", "config", "compiler"}  # before the trace: no code, no device
    assert set(base[1]["config"]) == {"model", "compilation", "parallel", "version"}
    assert set(base[1]["config"]["model"]) == {"class", "forward", "parameters", "buffers",
                                               "constants", "inputs", "tag"}
    eps = build_model("llama", num_layers=1, rms_norm_eps=0.1)
    moved = cache_keys.aot_cache_key(eps.model, CompilationConfig())
    assert moved[0] != base[0]
    assert cache_keys.model_constants(eps.model)["norm.eps"] == repr(0.1)
    assert changed_factors(base[1], moved[1])["config.model.constants.norm.eps"] == (
        repr(1e-5), repr(0.1))
    inputs = {"input_ids": {"dtype": "torch.int32"}}
    factors = cache_keys.model_factors(lm.model, inputs)
    with_inputs = cache_keys.aot_cache_key(lm.model, CompilationConfig(), factors)
    assert with_inputs[0] != base[0]
    assert set(changed_factors(base[1], with_inputs[1])) == {"config.model.inputs.input_ids.dtype"}
    from minivllm_compile.compilation.backends import VllmBackend, set_model_tag

    with set_model_tag("eagle_head"):
        assert VllmBackend(CompilationConfig()).prefix == "eagle_head"
    assert VllmBackend(CompilationConfig()).prefix == "backbone"
    with pytest.raises(ValueError, match="current tag"), set_model_tag("backbone"):
        pass


def test_the_compiler_hash_covers_the_compiler_and_no_display_only_module(tmp_path):
    """compiler_source_hash hashes the compiler's modules only: editing a view, an exercise, a model
    or a measuring tool keeps every user's cache; editing a backend or a pass does not. The
    display-only helpers live on the display side of that boundary."""
    from minivllm_compile.compilation import cache_files
    from minivllm_compile.viz import (
        count_dynamo_entries,
        describe_cache,
        triton_source_codegen_only,
    )

    package = Path(cache_files.__file__).resolve().parent.parent
    compiler = set(cache_files.compiler_files(package))
    for helper in (count_dynamo_entries, describe_cache, triton_source_codegen_only):
        path = Path(sys.modules[helper.__module__].__file__).resolve()
        assert path not in compiler, (helper.__name__, path)
    copy = tmp_path / "minivllm_compile"
    for f in package.rglob("*.py"):
        (copy / f.relative_to(package)).parent.mkdir(parents=True, exist_ok=True)
        (copy / f.relative_to(package)).write_text(f.read_text())

    def hash_after(edit: str) -> str:
        path = copy / edit
        saved = path.read_text()
        path.write_text(saved + "\n# edited\n")
        try:
            return cache_files.source_hash(cache_files.compiler_files(copy), copy)
        finally:
            path.write_text(saved)

    base = cache_files.source_hash(cache_files.compiler_files(copy), copy)
    for display_only in ("viz/cache.py", "viz/kernels.py", "viz/dynamo_entries.py",
                         "exercises/nb04.py", "models/lm.py", "bench/__main__.py",
                         "bench/startup.py", "tour.py", "launch.py"):
        assert hash_after(display_only) == base, display_only
    for compiler in ("compilation/backends.py", "compilation/caching.py",
                     "compilation/cache_keys.py", "compilation/monitor.py",
                     "compilation/passes/pass_manager.py", "config/compilation.py", "envs.py",
                     "ops.py", "ir/op.py", "distributed/parallel_state.py"):
        assert hash_after(compiler) != base, compiler
    # a new root module is the compiler's once a module of the compiler imports it, not before
    (copy / "newmod.py").write_text("X = 1\n")
    assert hash_after("newmod.py") == base
    backends = copy / "compilation" / "backends.py"
    backends.write_text(backends.read_text() + "\nfrom minivllm_compile import newmod  # noqa\n")
    with_import = cache_files.source_hash(cache_files.compiler_files(copy), copy)
    assert with_import != base and hash_after("newmod.py") != with_import


def test_the_compiler_hash_reads_this_package():
    """compiler_source_hash hashes the package cache_files.py sits in (one folder below it), by the
    folder rule: a path one level off would hash compilation/__init__.py alone."""
    import minivllm_compile
    from minivllm_compile.compilation import cache_files

    assert cache_files.PACKAGE == Path(minivllm_compile.__file__).resolve().parent
    files = {p.relative_to(cache_files.PACKAGE).as_posix()
             for p in cache_files.compiler_files(cache_files.PACKAGE)}
    assert {"__init__.py", "envs.py", "ops.py", "forward_context.py", "config/compilation.py",
            "compilation/backends.py", "compilation/passes/fusion/rms_quant_fusion.py",
            "ir/op.py", "distributed/parallel_state.py"} <= files
    assert not [f for f in files if f.split("/")[0] in (
        "viz", "exercises", "bench", "models", "tour.py", "launch.py")]


def test_the_code_factor_lists_every_traced_file_and_hashes_what_it_can_read(tmp_path):
    """vLLM's read_code_files / get_code_factors: one entry per file, sorted by path, with the hash
    of its content; code in no file ("<string>", a file gone since) is listed by its path alone."""
    from minivllm_compile.config import hash_factors

    (tmp_path / "b.py").write_text("x = 1\n")
    cc = CompilationConfig()
    cc.traced_files = {str(tmp_path / "b.py"), "<string>", str(tmp_path / "gone.py")}
    _, factors = cache_keys.backend_cache_key(cc, "cpu")
    assert factors["code"] == {"files": [
        {"path": str(tmp_path / "b.py"), "hash": hash_factors({"content": "x = 1\n"})},
        {"path": str(tmp_path / "gone.py")},
        {"path": "<string>"}]}
    assert factors["code_hash"] == hash_factors(factors["code"])
    key = cache_keys.backend_cache_key(cc, "cpu")[0]
    (tmp_path / "b.py").write_text("x = 2\n")  # an edit is a new key
    assert cache_keys.backend_cache_key(cc, "cpu")[0] != key
