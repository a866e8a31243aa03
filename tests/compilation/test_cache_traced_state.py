"""A saved compiled forward is loaded only where what its trace assumed still holds: the sources it
traced (a notebook cell's text, not only files on disk) and the values it baked into the graph
(traced_state.py). Each case compiles and saves in one process, changes one thing, and starts
another process on the same cache, as a user's next run (or next notebook kernel) would. The later
processes mostly run with VLLM_FORCE_AOT_LOAD=1: a stale load then shows as wrong numbers, a refused
one as an error naming what changed, and no compile is needed to tell them apart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("IPython")

CELL_CHILD = r"""
import json, os, sys
from IPython.core.interactiveshell import InteractiveShell

spec = json.loads(sys.argv[1])
# what a Jupyter kernel runs cells with: each cell's source in linecache
shell = InteractiveShell.instance()

def run(source):
    result = shell.run_cell(source)
    result.raise_error()

run('''
import torch
from torch import nn
from minivllm_compile import (CompilationConfig, CompilationMode, compilation_counter,
                              support_torch_compile)
''')
results = []
for step in spec["steps"]:
    for source in step["cells"]:
        run(source)
    os.environ["VLLM_FORCE_AOT_LOAD"] = "1" if step.get("force") else "0"
    run('''
cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, splitting_ops=[],
                       max_num_batched_tokens=16)
m = M(compilation_config=cc)
x = torch.arange(8, dtype=torch.float32).view(4, 2)
before = dict(vars(compilation_counter))
try:
    diff = (m(x) - M.forward(m, x)).abs().max().item()  # M.forward: the cell's code, run eagerly
    error = None
except Exception as e:
    diff, error = None, f"{type(e).__name__}: {e}"
step_result = {"diff": diff, "error": error,
               **{k: compilation_counter.__dict__[k] - before[k]
                  for k in ("num_aot_artifacts_loaded", "num_aot_compiles",
                            "num_aot_artifacts_saved")}}
''')
    results.append(shell.user_ns["step_result"])
print("RESULT " + json.dumps(results))
"""

ACT = "def act(x):\n    return x * {k}\n"
MODEL = '''
@support_torch_compile
class M(nn.Module):
    def __init__(self, *, compilation_config=None):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return act(self.lin(x)) + {b}
'''


def run_cells(root: Path, inductor: Path,
              steps: list[dict]) -> tuple[subprocess.CompletedProcess, list]:
    env = {**os.environ, "VLLM_CACHE_ROOT": str(root), "VLLM_DISABLE_COMPILE_CACHE": "0",
           "TORCHINDUCTOR_CACHE_DIR": str(inductor)}
    proc = subprocess.run([sys.executable, "-c", CELL_CHILD, json.dumps({"steps": steps})], env=env,
                          capture_output=True, text=True, timeout=600, cwd=root.parent, check=False)
    results = next((json.loads(line[7:]) for line in proc.stdout.splitlines()
                    if line.startswith("RESULT ")), None)
    assert proc.returncode == 0 and results is not None, proc.stderr[-3000:]
    return proc, results


def cells(k: int = 2, b: int = 0) -> list[str]:
    return [ACT.format(k=k), MODEL.format(b=b)]


@pytest.mark.compiles
def test_a_model_edited_in_a_notebook_cell_is_never_served_its_old_compiled_forward(tmp_path,
                                                                                    seed_isa_record):
    """Notebook cells are no files on disk (IPython keeps their text in linecache): vLLM's check of
    the traced files skips them, and a class or helper edited in a cell used to load the compiled
    forward of its earlier text, in the same kernel and in the next one."""
    seed_isa_record(tmp_path / "cache")  # conftest.py: no ISA probe in the first start
    root, inductor = tmp_path / "cache", tmp_path / "inductor"
    # kernel 1: compile and save; then edit forward in the cell and re-run it: a new key, so a
    # forced load finds nothing (it used to load the first text's code, off by 1)
    _, (first, edited) = run_cells(root, inductor, [
        {"cells": cells()}, {"cells": cells(b=1), "force": True}])
    assert first["num_aot_compiles"] == 1 and first["num_aot_artifacts_saved"] == 1, first
    assert first["diff"] == 0.0
    assert edited["error"] and edited["error"].startswith("FileNotFoundError"), edited
    # kernel 2, the same cells: loads what kernel 1 saved. Then the helper edited in its cell
    # (forward's own text unchanged: the same key): the load is refused, naming the function
    _, (same, helper) = run_cells(root, inductor, [
        {"cells": cells(), "force": True}, {"cells": [ACT.format(k=3)], "force": True}])
    assert same["num_aot_artifacts_loaded"] == 1 and same["diff"] == 0.0, same
    assert (helper["error"] and "traced source changed since it was saved: "
                                "__main__.act" in helper["error"]), helper
    # kernel 3, the same, not forced: one warning, compiled afresh and saved, and loaded from
    # there when the cells run again
    proc, (rebuilt, again) = run_cells(root, inductor, [
        {"cells": cells(k=3)}, {"cells": cells(k=3), "force": True}])
    assert "traced source changed since it was saved: __main__.act" in proc.stderr
    assert rebuilt["num_aot_compiles"] == 1 and rebuilt["diff"] == 0.0, rebuilt
    assert again["num_aot_artifacts_loaded"] == 1 and again["diff"] == 0.0, again


STRING_CHILD = r"""
import json, sys, torch
from torch import nn
from minivllm_compile import (CompilationConfig, CompilationMode, compilation_counter,
                              support_torch_compile)

@support_torch_compile
class M(nn.Module):
    def __init__(self, *, compilation_config=None):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * SCALE

m = M(compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE, splitting_ops=[]))
x = torch.ones(4, 2)
try:
    print("RESULT " + json.dumps({"diff": (m(x) - M.forward(m, x)).abs().max().item(),
                                  **vars(compilation_counter)}))
except Exception as e:
    print("RESULT " + json.dumps({"error": f"{type(e).__name__}: {e}"}))
"""


@pytest.mark.compiles
def test_a_model_defined_in_python_c_is_never_saved_so_never_served_stale(tmp_path,
                                                                          seed_isa_record):
    """`python -c` (or exec) leaves no source to read: the cache cannot tell an edited forward from
    this one, so it saves nothing and says so (vLLM hashes "<string>" by its name: an edited
    model loaded the old compiled forward)."""
    seed_isa_record(tmp_path)  # conftest.py: no ISA probe in the first start
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path), "VLLM_DISABLE_COMPILE_CACHE": "0",
           "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="minivllm_test_inductor_")}

    def run(scale: str, force: str) -> tuple[subprocess.CompletedProcess, dict]:
        proc = subprocess.run([sys.executable, "-c", f"SCALE = {scale}\n" + STRING_CHILD],
                              env={**env, "VLLM_FORCE_AOT_LOAD": force}, capture_output=True,
                              text=True, timeout=600, check=False)
        result = next((json.loads(line[7:]) for line in proc.stdout.splitlines()
                       if line.startswith("RESULT ")), None)
        assert proc.returncode == 0 and result is not None, proc.stderr[-3000:]
        return proc, result

    proc, first = run("2.0", "0")
    assert first["diff"] == 0.0 and first["num_aot_compiles"] == 1, first
    assert first["num_aot_artifacts_saved"] == 0
    assert ("is not saved to the compile cache: the source of M.forward "
            "(<string>) cannot be read" in proc.stderr)
    # edited (x 3): nothing to load (the old code loaded the x 2 model's artifact)
    _, edited = run("3.0", "1")
    assert edited.get("error", "").startswith("FileNotFoundError"), edited


VALUES = '''
import torch
from torch import nn
from minivllm_compile import support_torch_compile

SCALE = 1.0  # a module global read in forward


class Inner:
    def __init__(self, v):
        self.v = v


class Cfg:
    def __init__(self, v):
        self.inner = Inner(v)


@support_torch_compile
class M(nn.Module):
    k = 1.0  # a class attribute

    def __init__(self, *, compilation_config=None):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(2, 2)
        self._x = 1.0  # a private attribute
        self.cfg = Cfg(1.0)  # a nested plain object
        self.items = [torch.ones(2), 1.0]  # a number in a list that also holds a tensor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x) * self._x + SCALE + self.k + self.cfg.inner.v
        return y * self.items[1] + self.items[0]


def make(gain):
    @support_torch_compile
    class Closed(nn.Module):  # a class made by a function: forward reads its closure
        def __init__(self, *, compilation_config=None):
            super().__init__()
            torch.manual_seed(0)
            self.lin = nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * gain

    return Closed
'''

VALUES_CHILD = r"""
import json, os, sys, torch
sys.path.insert(0, sys.argv[2])
import toy_values
from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter

CHANGES = {  # one value each, changed at run time: the module's file stays as it was
    "private attribute": lambda m: setattr(m, "_x", 2.0),
    "module global": lambda m: setattr(toy_values, "SCALE", 3.0),
    "class attribute": lambda m: setattr(toy_values.M, "k", 4.0),
    "nested object": lambda m: setattr(m.cfg.inner, "v", 5.0),
    "number in a list": lambda m: m.items.__setitem__(1, 6.0),
    "rebuilt": lambda m: setattr(toy_values, "SCALE", 3.0),
}
results = {}
for name, force in json.loads(sys.argv[1]):
    os.environ["VLLM_FORCE_AOT_LOAD"] = force
    saved = (toy_values.SCALE, toy_values.M.k)
    cls = (toy_values.make(7.0 if name == "closure variable" else 1.0) if "closure" in name
           else toy_values.M)
    m = cls(compilation_config=CompilationConfig(mode=CompilationMode.VLLM_COMPILE,
                                                 splitting_ops=[], max_num_batched_tokens=16))
    if name in CHANGES:
        CHANGES[name](m)
    x = torch.arange(8, dtype=torch.float32).view(4, 2)
    before = dict(vars(compilation_counter))
    try:
        results[name] = {"diff": (m(x) - cls.forward(m, x)).abs().max().item()}
    except Exception as e:
        results[name] = {"error": f"{type(e).__name__}: {e}"}
    results[name].update({k: compilation_counter.__dict__[k] - before[k]
                          for k in ("num_aot_artifacts_loaded", "num_aot_compiles")})
    toy_values.SCALE, toy_values.M.k = saved
print("RESULT " + json.dumps(results))
"""


@pytest.mark.compiles
def test_values_baked_into_the_graph_are_checked_when_it_is_loaded(tmp_path, seed_isa_record):
    """Dynamo bakes every plain value forward reads into the graph as a constant, and its guards on
    them are dropped. Six kinds used to be missing from the key, so a second process loaded the
    first one's results: a private attribute, a module global, a class attribute, a field of a
    nested object, a number in a list that also holds a tensor, a variable of forward's closure.
    Each is now checked on load."""
    seed_isa_record(tmp_path / "cache")  # conftest.py: no ISA probe in the first start
    src = tmp_path / "src"
    src.mkdir()
    (src / "toy_values.py").write_text(VALUES)
    env = {**os.environ, "VLLM_CACHE_ROOT": str(tmp_path / "cache"),
           "VLLM_DISABLE_COMPILE_CACHE": "0",
           "TORCHINDUCTOR_CACHE_DIR": tempfile.mkdtemp(prefix="minivllm_test_inductor_")}

    def run(names: list[tuple[str, str]]) -> tuple[subprocess.CompletedProcess, dict]:
        """Each (change, VLLM_FORCE_AOT_LOAD) in turn, on a fresh model."""
        proc = subprocess.run([sys.executable, "-c", VALUES_CHILD, json.dumps(names), str(src)],
                              env=env, capture_output=True, text=True, timeout=600,
                          check=False)
        result = next((json.loads(line[7:]) for line in proc.stdout.splitlines()
                       if line.startswith("RESULT ")), None)
        assert proc.returncode == 0 and result is not None, proc.stderr[-3000:]
        return proc, result

    _, first = run([("unchanged", "0"), ("closure unchanged", "0")])
    for name in ("unchanged", "closure unchanged"):
        assert first[name] == {"diff": 0.0, "num_aot_artifacts_loaded": 0, "num_aot_compiles": 1}
    changes = ["private attribute", "module global", "class attribute", "nested object",
               "number in a list", "closure variable"]
    # then, in the next process: each change forced to load; the last one not forced
    proc, forced = run([("unchanged", "1"), *[(c, "1") for c in changes], ("rebuilt", "0")])
    assert forced["unchanged"] == {"diff": 0.0, "num_aot_artifacts_loaded": 1,
                                   "num_aot_compiles": 0}
    named = {"private attribute": "self._x was 1.0 when it was compiled, now 2.0",
             "module global": "SCALE was 1.0 when it was compiled, now 3.0",
             "class attribute": "['k'] was 1.0 when it was compiled, now 4.0",
             "nested object": "self.cfg.inner.v was 1.0 when it was compiled, now 5.0",
             "number in a list": "self.items[1] was 1.0 when it was compiled, now 6.0",
             "closure variable": "gain was 1.0 when it was compiled, now 7.0"}
    for name in changes:  # refused, naming the value (they used to load, and were off by 1 to 5)
        got = forced[name]
        assert ("error" in got and "a value the compiled graph baked in "
                                   "differs" in got["error"]), (name, got)
        assert named[name] in got["error"], (name, got)
    # not forced: one warning, compiled afresh (right), and saved for the next start
    assert forced["rebuilt"] == {"diff": 0.0, "num_aot_artifacts_loaded": 0, "num_aot_compiles": 1}
    assert "SCALE was 1.0 when it was compiled, now 3.0); compiling afresh" in proc.stderr
