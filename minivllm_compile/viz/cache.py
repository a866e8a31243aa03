"""The compile cache on disk, as a tree with sizes and each backend entry's
key factors (notebook 09).

A cache is read as it is found: half-written, copied from elsewhere, edited by hand. An entry that
cannot be read (a truncated cache_key_factors.json, a dangling symlink, a folder this user may not
list) gets a line saying what is wrong with it, and the tree goes on past it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from minivllm_compile.compilation.cache_files import cache_root

# where compiler_interface.initialize_inductor_cache points Inductor's and Triton's own caches
FOREIGN_CACHES = {"inductor_cache": "Inductor's FX graph cache and generated code",
                  "triton_cache": "Triton's compiled kernels"}


def describe_cache(root: str | Path | None = None) -> str:
    """The cache as a tree with sizes, the factors of each backend entry, and its artifacts."""
    root = Path(root) if root else cache_root()
    if not root.exists():
        return f"{root}: empty (nothing compiled with the cache on yet)"
    lines = [f"{root}"]
    _describe_folder(root, 1, lines)
    return "\n".join(lines)


def _describe_folder(folder: Path, depth: int, lines: list[str]) -> None:
    pad = "  " * depth
    try:
        children = sorted(p for p in folder.iterdir() if not p.name.startswith("."))
    except OSError as e:
        lines.append(f"{pad}(cannot list {folder.name}/: {_reason(e)})")
        return
    for path in children:
        try:
            if path.is_symlink() and not path.exists():
                lines.append(f"{pad}{path.name}  (dangling symlink to {os.readlink(path)})")
            elif path.is_dir():
                count, size = _folder_size(path)
                note = (f"  ({count} files: {FOREIGN_CACHES[path.name]})"
                        if path.name in FOREIGN_CACHES else "")
                lines.append(f"{pad}{path.name}/  {_human(size)}{note}")
                if path.name not in FOREIGN_CACHES:  # Inductor's or Triton's own: one line
                    _describe_folder(path, depth + 1, lines)
            else:
                lines.append(f"{pad}{path.name}  {_human(path.stat().st_size)}")
                if path.name == "cache_key_factors.json":
                    lines += _factor_lines(path, pad + "  ")
        except OSError as e:
            lines.append(f"{pad}{path.name}  (unreadable: {_reason(e)})")


def _factor_lines(path: Path, pad: str) -> list[str]:
    try:
        factors = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        what = "truncated or not JSON" if isinstance(e, ValueError) else _reason(e)
        return [f"{pad}· unreadable: {what} ({str(e).splitlines()[0][:120]})"]
    if not isinstance(factors, dict):
        return [f"{pad}· unreadable: a {type(factors).__name__}, not the factors' dict"]
    return [f"{pad}· {k}: "
            f"{f'{len(v)} files' if k == 'traced_files' and hasattr(v, '__len__') else v}"
            for k, v in factors.items()]


def _folder_size(folder: Path) -> tuple[int, int]:
    """Files below `folder` and their bytes; what cannot be read is left out."""
    count = size = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            try:
                size += os.stat(os.path.join(dirpath, name)).st_size
                count += 1
            except OSError:
                pass
    return count, size


def _reason(e: OSError) -> str:
    return e.strerror or type(e).__name__


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable: GB always returns")
