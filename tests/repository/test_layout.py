"""The package is laid out as vLLM 0.34's tree: a file of vLLM's with a counterpart here sits at
the same path below the package, the public names still import from where they always did, and
nothing in the repository imports or names a module path of the flat layout before it."""

import re
import subprocess
from pathlib import Path

import minivllm_compile

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = Path(minivllm_compile.__file__).parent

# vLLM 0.34's files (read from its wheel) that have a counterpart here, by their path below vllm/
VLLM_FILES = [
    "envs.py", "forward_context.py", "logger.py",
    "config/compilation.py", "config/kernel.py", "config/parallel.py", "config/utils.py",
    "compilation/decorators.py", "compilation/wrapper.py", "compilation/backends.py",
    "compilation/piecewise_backend.py", "compilation/compiler_interface.py",
    "compilation/partition_rules.py", "compilation/caching.py", "compilation/cuda_graph.py",
    "compilation/counter.py", "compilation/monitor.py", "compilation/codegen.py",
    "compilation/depyf_compat.py",
    "compilation/passes/inductor_pass.py", "compilation/passes/vllm_inductor_pass.py",
    "compilation/passes/pass_manager.py", "compilation/passes/fx_utils.py",
    "compilation/passes/fusion/qk_norm_rope_fusion.py",
    "compilation/passes/fusion/rms_quant_fusion.py",
    "compilation/passes/fusion/act_quant_fusion.py",
    "compilation/passes/fusion/allreduce_rms_fusion.py",
    "compilation/passes/utility/fix_functionalization.py",
    "compilation/passes/utility/noop_elimination.py",
    "compilation/passes/utility/post_cleanup.py",
    "compilation/passes/ir/clone_elimination.py",
    "compilation/passes/ir/inplace_functionalization.py",
    "compilation/passes/ir/lowering_pass.py", "compilation/passes/ir/utils.py",
    "ir/op.py", "ir/util.py", "ir/tolerances.py", "ir/ops/layernorm.py", "ir/ops/activation.py",
    "distributed/parallel_state.py", "distributed/communication_op.py", "distributed/utils.py",
]

# the flat layout before it: these module paths no longer exist
OLD_MODULES = ["config", "kernel_config", "decorators", "wrapper", "backends", "piecewise_backend",
               "compiler_interface", "partition_rules", "caching", "cuda_graph", "counter",
               "monitor", "aot", "cache_keys", "cache_files", "traced_state", "cpu_isa", "nvtx",
               "passes", "bench_cudagraph", "bench_ir", "bench_plots", "startup", "compare_modes"]
MOVED = [m for m in OLD_MODULES if m != "config"]  # config/ is a package now, under that name


def old_paths(text: str) -> list[str]:
    """Every mention of a module path of the old layout in `text`."""
    names = "|".join(MOVED)
    patterns = [
        rf"\bminivllm_compile\.(?:{names})\b",  # minivllm_compile.backends, ...
        rf"\bminivllm_compile/(?:{names})\.py\b",  # minivllm_compile/backends.py
        r"\bminivllm_compile/(?:passes|config\.py|bench\.py)\b",
        # `from minivllm_compile import caching`: a module by its old name
        rf"^\s*from minivllm_compile import (?:[^\n]*[ ,(])?(?:{names})\b",
    ]
    return [m.group(0) for p in patterns for m in re.finditer(p, text, re.M)]


def test_every_vllm_file_with_a_counterpart_sits_at_vllms_path():
    missing = [f for f in VLLM_FILES if not (PACKAGE / f).is_file()]
    assert not missing, f"not at vLLM's path below minivllm_compile/: {missing}"


def test_compilations_docstring_names_every_module_in_it():
    """compilation/__init__.py says which files are vLLM's and which this project's own."""
    doc = (PACKAGE / "compilation" / "__init__.py").read_text()
    unnamed = [p.name for p in (PACKAGE / "compilation").glob("*.py")
               if p.name != "__init__.py" and p.name not in doc]
    assert not unnamed


def test_the_public_names_import_from_where_they_always_did():
    from minivllm_compile import (  # noqa: F401
        CompilationConfig,
        CompilationMode,
        CUDAGraphMode,
        DynamicShapesConfig,
        DynamicShapesType,
        PassConfig,
        Range,
        cache_files,
        cache_keys,
        caching,
        compilation_counter,
        envs,
        ignore_torch_compile,
        support_torch_compile,
    )
    from minivllm_compile.compilation import caching as new_caching
    from minivllm_compile.models import build_model, load_model  # noqa: F401

    assert caching is new_caching and set(minivllm_compile.__all__) == {
        "CompilationConfig", "CompilationMode", "CUDAGraphMode", "DynamicShapesConfig",
        "DynamicShapesType", "PassConfig", "Range", "compilation_counter", "ignore_torch_compile",
        "support_torch_compile"}
    assert Range is minivllm_compile.config.utils.Range  # vLLM keeps it in config/utils.py


def test_nothing_in_the_repository_names_an_old_module_path():
    files = subprocess.run(["git", "ls-files", "*.py", "*.ipynb", "*.md", "*.toml", "*.sh",
                            "*.yml", "*.cfg"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    me = Path(__file__).resolve().relative_to(ROOT).as_posix()
    found = {f: old_paths((ROOT / f).read_text()) for f in files if f != me}
    found = {f: hits for f, hits in found.items() if hits}
    assert not found, f"old module paths: {found}"


def test_the_old_path_finder_finds_each_form():
    text = ("import minivllm_compile.backends\nfrom minivllm_compile.passes.noop_elimination "
            "import X\nsee minivllm_compile/cache_keys.py and minivllm_compile/config.py\n"
            "from minivllm_compile import envs, caching\n"
            "python -m minivllm_compile.startup\n")
    assert len(old_paths(text)) == 6
    assert old_paths("from minivllm_compile.compilation import caching\n"
                     "from minivllm_compile.config import CompilationConfig\n"
                     "minivllm_compile/compilation/passes/fx_utils.py, "
                     "python -m minivllm_compile.bench\n") == []
