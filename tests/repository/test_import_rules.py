"""The import rules, by folder, over every module of the package (DESIGN.md's layout):

- the compiler (config/, compilation/, ir/, distributed/ and the root modules they import:
  cache_files.compiler_files) imports nothing of viz/, exercises/, bench/ or models/, not even
  inside a function: the views, graders, benchmarks and models use the compiler, never the
  reverse, and an edit of theirs never invalidates a compile cache;
- config/ imports nothing of compilation/ when it is imported (a config is built before anything
  compiles; inside a method is fine);
- no two modules import each other, directly or round a circle, counting the imports inside
  functions: a circle makes import order matter and hides which module owns what. The circles
  that remain are type-only (an `if TYPE_CHECKING:` import on the way round), which never run.
"""

import ast
from pathlib import Path

import pytest

import minivllm_compile
from minivllm_compile.compilation import cache_files

PACKAGE = Path(minivllm_compile.__file__).parent
NOT_FOR_THE_COMPILER = ("viz", "exercises", "bench", "models")


def module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package).with_suffix("").parts)
    return ".".join([package.name, *(parts[:-1] if parts[-1] == "__init__" else parts)])


def imports(path: Path, package: Path) -> dict[str, str]:
    """The package's modules `path` imports, each with how: "top" (when it is imported), "lazy"
    (inside a function) or "type" (under `if TYPE_CHECKING:`). `from pkg.a import b` imports
    the module pkg.a.b where that is a file, else pkg.a; either way pkg.a's __init__ runs too."""
    known = {module_name(p, package) for p in package.rglob("*.py")}
    me = module_name(path, package)
    tree = ast.parse(path.read_text())
    within = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            within.update({id(n): "lazy" for n in ast.walk(node) if n is not node})
    for node in ast.walk(tree):  # a TYPE_CHECKING block is "type", inside a function or not
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            within.update({id(n): "type" for n in ast.walk(node)})

    def resolve(name: str) -> str | None:
        """The module of `name`: itself, or the package above it; None for a module outside the
        package's folder (minivllm_compile.kernels ships from the repository's kernels/)."""
        found = name
        while found and found not in known:
            found = found.rpartition(".")[0]
        return found if found and (found != package.name or name == package.name) else None

    found: dict[str, str] = {}
    rank = {"top": 0, "lazy": 1, "type": 2}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                node.module.split(".")[0] == package.name):
            targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known
                       else resolve(node.module) for a in node.names]
        elif isinstance(node, ast.Import):
            targets = [resolve(a.name) for a in node.names
                       if a.name.split(".")[0] == package.name]
        else:
            continue
        how = within.get(id(node), "top")
        for t in targets:
            if t is None:
                continue
            # importing pkg.a.b runs pkg.a's __init__ first, unless it is running already (a
            # package above this module)
            parents = [".".join(t.split(".")[:i]) for i in range(2, t.count(".") + 1)]
            for m in [t, *(up for up in parents if not me.startswith(up + "."))]:
                if m not in found or rank[how] < rank[found[m]]:  # the strongest
                    found[m] = how
    return found


def graph(package: Path) -> dict[str, dict[str, str]]:
    return {module_name(p, package): imports(p, package) for p in sorted(package.rglob("*.py"))}


def folder(module: str) -> str:
    """The first part below the package: "compilation" for pkg.compilation.passes.x."""
    return (module.split(".") + [""])[1]


def compiler_breaking_the_rule(package: Path) -> dict[str, list[str]]:
    wrong = {}
    for path in cache_files.compiler_files(package):
        bad = sorted(m for m, how in imports(path, package).items()
                     if folder(m) in NOT_FOR_THE_COMPILER)
        if bad:
            wrong[str(path.relative_to(package))] = bad
    return wrong


def config_importing_compilation(package: Path) -> dict[str, list[str]]:
    wrong = {}
    for path in sorted((package / "config").rglob("*.py")):
        bad = sorted(m for m, how in imports(path, package).items()
                     if how == "top" and folder(m) == "compilation")
        if bad:
            wrong[str(path.relative_to(package))] = bad
    return wrong


def circles(edges: dict[str, dict[str, str]], kinds: set[str]) -> list[list[str]]:
    """The strongly connected groups of more than one module, following imports of `kinds`."""
    adj = {m: [t for t, how in d.items() if how in kinds and t != m and t in edges]
           for m, d in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in adj[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while (w := stack.pop()) != v:
                group.append(w)
            if group:
                out.append(sorted([v, *group]))

    for v in adj:
        if v not in index:
            visit(v)
    return sorted(out)


def test_the_compiler_imports_no_view_grader_benchmark_or_model():
    compiler = cache_files.compiler_files(PACKAGE)
    assert {folder(module_name(p, PACKAGE)) for p in compiler} >= {
        f for f in cache_files.COMPILER_FOLDERS if (PACKAGE / f).is_dir()}
    assert compiler_breaking_the_rule(PACKAGE) == {}


def test_config_imports_nothing_of_compilation_when_imported():
    assert config_importing_compilation(PACKAGE) == {}


def test_no_import_circle_but_type_only_ones():
    edges = graph(PACKAGE)
    assert len(edges) > 100  # every module of the package, not a hand list
    assert circles(edges, {"top", "lazy"}) == []
    # the circles that remain close only through `if TYPE_CHECKING:` imports (a type annotation
    # naming a class of the module that imports this one): each would vanish without them
    typed = circles(edges, {"top", "lazy", "type"})
    assert typed, "no type-only circle left: this test's docstring can say so"
    for group in typed:
        assert any(how == "type" for m in group for t, how in edges[m].items() if t in group)


@pytest.fixture
def toy(tmp_path):
    """A package laid out as this one, with every rule kept, to break one rule at a time."""
    root = tmp_path / "minivllm_compile"
    files = {"__init__.py": "from minivllm_compile import envs\n", "envs.py": "",
             "tour.py": "from minivllm_compile.viz import draw\n",
             "config/__init__.py": "", "config/compilation.py": "",
             "compilation/__init__.py": "",
             "compilation/backends.py": "from minivllm_compile.config import compilation\n"
                                        "from minivllm_compile.compilation import caching\n",
             "compilation/caching.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                       "    from minivllm_compile.compilation import backends\n",
             "ir/__init__.py": "", "distributed/__init__.py": "",
             "viz/__init__.py": "from minivllm_compile.compilation import backends\n"
                                "def draw(): pass\n",
             "models/__init__.py": "", "bench/__init__.py": "", "exercises/__init__.py": ""}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert compiler_breaking_the_rule(root) == {} and config_importing_compilation(root) == {}
    assert circles(graph(root), {"top", "lazy"}) == []
    return root


def test_the_rules_catch_a_lazy_import_of_a_view_by_the_compiler(toy):
    (toy / "compilation/passes").mkdir()
    (toy / "compilation/passes/fusion.py").write_text(
        "def run():\n    from minivllm_compile.viz import draw\n")
    (toy / "ops.py").write_text("import minivllm_compile.models\n")  # a root module...
    (toy / "compilation/backends.py").write_text("from minivllm_compile import ops\n")  # ...used
    assert compiler_breaking_the_rule(toy) == {
        "compilation/passes/fusion.py": ["minivllm_compile.viz"],
        "ops.py": ["minivllm_compile.models"]}


def test_the_rules_catch_config_importing_compilation_when_imported(toy):
    (toy / "config/compilation.py").write_text(
        "from minivllm_compile.compilation import caching\n"
        "def later():\n    from minivllm_compile.compilation import backends\n")
    assert config_importing_compilation(toy) == {  # the module, and the package's __init__ above it
        "config/compilation.py": ["minivllm_compile.compilation",
                                  "minivllm_compile.compilation.caching"]}


def test_the_rules_catch_a_circle_through_a_function_not_a_type_only_one(toy):
    backends = "minivllm_compile.compilation.backends"
    caching = "minivllm_compile.compilation.caching"
    assert circles(graph(toy), {"top", "lazy", "type"}) == [[backends, caching]]  # type-only
    (toy / "compilation/caching.py").write_text(
        "def f():\n    from minivllm_compile.compilation import backends\n")
    assert circles(graph(toy), {"top", "lazy"}) == [[backends, caching]]
