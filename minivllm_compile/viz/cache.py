"""The compile cache on disk, as a tree with sizes and each backend entry's key factors (notebook 09)."""

from __future__ import annotations

import json
from pathlib import Path

from minivllm_compile.cache_files import cache_root

# where compiler_interface.initialize_inductor_cache points Inductor's and Triton's own caches
FOREIGN_CACHES = {"inductor_cache": "Inductor's FX graph cache and generated code",
                  "triton_cache": "Triton's compiled kernels"}


def describe_cache(root: str | Path | None = None) -> str:
    """The cache as a tree with sizes, the factors of each backend entry, and its artifacts."""
    root = Path(root) if root else cache_root()
    if not root.exists():
        return f"{root}: empty (nothing compiled with the cache on yet)"
    lines = [f"{root}"]
    for path in sorted(p for p in root.rglob("*") if not p.name.startswith(".")):
        rel = path.relative_to(root).parts
        if any(part in FOREIGN_CACHES for part in rel[:-1]):
            continue  # inside Inductor's or Triton's own cache: one line for the whole folder
        depth = len(rel)
        files = [f for f in path.rglob("*") if f.is_file()] if path.is_dir() else [path]
        size = sum(f.stat().st_size for f in files)
        note = f"  ({len(files)} files: {FOREIGN_CACHES[path.name]})" if path.name in FOREIGN_CACHES else ""
        lines.append(f"{'  ' * depth}{path.name}{'/' if path.is_dir() else ''}  {_human(size)}{note}")
        if path.name == "cache_key_factors.json":
            factors = json.loads(path.read_text())
            for k, v in factors.items():
                shown = f"{len(v)} files" if k == "traced_files" else v
                lines.append(f"{'  ' * (depth + 1)}· {k}: {shown}")
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable: GB always returns")
