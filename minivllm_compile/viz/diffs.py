"""Coloured unified diffs for notebooks: removed lines red, added lines green.

`unified_diff(before, after)` returns a `Diff`. As a cell's last expression (or through
IPython.display.display) Jupyter shows its HTML, coloured; its plain text, what `print` shows
and what a static view without HTML falls back to, is difflib's unified diff unchanged."""

from __future__ import annotations

import difflib
import html
from dataclasses import dataclass

# (background, text colour) per kind of line, GitHub's diff colours
_STYLES = {
    "+": ("#e6ffec", "#116329"),
    "-": ("#ffebe9", "#82071e"),
    "@": ("#ddf4ff", "#0550ae"),
    "header": ("#f6f8fa", "#24292f"),
}


def _kind(line: str) -> str | None:
    if line.startswith(("+++", "---")):
        return "header"
    if line.startswith("@@"):
        return "@"
    if line[:1] in ("+", "-"):
        return line[0]
    return None


@dataclass(frozen=True)
class Diff:
    """A unified diff: its lines as difflib writes them (no line endings)."""

    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    @property
    def added(self) -> list[str]:
        """The added lines, without their `+`."""
        return [line[1:] for line in self.lines if _kind(line) == "+"]

    @property
    def removed(self) -> list[str]:
        """The removed lines, without their `-`."""
        return [line[1:] for line in self.lines if _kind(line) == "-"]

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:  # what Jupyter's text/plain shows
        return self.text or "(no differences)"

    def __bool__(self) -> bool:
        return bool(self.lines)

    def _repr_html_(self) -> str:
        if not self.lines:
            return "<pre>(no differences)</pre>"
        rows = []
        for line in self.lines:
            kind = _kind(line)
            # display:block: each line its own block, so its background runs the full width; inline
            # styles only (a notebook viewer's sanitizer may drop <style> elements and classes)
            style = ("display:block" if kind is None
                     else "display:block;background:{};color:{}{}".format(
                         *_STYLES[kind], ";font-weight:bold" if kind == "header" else ""))
            rows.append(f'<span style="{style}">{html.escape(line) or " "}</span>')
        return ('<pre style="line-height:1.35;font-size:85%;overflow-x:auto;padding:4px">'
                + "".join(rows) + "</pre>")


def unified_diff(before: str | list[str], after: str | list[str], fromfile: str = "before",
                 tofile: str = "after", n: int = 3) -> Diff:
    """difflib.unified_diff of two texts (or lists of lines), `n` lines of context, as a Diff."""
    a = before.splitlines() if isinstance(before, str) else list(before)
    b = after.splitlines() if isinstance(after, str) else list(after)
    return Diff(tuple(difflib.unified_diff(a, b, fromfile, tofile, n=n, lineterm="")))
