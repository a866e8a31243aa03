#!/usr/bin/env python
"""A real-browser check of what a student sees: JupyterLab + headless Chromium, via Playwright.

It starts JupyterLab (the Python that runs this script must be the project's environment, e.g.
.venv/bin/python) on a throw-away copy of notebooks/ in a temp dir, with the notebook environment CI
uses (TRITON_INTERPRET=1, VLLM_DISABLE_COMPILE_CACHE=1, fresh VLLM_CACHE_ROOT and
TORCHINDUCTOR_CACHE_DIR; MINIVLLM_SOLUTIONS unset, so the exercises grade what is typed), and
opens a notebook in headless Chromium. Then one of two checks:

- a widget (the default, on 07_piecewise_backend.ipynb unless told otherwise): run all cells, wait
  for the kernel to go idle, check that no cell errored, find the first ipywidgets slider in the
  outputs, move it with the arrow keys (a mouse drag if the keys do nothing) and check that the
  text the widget shows next to the slider changes;
- an exercise (--exercise KEY, e.g. 06.1, on its notebook): the student's path, in
  scripts/browser_exercise.py. Run the exercise's starter cell (it must say "not attempted yet"),
  type the registered wrong answer into the cell and run it (the lesson, as plain text: no
  traceback, not the right value), then the reference answer (it must say "your answer is right").

The notebook in the repository is never opened: the copy's outputs and saved widget state are
stripped first, so the slider found can only be one the run just made. Only the copy is saved.

Exit status: 0 the check passed; 1 it failed (a message on stderr says which step and why);
2 a prerequisite is missing (chromium, playwright, jupyterlab). JupyterLab is always shut down.

    .venv/bin/python scripts/browser_check.py [--notebook 07_piecewise_backend.ipynb]
        [--timeout 1200]
    .venv/bin/python scripts/browser_check.py --exercise 06.1
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
DEFAULT_NOTEBOOK = "07_piecewise_backend.ipynb"

T0 = time.monotonic()
STEP = "starting"


class CheckFailed(Exception):
    """The check ran and something was wrong: exit 1."""


class Missing(Exception):
    """A prerequisite is not installed: exit 2."""


class Deadline(BaseException):
    """--timeout ran out (raised from SIGALRM; a BaseException so that no
    `except OSError` eats it)."""


def log(msg: str) -> None:
    print(f"[{time.monotonic() - T0:7.1f}s] {msg}", flush=True)


def step(name: str) -> None:
    global STEP
    STEP = name
    log(name)


def find_chromium(explicit: str | None) -> str:
    path = explicit or os.environ.get("CHROMIUM") or shutil.which(
        "chromium") or shutil.which("chromium-browser")
    if not path or not os.access(path, os.X_OK):
        raise Missing("no chromium binary found: install it with `apt-get install -y chromium` "
                      "(or pass --chromium PATH / set CHROMIUM)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_copy(tmp: Path, source_dir: Path, notebook: str) -> Path:
    """Copy source_dir into tmp and strip the target notebook's outputs and saved widget state."""
    import nbformat

    src = source_dir / notebook
    if not src.is_file():
        raise CheckFailed(f"no notebook {src}")
    dst_dir = tmp / "notebooks"
    shutil.copytree(source_dir, dst_dir, ignore=shutil.ignore_patterns(".ipynb_checkpoints",
                                                                       "__pycache__"))
    dst = dst_dir / notebook
    nb = nbformat.read(dst, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, dst)
    return dst


def write_lab_settings(settings_dir: Path) -> None:
    """User settings for this run only: every cell in the DOM (no windowing),
    no news/update toasts."""
    files = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
            {"fetchNews": "false", "checkForUpdates": False},
    }
    for rel, content in files.items():
        path = settings_dir / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(content))


def api(port: int, token: str, path: str, timeout: float = 5.0):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                 headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read().decode())


def start_lab(tmp: Path, root_dir: Path, port: int, token: str) -> tuple[subprocess.Popen, Path]:
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        raise Missing(f"jupyterlab is not importable from {sys.executable}: run this script with "
                      "the project's environment (.venv/bin/python)") from None
    env = dict(os.environ)
    env.update(
        TRITON_INTERPRET="1",
        VLLM_DISABLE_COMPILE_CACHE="1",
        VLLM_CACHE_ROOT=str(tmp / "vllm_cache"),
        TORCHINDUCTOR_CACHE_DIR=str(tmp / "inductor_cache"),
        # no user config (passwords, extensions settings)
        JUPYTER_CONFIG_DIR=str(tmp / "jupyter_config"),
        JUPYTER_RUNTIME_DIR=str(tmp / "jupyter_runtime"),
        PYTHONUNBUFFERED="1",
    )
    env.pop("MINIVLLM_SOLUTIONS", None)  # a student's kernel: check() grades the answer in the cell
    for d in ("vllm_cache", "inductor_cache", "jupyter_config", "jupyter_runtime"):
        (tmp / d).mkdir()
    write_lab_settings(tmp / "lab_settings")
    cmd = [
        sys.executable, "-m", "jupyterlab",
        "--no-browser",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root_dir}",
        f"--LabApp.user_settings_dir={tmp / 'lab_settings'}",
        f"--LabApp.workspaces_dir={tmp / 'lab_workspaces'}",
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd.append("--allow-root")
    log_path = tmp / "jupyterlab.log"
    with open(log_path, "wb") as log_file:   # the server keeps its own copy of the descriptor
        proc = subprocess.Popen(cmd, env=env, cwd=root_dir, stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log_path


def wait_for_lab(proc: subprocess.Popen, port: int, token: str, log_path: Path,
                 timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise CheckFailed("JupyterLab exited with status "
                              f"{proc.returncode} before it answered:\n"
                              + tail(log_path))
        try:
            api(port, token, "/api/status", timeout=2)
            return
        except (urllib.error.URLError, OSError, ValueError):
            time.sleep(0.5)
    raise CheckFailed(f"JupyterLab did not answer on port {port} within {timeout:.0f} s:\n"
                      + tail(log_path))


def stop_lab(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        # the server and the kernels it started (its own session)
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=5)
    # a kernel still alive in the group after the server went
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: Path, n: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join("    " + line for line in lines[-n:])


def kernel_states(port: int, token: str, notebook: str) -> list[str]:
    states = []
    for s in api(port, token, "/api/sessions"):
        if s.get("path", "").endswith(notebook) and s.get("kernel"):
            states.append(s["kernel"].get("execution_state", "?"))
    return states


def wait_until(predicate, timeout: float, what: str, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise CheckFailed(f"{what} (waited {timeout:.0f} s)")
        time.sleep(interval)


PROMPTS_JS = """() => Array.from(document.querySelectorAll(
    '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputArea-prompt'))
    .map(e => e.textContent.trim())"""

# the text the output area around the slider shows, the slider itself left out
SLIDER_OUTPUT_JS = """(el) => {
    const area = el.closest('.jp-Cell-outputArea') || el.closest('.jp-OutputArea')
        || el.parentElement;
    const clone = area.cloneNode(true);
    clone.querySelectorAll('.widget-slider, .widget-hslider, .widget-vslider')
        .forEach(s => s.remove());
    return clone.innerText.trim();
}"""


def check_saved_notebook(path: Path, notebook: str) -> int:
    nb = json.loads(path.read_text())
    code = [(i, c) for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
            and "".join(c["source"]).strip()]
    for i, cell in code:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                first = "".join(cell["source"]).strip().splitlines()[0]
                raise CheckFailed(f"cell {i} of {notebook} raised {out.get('ename')}: "
                                  f"{out.get('evalue')}\n    (the cell starts: {first!r})")
    not_run = [i for i, c in code if c.get("execution_count") is None]
    if not_run:
        raise CheckFailed("the notebook did not run to its end: cells "
                          f"{not_run} have no execution count")
    return len(code)


def run_check(args) -> None:
    try:
        from playwright.sync_api import Error as PlaywrightError
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise Missing(f"playwright is not importable from {sys.executable}: install it with "
                      "`.venv/bin/pip install playwright` (its own browser download is not needed; "
                      "this script uses the system chromium)") from None
    chromium = find_chromium(args.chromium)
    if args.exercise:
        from browser_exercise import PlanError, plan

        try:
            args.plan = plan(args.exercise, Path(args.dir))
        except (PlanError, ValueError) as e:
            raise CheckFailed(f"--exercise {args.exercise}: {e}") from None
        args.notebook = args.plan.notebook

    tmp = Path(tempfile.mkdtemp(prefix="browser_check_"))
    proc = None
    try:
        step(f"copying {args.dir} to {tmp} (outputs of {args.notebook} stripped)")
        nb_path = prepare_copy(tmp, Path(args.dir), args.notebook)
        port, token = free_port(), os.urandom(16).hex()
        step(f"starting JupyterLab on 127.0.0.1:{port}")
        proc, log_path = start_lab(tmp, nb_path.parent, port, token)
        wait_for_lab(proc, port, token, log_path, timeout=min(120, remaining(args)))
        log("JupyterLab is up")

        with sync_playwright() as pw:
            step(f"launching headless {chromium}")
            browser = pw.chromium.launch(executable_path=chromium, headless=True,
                                         args=["--no-sandbox", "--disable-dev-shm-usage"])
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 1000})
                page_errors: list[str] = []
                page.on("pageerror", lambda e: page_errors.append(str(e)))
                page.on("console", lambda m: page_errors.append(m.text)
                        if m.type == "error" else None)
                try:
                    drive(page, port, token, args, nb_path, log_path, page_errors)
                except PlaywrightError as e:
                    shot = tmp / "failure.png"
                    try:
                        page.screenshot(path=str(shot), full_page=False)
                    except PlaywrightError:
                        pass
                    raise CheckFailed(f"the browser step failed: {e}\n    screenshot: {shot}"
                                      + errors_text(page_errors)) from None
            finally:
                try:
                    browser.close()
                except Exception as e:  # noqa: BLE001 - a browser cut short by the deadline
                    log(f"closing the browser: {e}")
    finally:
        signal.alarm(0)   # the clean-up below is not cut short by the deadline
        if proc is not None:
            log("shutting JupyterLab down")
            stop_lab(proc)
        if args.keep:
            log(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def errors_text(page_errors: list[str]) -> str:
    if not page_errors:
        return ""
    return "\n    browser console errors:\n" + "\n".join("      " + e[:300]
                                                         for e in page_errors[-10:])


def remaining(args) -> float:
    return max(1.0, args.timeout - (time.monotonic() - T0))


def drive(page, port, token, args, nb_path: Path, log_path: Path, page_errors: list[str]) -> None:
    nb = args.notebook
    step(f"opening {nb} in JupyterLab")
    page.goto(f"http://127.0.0.1:{port}/lab/tree/{nb}?token={token}", timeout=120_000)
    page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-Cell", timeout=120_000)
    try:
        wait_until(lambda: kernel_states(port, token, nb) == ["idle"], min(120, remaining(args)),
                   f"the kernel of {nb} did not start and go idle")
    except CheckFailed as e:
        raise CheckFailed(f"{e}; the server's log ends:\n" + tail(log_path)) from None
    n_prompts = len(page.evaluate(PROMPTS_JS))
    if n_prompts == 0:
        raise CheckFailed(f"{nb} shows no code cells in JupyterLab")
    if args.exercise:
        from browser_exercise import drive_exercise

        def kernel_idle() -> bool:
            return kernel_states(port, token, nb) == ["idle"]

        drive_exercise(page, args.plan, kernel_idle, wait_until, log, step, CheckFailed,
                       lambda: min(300, remaining(args)))
        return

    step("Run > Run All Cells")
    page.locator(".jp-NotebookPanel .jp-Notebook").first.click(position={"x": 5, "y": 5})
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name=re.compile(r"^Run All Cells")).click()

    def started():
        return any(p != "[ ]:" for p in page.evaluate(PROMPTS_JS))
    wait_until(started, 60, "the notebook did not start running after Run All Cells")

    step(f"waiting for the kernel to go idle ({n_prompts} code cells)")
    last_report = [time.monotonic()]
    idle_since = [None]

    def idle():
        prompts = page.evaluate(PROMPTS_JS)
        busy = [p for p in prompts if p == "[*]:"]
        states = kernel_states(port, token, nb)
        if "dead" in states:
            raise CheckFailed(f"the kernel died while running {nb}:\n" + tail(log_path))
        if time.monotonic() - last_report[0] > 30:
            done = sum(1 for p in prompts if re.fullmatch(r"\[\d+\]:", p))
            log(f"  {done}/{len(prompts)} cells done, kernel {states}")
            last_report[0] = time.monotonic()
        if busy or states != ["idle"]:
            idle_since[0] = None
            return False
        idle_since[0] = idle_since[0] or time.monotonic()
        return time.monotonic() - idle_since[0] > 2   # idle for 2 s: nothing left in the queue
    wait_until(idle, remaining(args), f"the kernel was still running {nb} when --timeout "
               f"({args.timeout:.0f} s) ran out", interval=1.0)

    step("saving the copy and reading its outputs")
    before = nb_path.stat().st_mtime_ns
    page.keyboard.press("Control+s")
    wait_until(lambda: nb_path.stat().st_mtime_ns != before, 30,
               "the copy of the notebook was not saved")
    time.sleep(0.5)
    n_code = check_saved_notebook(nb_path, nb)
    log(f"all {n_code} code cells ran, none raised")

    step("looking for a slider widget in the outputs")
    sliders = page.locator(".jp-OutputArea-output .widget-slider")
    if sliders.count() == 0:
        raise CheckFailed(f"no ipywidgets slider in the outputs of {nb} (an IntSlider was expected)"
                          + errors_text(page_errors))
    slider = sliders.first
    slider.scroll_into_view_if_needed()
    readout = slider.locator(".widget-readout")
    handle = slider.locator(".noUi-handle").first

    def value():
        return (readout.inner_text().strip() if readout.count()
                else handle.get_attribute("aria-valuenow"))

    def shown():
        return slider.evaluate(SLIDER_OUTPUT_JS)
    v0, out0 = value(), shown()
    log(f"slider at {v0}; the output next to it: {out0.splitlines()[0] if out0 else '(empty)'!r}")

    step("moving the slider (ArrowRight)")
    handle.focus()
    for _ in range(3):
        handle.press("ArrowRight")
    if value() == v0:
        log("the arrow keys did not move it; dragging the handle")
        box = handle.bounding_box()
        page.mouse.move(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
        page.mouse.down()
        page.mouse.move(box["x"] + box["width"] / 2 + 60, box["y"] + box["height"] / 2, steps=10)
        page.mouse.up()
    v1 = value()
    if v1 == v0:
        raise CheckFailed(f"the slider did not move: it still reads {v0} "
                          "after ArrowRight and a drag")

    step(f"slider moved {v0} -> {v1}; waiting for the output to change")
    stable = {"text": None, "since": 0.0}

    def changed():
        text = shown()
        if not text or text == out0:
            stable["text"] = None
            return False
        if text != stable["text"]:
            stable.update(text=text, since=time.monotonic())
            return False
        return time.monotonic() - stable["since"] > 1.5 and kernel_states(port, token,
                                                                          nb) == ["idle"]
    try:
        wait_until(changed, min(args.change_timeout, remaining(args)), "")
    except CheckFailed:
        raise CheckFailed(f"the widget's output did not change within {args.change_timeout:.0f} s "
                          f"after the slider moved {v0} -> {v1}; it still shows:\n    "
                          + out0.replace("\n", "\n    ") + errors_text(page_errors)) from None
    out1 = shown()
    if "Traceback" in out1:
        raise CheckFailed("the widget's output after the move is a traceback:\n    "
                          + out1.replace("\n", "\n    "))
    log(f"the output changed: {out1.splitlines()[0]!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--notebook", default=DEFAULT_NOTEBOOK,
                    help="a notebook in --dir (default: %(default)s)")
    ap.add_argument("--dir", default=str(NOTEBOOKS),
                    help="the folder the notebook is in; all of it is copied "
                         "(default: the repo's notebooks/)")
    ap.add_argument("--timeout", type=float, default=1200,
                    help="seconds for the whole check (default: %(default)s)")
    ap.add_argument("--change-timeout", type=float, default=60,
                    help="seconds to wait for the widget's output to change after the "
                         "move (default: %(default)s)")
    ap.add_argument("--exercise", metavar="KEY",
                    help="instead of the widget check: the student's path through exercise KEY "
                         "(e.g. 06.1) in its notebook: the starter, a wrong answer, the right one")
    ap.add_argument("--chromium", help="path of the chromium binary (default: "
                                       "$CHROMIUM or `which chromium`)")
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (server "
                                                        "log, saved copy, screenshot)")
    args = ap.parse_args(argv)

    def on_alarm(signum, frame):
        raise Deadline
    signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(int(args.timeout) + 1)
    try:
        run_check(args)
    except Missing as e:
        print(f"browser_check: MISSING: {e}", file=sys.stderr)
        return 2
    except CheckFailed as e:
        used_up = time.monotonic() - T0 >= args.timeout - 2
        note = f"\n    (the --timeout of {args.timeout:.0f} s was used up)" if used_up else ""
        print(f"browser_check: FAILED at step '{STEP}': {e}{note}", file=sys.stderr)
        return 1
    except Deadline:
        print(f"browser_check: FAILED: timed out after {args.timeout:.0f} s at step '{STEP}'",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"browser_check: interrupted at step '{STEP}'", file=sys.stderr)
        return 1
    finally:
        signal.alarm(0)
    if args.exercise:
        log(f"PASSED: exercise {args.exercise} in {args.notebook}: the starter said 'not attempted "
            "yet', a wrong answer got its lesson as plain text without the right value, the right "
            "answer was told so")
    else:
        log(f"PASSED: {args.notebook}: all cells ran, the slider moved and its output changed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
