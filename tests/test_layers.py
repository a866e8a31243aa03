"""The compiler's modules import downwards only: keys and artifacts sit below the backend, and
nothing below it imports it (lazily inside a function included). A circle makes import order
matter and hides which module owns what."""

import ast
from pathlib import Path

import minivllm_compile

PACKAGE = Path(minivllm_compile.__file__).parent

# bottom first; a module may import only those before it
ORDER = ["config", "envs", "counter", "monitor", "cache_files", "cpu_isa", "compiler_interface",
         "cuda_graph", "piecewise_backend", "passes", "cache_keys", "caching", "partition_rules",
         "backends", "aot", "wrapper", "decorators"]


def imported(path: Path) -> set[str]:
    """minivllm_compile modules `path` imports anywhere, except under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
            and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(
            node, ast.ImportFrom) and node.module and node.module.startswith("minivllm_compile"):
            parts = node.module.split(".")
            if len(parts) > 1:
                found.add(parts[1])
            else:
                found |= {a.name for a in node.names}
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names
                      if a.name.startswith("minivllm_compile.")}
    return found


def test_the_compiler_imports_downwards_only():
    wrong = {}
    for i, name in enumerate(ORDER):
        path = PACKAGE / f"{name}.py"
        files = [path] if path.exists() else sorted((PACKAGE / name).glob("*.py"))
        assert files, name
        above = set(ORDER[i:]) - {name}
        for f in files:
            bad = imported(f) & above
            if bad:
                wrong[str(f.relative_to(PACKAGE))] = sorted(bad)
    assert not wrong, f"imports of a module above (or beside) it: {wrong}"


def test_the_checker_sees_a_lazy_import(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from "
                 "minivllm_compile.backends import X\ndef g():\n    from minivllm_compile import "
                 "caching\n    import minivllm_compile.aot\n")
    assert imported(f) == {"caching", "aot"}
