"""minivllm_compile.viz.trace: TORCH_TRACE + tlparse from a process that is already running (a
notebook's kernel), or from a fresh one; and scripts/browser_check_tlparse.py, which opens a report
in headless Chromium."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from minivllm_compile import CompilationConfig, CompilationMode, support_torch_compile
from minivllm_compile.models import build_model
from minivllm_compile.viz import trace as trace_mod
from minivllm_compile.viz.trace import torch_trace, trace, trace_script

# every test here compiles, or shares a module fixture that does: whole suite only
pytestmark = pytest.mark.compiles

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def llama_report(tmp_path_factory):
    """One traced compile of a 2-layer Llama under VLLM_COMPILE: three compiled pieces."""
    cc = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        backend="eager",
        compile_sizes=[4],
        max_num_batched_tokens=16,
    )
    lm = build_model("llama", num_layers=2, compilation_config=cc)
    return trace(
        lambda: lm(torch.arange(8) + 1, torch.arange(8)), tmp_path_factory.mktemp("tl") / "llama"
    )


def test_the_report_index_names_every_compiled_piece(llama_report):
    r = llama_report
    assert r.error is None and len(r.compile_ids) == 1
    assert r.pieces() == ["submod_0", "submod_2", "submod_4"]
    index = r.index.read_text()
    for piece in r.pieces():
        (page,) = r.find(f"vllm_{piece}_")
        assert page.path.is_file() and f"vllm_{piece}_" in index
    # one vllm_piecewise_compile_start per piece and entry (the size 4 and the range [1, 16])
    assert len(r.find("vllm_piecewise_compile_start")) == 3 * 2
    assert '"mode": "VLLM_COMPILE"' in r.read("vllm_compilation_config")
    assert "class GraphModule" in r.read("vllm_piecewise_split_graph")
    # for a notebook: a table of links, relative where the page lies under the working directory
    assert "vllm_submod_0" in r._repr_html_() and "index.html" in repr(r)


def test_a_failing_call_is_traced_and_kept_not_raised(tmp_path):
    @support_torch_compile
    class Breaks(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:  # data-dependent: a graph break, an error under fullgraph
                return x * 2
            return x

    model = Breaks(
        compilation_config=CompilationConfig(
            mode=CompilationMode.VLLM_COMPILE, backend="eager", splitting_ops=[]
        )
    )
    r = trace(lambda: model(torch.ones(4)), tmp_path / "break")
    assert isinstance(r.error, torch._dynamo.exc.Unsupported)
    assert "Data-dependent branching" in r.read("dynamo_error")
    assert "Data-dependent branching" in r.failures()
    with pytest.raises(KeyError, match="no page named inductor_output_code"):
        r.read("inductor_output_code")


def test_torch_trace_puts_the_trace_logger_back_as_it_was(tmp_path):
    from torch._logging import _internal

    log = _internal.trace_log
    before = (list(log.handlers), log.level)
    with torch_trace(tmp_path / "raw"):
        assert len(log.handlers) == len(before[0]) + 1
    assert (list(log.handlers), log.level) == before


def test_nothing_compiled_while_tracing_says_why(tmp_path):
    with pytest.raises(RuntimeError, match="nothing was traced.*VLLM_DISABLE_COMPILE_CACHE"):
        trace(lambda: torch.ones(2) * 2, tmp_path / "empty")


def test_a_missing_tlparse_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="pip install tlparse==0.4.3"):
        trace(lambda: None, tmp_path / "never")
    assert not (tmp_path / "never").exists()  # nothing ran


def test_trace_script_traces_a_fresh_process(tmp_path):
    code = (
        "import torch\nprint(torch.compile(lambda x: x * 2, backend='eager')(torch.ones(3)).sum())"
    )
    r = trace_script(code, tmp_path / "fresh")
    assert r.returncode == 0 and "tensor(6.)" in r.output
    assert r.compile_ids == ["[0/0]"]  # a fresh process: its first frame
    assert "TORCH_TRACE" not in os.environ  # set for the child only


def _no_browser() -> str | None:
    missing = []
    if shutil.which("chromium") is None:
        missing.append("no `chromium` on PATH (apt-get install -y chromium)")
    if importlib.util.find_spec("playwright") is None:
        missing.append("playwright is not installed (.venv/bin/pip install playwright)")
    return "; ".join(missing) or None


@pytest.mark.skipif(_no_browser() is not None, reason=f"browser check: {_no_browser()}")
def test_chromium_opens_the_report_and_finds_every_piece(llama_report):
    script = ROOT / "scripts" / "browser_check_tlparse.py"
    args = [
        sys.executable,
        str(script),
        str(llama_report.out),
        "--pieces",
        ",".join(llama_report.pieces()),
    ]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "PASSED" in proc.stdout, proc.stdout + proc.stderr
    proc = subprocess.run(
        [*args[:3], "--pieces", "submod_0,submod_9"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 1 and "submod_9" in proc.stderr, proc.stdout + proc.stderr


def test_the_html_page_text_drops_markup():
    page = "<html><style>p{}</style><body><p>a &gt; b</p><script>x()</script><div>c</div></body>"
    assert trace_mod._html_text(page) == "a > b\nc"
