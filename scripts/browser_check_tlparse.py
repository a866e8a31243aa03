#!/usr/bin/env python
"""A real-browser check of a tlparse report: headless Chromium, driven by Playwright, opens the
report's index.html and checks that it names every compiled piece, then follows one piece's link.

    .venv/bin/python scripts/browser_check_tlparse.py REPORT_DIR --pieces submod_0,submod_2
    .venv/bin/python scripts/browser_check_tlparse.py            # traces a 2-layer Llama first

REPORT_DIR is tlparse's output folder (the one holding index.html, e.g. a notebook's
traces/healthy/tl_out). Without it, the script compiles a 2-layer Llama under VLLM_COMPILE (eager
backend) with minivllm_compile.viz.trace.trace into a temp dir, and expects its three pieces.

Exit status: 0 passed; 1 failed (a message on stderr says why); 2 a prerequisite is missing
(chromium, playwright, tlparse).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class CheckFailed(Exception):
    pass


class Missing(Exception):
    pass


def find_chromium(explicit: str | None) -> str:
    path = (
        explicit
        or os.environ.get("CHROMIUM")
        or shutil.which("chromium")
        or shutil.which("chromium-browser")
    )
    if not path or not os.access(path, os.X_OK):
        raise Missing(
            "no chromium binary found: install it with `apt-get install -y chromium` "
            "(or pass --chromium PATH / set CHROMIUM)"
        )
    return path


def make_report(folder: Path) -> tuple[Path, list[str]]:
    """A fresh report of a healthy 2-layer Llama, and the pieces it must name."""
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
    import torch

    from minivllm_compile import CompilationConfig, CompilationMode
    from minivllm_compile.models import build_model
    from minivllm_compile.viz.trace import trace

    cc = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE, backend="eager", max_num_batched_tokens=16
    )
    lm = build_model("llama", num_layers=2, compilation_config=cc)
    report = trace(lambda: lm(torch.arange(8) + 1, torch.arange(8)), folder)
    return report.out, report.pieces()


def check(report_dir: Path, pieces: list[str], chromium: str) -> str:
    """Open index.html, find a link naming each piece, open the first piece's page."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise Missing(
            f"playwright is not importable from {sys.executable}: install it with "
            "`.venv/bin/pip install playwright` (its browser download is not needed)"
        ) from None
    index = (report_dir / "index.html").resolve()
    if not index.is_file():
        raise CheckFailed(
            f"{index} does not exist: give tlparse's output folder (the one with index.html)"
        )
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium,
            headless=True,
            args=["--no-sandbox", "--disable-dev-shm-usage"],
        )
        try:
            page = browser.new_page()
            page.goto(index.as_uri())
            text = page.inner_text("body")
            if "Stack trie" not in text:
                raise CheckFailed(
                    f"{index} does not look like a tlparse report (no 'Stack trie' section)"
                )
            links = page.eval_on_selector_all(
                "a", "els => els.map(e => [e.textContent, e.getAttribute('href')])"
            )
            # a link reads "<compile dir>/vllm_submod_0_5.txt": tlparse numbers every page
            named = {
                p: [
                    href
                    for label, href in links
                    if label.strip().split("/")[-1].startswith(f"vllm_{p}_")
                ]
                for p in pieces
            }
            missing = [p for p, hrefs in named.items() if not hrefs]
            if missing:
                raise CheckFailed(
                    f"the report's index names no page for the pieces {missing} "
                    f"(its vllm_ links: {[label for label, _ in links if 'vllm_' in label]})"
                )
            page.click(f"a[href='{named[pieces[0]][0]}']")
            piece_text = page.inner_text("body")
            if "def forward" not in piece_text:
                raise CheckFailed(
                    f"the page of {pieces[0]} does not show its graph: {piece_text[:200]!r}"
                )
        finally:
            browser.close()
    return f"the index names {', '.join(pieces)}, and {pieces[0]}'s page shows its graph"


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "report", nargs="?", type=Path, help="tlparse's output folder (with index.html)"
    )
    parser.add_argument(
        "--pieces", help="comma-separated piece names the index must name (submod_0,...)"
    )
    parser.add_argument(
        "--chromium", help="the chromium binary (default: $CHROMIUM, then `which chromium`)"
    )
    args = parser.parse_args()
    try:
        chromium = find_chromium(args.chromium)
        if args.report is None:
            report_dir, pieces = make_report(Path(tempfile.mkdtemp(prefix="tlparse_check_")))
        else:
            if not args.pieces:
                raise CheckFailed(
                    "give --pieces with a report folder (the pieces its index must name)"
                )
            report_dir, pieces = args.report, args.pieces.split(",")
        said = check(report_dir, pieces, chromium)
    except Missing as e:
        print(f"MISSING: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:  # no tlparse, when the report is made here
        print(f"MISSING: {e}", file=sys.stderr)
        return 2
    except CheckFailed as e:
        print(f"FAILED: {e}", file=sys.stderr)
        return 1
    print(f"PASSED: {said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
