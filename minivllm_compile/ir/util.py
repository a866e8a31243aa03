"""Hashing an implementation's source for the compile cache (vLLM's vllm/ir/util.py)."""

from __future__ import annotations

import hashlib
import inspect
import marshal
from collections.abc import Callable
from pathlib import Path


def source_hash(fn: Callable) -> str:
    """sha256 of the file that defines `fn` (vLLM hashes the file: a helper beside the function
    changes the key too). A function defined where no file is kept (a notebook cell, `python -c`)
    hashes by its source as Python's linecache holds it, or at worst by its bytecode."""
    hasher = hashlib.sha256()
    fn = inspect.unwrap(fn)
    try:
        path = Path(inspect.getfile(fn))
        text = path.read_text() if path.is_file() else inspect.getsource(fn)
    except (OSError, TypeError):
        text = repr(marshal.dumps(fn.__code__))
    hasher.update(f"{getattr(fn, '__qualname__', fn)}\n{text}".encode())
    return hasher.hexdigest()
