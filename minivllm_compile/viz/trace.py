"""TORCH_TRACE and tlparse from a notebook: the first step of vLLM's debugging guide
(docs/design/debug_vllm_compile.md), "use tlparse to acquire torch.compile logs".

    report = trace(lambda: lm(ids, pos), "traces/healthy")      # this process
    report = trace_script(SNIPPET, "traces/fresh")              # a fresh process, as the guide does
    report                                 # a table of every compile id and its pages, as links
    report.read("compilation_metrics")     # one page as text
    report.pieces()                        # the compiled pieces vLLM's backend logged

How torch reads TORCH_TRACE, and why a notebook cannot just set it: `import torch` runs
`torch._logging._internal._init_logs()` once, which reads TORCH_TRACE and builds one
`LazyTraceHandler` for the process (a global, reused by every later `_init_logs`, so setting the
variable afterwards changes nothing; calling `_init_logs()` again would also reset every
TORCH_LOGS setting). `trace` therefore puts a handler of its own on torch's trace logger for the
duration of the call, and takes it off again: the structured records go to a file of their own.
torch writes each interned string (a source file name in a stack) once per process, so the new
file first gets every string interned so far, and tlparse can resolve them. What the process has
compiled already is not traced again: a fresh model, or `trace_script`, traces from the start.
"""

from __future__ import annotations

import contextlib
import html
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INSTALL = "pip install tlparse==0.4.3  (or: pip install -e '.[notebooks]')"


def tlparse_executable() -> str:
    """tlparse's path: beside this Python (a venv's bin/, where pip puts it), else on PATH."""
    here = Path(sys.executable).parent / "tlparse"
    found = str(here) if here.is_file() else shutil.which("tlparse")
    if found is None:
        raise FileNotFoundError(
            f"tlparse is not installed (it reads TORCH_TRACE logs into HTML pages): {INSTALL}"
        )
    return found


@contextlib.contextmanager
def torch_trace(folder: str | Path) -> Iterator[Path]:
    """Write torch's structured trace (what TORCH_TRACE=folder would) for the code in the block."""
    from torch._logging import _internal, structured

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    handler = _internal.LazyTraceHandler(str(folder))
    handler.setFormatter(_internal.TorchLogsFormatter(trace=True))
    log = _internal.trace_log
    level, others = log.level, list(log.handlers)
    log.setLevel(logging.DEBUG)
    for h in others:  # the strings interned so far, into the new file only
        log.removeHandler(h)
    log.addHandler(handler)
    try:
        for s, i in list(structured.INTERN_TABLE.items()):
            _internal.trace_structured("str", lambda s=s, i=i: (s, i), suppress_context=True)
    finally:
        for h in others:
            log.addHandler(h)
    try:
        yield folder
    finally:
        log.removeHandler(handler)
        handler.close()
        log.setLevel(level)


@dataclass
class Artifact:
    compile_id: str  # "[0/0]": frame 0, first compile; "[0/1]": its first recompile; "[-/-]": none
    name: str  # tlparse's file name, "dynamo_output_graph_1.txt"
    path: Path

    def text(self) -> str:
        raw = self.path.read_text(errors="replace")
        return _html_text(raw) if self.path.suffix == ".html" else raw


@dataclass
class TlparseReport:
    """tlparse's pages for one trace, as a notebook reads them."""

    folder: Path  # the trace folder: raw/ (the log) and tl_out/ (tlparse's pages)
    log: Path | None
    out: Path
    artifacts: list[Artifact] = field(default_factory=list)
    error: BaseException | None = None  # what the traced call raised (trace keeps it)
    output: str = ""  # tlparse's own summary line; for trace_script, the process's output too
    returncode: int | None = None  # trace_script: the fresh process's exit status

    @property
    def index(self) -> Path:
        return self.out / "index.html"

    @property
    def compile_ids(self) -> list[str]:
        return sorted(
            {a.compile_id for a in self.artifacts if a.compile_id != "[-/-]"}, key=_compile_id_key
        )

    def find(self, name: str, compile_id: str | None = None) -> list[Artifact]:
        """The pages whose name starts with `name` ("dynamo_error", "vllm_submod", ...)."""
        return [
            a
            for a in self.artifacts
            if a.name.startswith(name) and compile_id in (None, a.compile_id)
        ]

    def read(self, name: str, compile_id: str | None = None) -> str:
        """The first such page, as text (an HTML page without its markup)."""
        found = self.find(name, compile_id)
        if not found:
            raise KeyError(
                f"no page named {name}* in this trace"
                f"{f' for {compile_id}' if compile_id else ''}; it "
                f"has: {sorted({_stem(a.name) for a in self.artifacts})}"
            )
        return found[0].text()

    def pieces(self) -> list[str]:
        """The compiled pieces vLLM's backend logged, a graph page each (submod_0, submod_2...)."""
        names = [_stem(a.name).removeprefix("vllm_") for a in self.find("vllm_submod_")]
        return sorted(set(names), key=lambda n: int(n.rsplit("_", 1)[1]))

    def failures(self) -> str:
        """tlparse's page of failed compiles and restarts, as text."""
        page = self.out / "failures_and_restarts.html"
        return _html_text(page.read_text()) if page.exists() else ""

    def recompile_reasons(self) -> dict[str, str]:
        """Each recompile's compile id, and the guard that failed as Dynamo wrote it ("0/0: guard #
        the source line it came from", then the user's stack)."""
        return {a.compile_id: a.text().strip() for a in self.find("recompile_reasons")}

    def summary(self) -> str:
        lines = [f"tlparse report: {self.index}"]
        if self.error is not None:
            lines.append(f"the traced call raised {type(self.error).__name__}")
        for cid in self.compile_ids:
            names = [_stem(a.name) for a in self.artifacts if a.compile_id == cid]
            counted = {n: names.count(n) for n in names}  # in order of first appearance
            lines.append(
                f"  {cid}: " + ", ".join(n if k == 1 else f"{n} x{k}" for n, k in counted.items())
            )
        return "\n".join(lines)

    __repr__ = summary

    def _repr_html_(self) -> str:
        rows = []
        for cid in self.compile_ids:
            links = ", ".join(
                _link(a.path, _stem(a.name)) for a in self.artifacts if a.compile_id == cid
            )
            rows.append(
                f"<tr><td><code>{html.escape(cid)}</code></td>"
                f"<td style='text-align:left'>{links}</td></tr>"
            )
        raised = (
            f"<p>the traced call raised <code>{html.escape(type(self.error).__name__)}</code></p>"
            if self.error is not None
            else ""
        )
        return (
            f"<p>tlparse report: {_link(self.index, 'index.html')} "
            f"({_link(self.out / 'failures_and_restarts.html', 'failures and restarts')})</p>"
            f"{raised}"
            "<table><tr><th>compile id</th><th style='text-align:left'>pages</th></tr>"
            + "".join(rows)
            + "</table>"
        )


def parse(log: str | Path, out: str | Path) -> TlparseReport:
    """Run tlparse on one trace log, into `out` (replaced)."""
    log, out = Path(log), Path(out)
    result = subprocess.run(
        [tlparse_executable(), str(log), "-o", str(out), "--overwrite", "--no-browser"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode != 0 or not (out / "compile_directory.json").exists():
        raise RuntimeError(
            f"tlparse failed on {log} (exit {result.returncode}):\n{result.stderr[-2000:]}"
        )
    artifacts = []
    for cid, entry in json.loads((out / "compile_directory.json").read_text()).items():
        for a in entry.get("artifacts", []):
            artifacts.append(Artifact(cid, a["name"], out / a["url"]))
    said = (result.stdout + result.stderr).strip().splitlines()
    return TlparseReport(
        folder=log.parent.parent,
        log=log,
        out=out,
        artifacts=artifacts,
        output=said[0] if said else "",
    )


def _fresh(folder: str | Path) -> tuple[Path, Path]:
    folder = Path(folder)
    raw = folder / "raw"
    if raw.exists():
        shutil.rmtree(raw)  # one trace per folder: tlparse reads one log
    return folder, raw


_NOTHING = (
    "nothing was traced into {}: nothing compiled while tracing (was the model compiled already "
    "in this process, or loaded from the compile cache? build it afresh, with "
    "VLLM_DISABLE_COMPILE_CACHE=1)"
)


def _parse_one(raw: Path, out: Path, said: str = "") -> TlparseReport:
    logs = sorted(raw.glob("*.log"), key=lambda p: p.stat().st_mtime)
    report = parse(logs[-1], out) if logs else None
    if report is None or not report.compile_ids:
        raise RuntimeError(
            _NOTHING.format(raw) + (f"; the process said:\n{said[-2000:]}" if said else "")
        )
    return report


def trace(fn: Callable[[], Any], folder: str | Path) -> TlparseReport:
    """Call fn() in this process under torch's structured trace, and run tlparse on the log. A run
    that fails is the one you trace most: fn's exception is kept in report.error, not raised."""
    tlparse_executable()  # say what to install before running anything
    folder, raw = _fresh(folder)
    error = None
    with torch_trace(raw):
        try:
            fn()
        except Exception as e:  # noqa: BLE001  (kept for the report)
            error = e
    try:
        report = _parse_one(raw, folder / "tl_out")
    except RuntimeError:
        if error is not None:  # it failed before compiling anything: that is the news
            raise error
        raise
    report.error = error
    return report


def trace_script(
    code: str, folder: str | Path, *, env: dict[str, str] | None = None, timeout: float = 600
) -> TlparseReport:
    """Run `python -c code` in a fresh process with TORCH_TRACE set, as the guide does
    (`TORCH_TRACE=~/trace_dir python my_script.py`), then tlparse its log. The process inherits
    this one's environment (and sys.path, through PYTHONPATH), plus `env`."""
    tlparse_executable()
    folder, raw = _fresh(folder)
    child_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(p for p in sys.path if p),
        **(env or {}),
        "TORCH_TRACE": str(raw.resolve()),
    }
    result = subprocess.run(
        [sys.executable, "-c", code], env=child_env, capture_output=True, text=True, timeout=timeout
    )
    said = result.stdout + result.stderr
    report = _parse_one(raw, folder / "tl_out", said)
    report.returncode, report.output = result.returncode, said
    return report


def _compile_id_key(cid: str) -> tuple:
    return tuple(int(p) if p.isdigit() else -1 for p in re.findall(r"[^\[\]/_!]+", cid))


def _stem(name: str) -> str:
    """dynamo_output_graph_1.txt -> dynamo_output_graph (tlparse numbers every page)."""
    return re.sub(r"_\d+\.\w+$", "", name)


def _link(path: Path, text: str) -> str:
    """A link JupyterLab opens in a tab (relative to the notebook's folder), else a file URL."""
    try:
        href = os.path.relpath(path.resolve(), Path.cwd())
    except ValueError:  # another drive
        href = ""
    if not href or href.startswith(".."):
        href = path.resolve().as_uri()
    return f"<a href='{html.escape(href)}' target='_blank'>{html.escape(text)}</a>"


def _html_text(page: str) -> str:
    page = re.sub(r"<(style|script)\b.*?</\1>", "", page, flags=re.DOTALL | re.IGNORECASE)
    page = re.sub(r"<br\s*/?>|</(p|div|tr|li|h\d|pre)>", "\n", page, flags=re.IGNORECASE)
    text = html.unescape(re.sub(r"<[^>]+>", "", page))
    return "\n".join(line.rstrip() for line in text.splitlines() if line.strip())
