"""Send a function to the ranks, by value when it cannot go by reference.

A rank is a fresh Python process. pickle sends a function by reference (its module and name) and
the rank imports it: fine for a function in a module, impossible for one defined in a notebook
cell, which lives in the kernel's `__main__` and nowhere else. Such a function goes by value: its
compiled code (marshal: the rank runs the same interpreter), its defaults, its closure, and the
globals its code names, each by reference where it can be (modules, importable functions and
classes), by value where it must (other functions of the notebook), pickled otherwise (numbers,
strings, tensors, ...). What cannot travel (a class defined in the notebook, an open file) is
refused here, in the notebook, naming the global and what to do; nothing starts.
"""

from __future__ import annotations

import builtins
import importlib
import marshal
import pickle
import types
from collections.abc import Callable
from typing import Any

_BY_VALUE_MODULES = ("__main__", "__mp_main__")


def dumps(fn: Callable) -> bytes:
    if not callable(fn):
        raise TypeError(f"expected a function to run on every rank, got {type(fn).__name__}")
    return pickle.dumps(_pack_value(getattr(fn, "__name__", repr(fn)), fn, {}, "the function"))


def loads(data: bytes) -> Callable:
    return _unpack(pickle.loads(data), {})


def _importable(obj: Any) -> bool:
    """Whether a fresh process gets this very object back from importing its module and name."""
    module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if module is None or module in _BY_VALUE_MODULES or "<" in qualname:
        return False
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return False
    return found is obj


def _global_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:  # nested functions, lambdas, comprehensions
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _pack_function(fn: types.FunctionType, memo: dict[int, int]) -> tuple:
    if id(fn) in memo:  # a function that calls itself, or two that call each other
        return ("ref", memo[id(fn)])
    memo[id(fn)] = key = len(memo)
    where = f"{fn.__qualname__}"
    globs = {name: _pack_value(name, fn.__globals__[name], memo, where)
             for name in sorted(_global_names(fn.__code__)) if name in fn.__globals__}
    closure = [_pack_value(var, _cell_contents(cell), memo, where)
               for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ())]
    defaults = [_pack_value("a default", v, memo, where) for v in fn.__defaults__ or ()]
    kwdefaults = {k: _pack_value(k, v, memo, where) for k, v in (fn.__kwdefaults__ or {}).items()}
    return ("function", key, marshal.dumps(fn.__code__), fn.__name__, fn.__qualname__, globs,
            closure, defaults, kwdefaults)


_EMPTY_CELL = ("empty",)


def _cell_contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a variable of the enclosing function not assigned yet
        return _EMPTY_CELL


def _pack_value(name: str, value: Any, memo: dict[int, int], where: str) -> tuple:
    if value is _EMPTY_CELL:
        return _EMPTY_CELL
    if isinstance(value, types.ModuleType):
        return ("module", value.__name__)
    if isinstance(value, types.FunctionType) and not _importable(value):
        return _pack_function(value, memo)
    if isinstance(value, type) and not _importable(value):
        raise TypeError(f"{where} uses the class {name!r} ({value.__qualname__}), defined where "
                        "a rank cannot import it (a notebook cell): move the class into a module "
                        "the ranks can import, or define it inside the function")
    try:
        return ("value", pickle.dumps(value))
    except Exception as e:  # noqa: BLE001  (pickle raises many types; each means "cannot travel")
        raise TypeError(f"{where} uses {name!r}, a {type(value).__name__} that cannot be sent to "
                        f"the ranks ({type(e).__name__}: {e}): create it inside the function, or "
                        "pass what it is made from as an argument") from None


def _unpack(packed: tuple, memo: dict[int, Callable]) -> Any:
    kind = packed[0]
    if kind == "empty":
        return _EMPTY_CELL
    if kind == "module":
        return importlib.import_module(packed[1])
    if kind == "value":
        return pickle.loads(packed[1])
    if kind == "ref":
        return memo[packed[1]]
    _, key, code, name, qualname, globs, closure, defaults, kwdefaults = packed
    namespace: dict[str, Any] = {"__builtins__": builtins, "__name__": "__minivllm_by_value__"}
    cells = tuple(types.CellType() for _ in closure)
    fn = types.FunctionType(marshal.loads(code), namespace, name, None, cells or None)
    fn.__qualname__ = qualname
    memo[key] = fn  # before the globals: they may name fn itself
    namespace.update({k: _unpack(v, memo) for k, v in globs.items()})
    for cell, value in zip(cells, closure):
        value = _unpack(value, memo)
        if value is not _EMPTY_CELL:
            cell.cell_contents = value
    fn.__defaults__ = tuple(_unpack(v, memo) for v in defaults) or None
    fn.__kwdefaults__ = {k: _unpack(v, memo) for k, v in kwdefaults.items()} or None
    return fn
