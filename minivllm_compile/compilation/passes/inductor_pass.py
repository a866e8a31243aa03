"""`InductorPass`: a post-grad graph pass Inductor can cache (vLLM's passes/inductor_pass.py).

Inductor runs `config.post_grad_custom_post_pass` on every graph it compiles and puts the pass's
`uuid()` into its FX-graph cache key. A uuid that tracks the pass's source means editing a pass
invalidates the cached kernels; one that ignored it would silently serve code compiled by the
old pass.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import marshal
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from minivllm_compile.config import Range


class PassContext:
    """What the passes may know about the compile in progress (vLLM's): the num_tokens range it
    serves, and the inputs a pass may write into (set by vLLM's IR functionalization pass)."""

    def __init__(self, compile_range: Range):
        self.compile_range = compile_range
        self.donated_input_ids: set[int] = set()


_pass_context: PassContext | None = None


def get_pass_context() -> PassContext:
    """The context of the compile in progress (vLLM's)."""
    if _pass_context is None:
        raise RuntimeError("no pass context: a pass learns its compile range only inside "
                           "pass_context(compile_range), which CompilerManager.compile_context "
                           "enters")
    return _pass_context


def in_pass_context() -> bool:
    return _pass_context is not None


@contextmanager
def pass_context(compile_range: Range) -> Iterator[None]:
    """Make `compile_range` the range of every pass Inductor runs inside (vLLM's). The backend
    enters it around each piece's compile (CompilerManager.compile_context)."""
    global _pass_context
    prev, _pass_context = _pass_context, PassContext(compile_range)
    try:
        yield
    finally:
        _pass_context = prev


def graph_text(graph: fx.Graph) -> str:
    """The graph as the Python Inductor would see it (what the records keep)."""
    return graph.python_code(root_module="self").src


def enable_fake_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run `fn` in a FakeTensorMode of its own, outside any tracing context (vLLM's, under this
    name): a fusion pass registers its patterns in it, so the example inputs it makes are fake and
    tracing a pattern runs no op at all (no kernel, no all-reduce on a process group)."""

    @functools.wraps(fn)
    def fn_new(*args: Any, **kwargs: Any) -> Any:
        with torch._guards.tracing(None), unset_fake_temporarily(), FakeTensorMode():
            return fn(*args, **kwargs)

    return fn_new


class InductorPass(CustomGraphPass):
    """A custom graph pass whose uuid is the hash of its class's source."""

    def uuid(self) -> Any:
        return InductorPass.hash_source(self)

    @staticmethod
    def hash_source(*srcs: str | Any) -> str:
        """sha256 over strings, or the source of functions/classes/(the class of) objects."""
        hasher = hashlib.sha256()
        for src in srcs:
            if isinstance(src, str):
                text = src
            else:
                obj = src if isinstance(src, (types.FunctionType, type)) else type(src)
                try:
                    text = inspect.getsource(obj)
                except (OSError, TypeError):  # defined where no source is kept (python -c)
                    if not isinstance(obj, types.FunctionType):
                        raise
                    text = repr(marshal.dumps(obj.__code__))
            hasher.update(text.encode())
        return hasher.hexdigest()

    @staticmethod
    def hash_dict(dict_: dict[Any, Any]) -> str:
        return hashlib.sha256(json.dumps(dict_, sort_keys=True).encode()).hexdigest()

    def is_applicable_for_range(self, compile_range: Range | None) -> bool:
        """A pass may apply to some num_tokens ranges only (vLLM: fusions for small batches)."""
        return True


class CallableInductorPass(InductorPass):
    """Wrap a plain `fn(graph)`; its uuid is the function's source unless given."""

    def __init__(self, callable: Callable[[fx.Graph], None], uuid: Any | None = None):
        self.callable = callable
        self._uuid = self.hash_source(callable) if uuid is None else uuid

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.callable(graph)

    def uuid(self) -> Any:
        return self._uuid
