"""The compile cache on disk, as a tree with sizes and each backend entry's
key factors (notebook 09): one line per part of cache_key_factors.json (env, config.model,
config.compilation, ..., code, compiler.inductor, the hashes), each in brief; the file holds them
whole, and viz.debugging.changed_factors names the fields two entries differ in.

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
    order = {"env": 0, "config": 1, "code": 2, "compiler": 3}  # vLLM's, then the hashes
    lines = []
    for key, value in sorted(factors.items(), key=lambda kv: (order.get(kv[0], 4), kv[0])):
        if key == "code" and isinstance(value, dict) and isinstance(value.get("files"), list):
            lines.append(f"{pad}· code: {len(value['files'])} files")
        elif key in ("config", "compiler") and isinstance(value, dict) and value:
            lines += [f"{pad}· {key}.{k}: {_brief(v, k)}" for k, v in value.items()]
        elif key == "traced_files" and hasattr(value, "__len__"):  # a cache of before 0.34
            lines.append(f"{pad}· traced_files: {len(value)} files")
        else:
            lines.append(f"{pad}· {key}: {_brief(value)}")
    return lines


def _one(v: object) -> str:
    if isinstance(v, dict):
        return f"{len(v)} entries"
    if isinstance(v, list) and len(v) > 4:
        return f"{len(v)} items"
    if isinstance(v, str) and len(v) >= 32 and all(c in "0123456789abcdef" for c in v):
        return v[:12] + "…"  # a hash
    if isinstance(v, str) and v:
        return v
    return json.dumps(v) if isinstance(v, (list, str)) else str(v)


def _brief(value: object, name: str = "", width: int = 110) -> str:
    """A factor in one line: a dict as its entries (plain values first; a long list or a dict
    within by its length, a hash by its first 12 digits), cut at `width` characters. The model by
    its class and counts; the compilation config by the fields not at this process's defaults."""
    if name == "model" and isinstance(value, dict) and "parameters" in value:
        parts = [str(value.get("class")).rsplit(".", 1)[-1]]
        parts += [f"{len(value[k])} {k}" for k in ("parameters", "buffers", "constants")
                  if isinstance(value.get(k), dict)]
        inputs = value.get("inputs")
        parts += [f"inputs {', '.join(inputs)}" if isinstance(inputs, dict) and inputs
                  else "inputs none", f"tag {value.get('tag')}"]
        text = ", ".join(parts)
    elif name == "compilation" and isinstance(value, dict):
        from minivllm_compile.config import CompilationConfig

        # as the file holds them: JSON's lists, not normalize_value's tuples
        default = json.loads(json.dumps(CompilationConfig().compile_factors()))
        changed = [f"{k}={_one(v)}" for k, v in value.items() if default.get(k) != v]
        text = (f"{len(value)} fields, " + (f"not at their default: {', '.join(changed)}"
                                            if changed else "all at their default"))
    elif isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: isinstance(kv[1], (dict, list)))
        text = ", ".join(f"{k}={_one(v)}" for k, v in items)
    else:
        text = _one(value)
    return text if len(text) <= width else text[:width - 1] + "…"


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
