"""What one trace assumed, saved with the AOT artifact and checked when it is loaded (notebook 09).

The AOT key is known before Dynamo runs, so it cannot cover what only the trace finds out: which
functions it read, and which plain values it baked into the graph as constants. Both are recorded
when the artifact is saved, and a process that loads it checks them against what it has now; any
difference and the model is compiled afresh.

    sources  every function Dynamo traced: a file on disk by its content (as vLLM's traced files);
             code that is not in a file (a notebook cell, any source registered in linecache) by
             its text, found again by module and name. vLLM skips such code ("<string>"): a model
             edited in a notebook cell would load its old compiled forward. Code whose text cannot
             be read at all (python -c, exec) cannot be checked: such a model is never saved.
    values   every value Dynamo guarded on, read from the model, a module global or forward's
             closure (the guards are then dropped): a float on self or on its class, a private
             attribute, a field of a nested object, a number in a list, a type, a length, the
             function an attribute holds, a tensor's dtype and layout. Each is evaluated again on
             the loading model.
"""

from __future__ import annotations

import builtins
import enum
import hashlib
import inspect
import logging
import os
import re
import sys
import types
from typing import Any

import torch

logger = logging.getLogger("minivllm_compile")

# the guards whose value another process can compare; the rest (global state, shape guards, ids of
# objects that live in one process) say nothing a later process could check
_CONSTANT = {"CONSTANT_MATCH", "EQUALS_MATCH", "BOOL_MATCH", "NONE_MATCH", "NOT_NONE_MATCH"}
_IDENTITY = {"ID_MATCH", "FUNCTION_MATCH", "CLOSURE_MATCH", "BUILTIN_MATCH", "CLASS_MATCH",
             "MODULE_MATCH", "TYPE_MATCH"}
_LENGTH = {"SEQUENCE_LENGTH", "TUPLE_ITERATOR_LEN", "EMPTY_NN_MODULE_HOOKS_DICT"}
_KEYS = {"DICT_KEYS_MATCH", "DICT_CONST_KEYS_MATCH", "MAPPING_KEYS_CHECK"}
_LOCAL = re.compile(r"L\['([^']+)'\]")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _named(value: Any) -> str | None:
    """A function's, class's or module's name, the same in every process."""
    if isinstance(value, types.ModuleType):
        return value.__name__
    qualname = getattr(value, "__qualname__", None)
    module = getattr(value, "__module__", None)
    return f"{module}.{qualname}" if qualname and module else None


def _constant(value: Any) -> str | None:
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype,
                                           torch.device, enum.Enum)):
        return repr(value)
    if isinstance(value, (tuple, list, frozenset, set)):
        items = [_constant(v) for v in value]
        if None in items:
            return None
        if isinstance(value, (set, frozenset)):
            items = sorted(items)
        return f"{type(value).__name__}({', '.join(items)})"
    return None


def stable_value(guard_type: str, value: Any) -> str | None:
    """What a guard of this type checks about `value`, as text another process can compare; None
    where there is nothing stable to compare."""
    if guard_type in _CONSTANT:
        return _constant(value)
    if guard_type == "TYPE_MATCH":
        return _named(type(value))
    if guard_type in _IDENTITY:
        return _named(value) if callable(value) or isinstance(value, types.ModuleType) else None
    if guard_type in _LENGTH:
        try:
            return str(len(value))
        except TypeError:
            return None
    if guard_type in _KEYS:
        return _constant(tuple(value.keys())) if hasattr(value, "keys") else None
    if guard_type == "TENSOR_MATCH" and isinstance(value, torch.Tensor):
        return (f"{value.dtype}, {value.device.type}, sizes "
                f"{tuple(value.shape)}, strides {value.stride()}")
    return None


def value_record(entry: Any, closure_names: tuple[str, ...] = ()) -> tuple[str, str, str] | None:
    """(guard source, guard type, stable value) for a guard Dynamo offered to guard_filter_fn, or
    None: not about the model, a module global or a variable forward's closure holds (a forward
    argument is checked at every call instead), or nothing stable to compare."""
    if not entry.has_value:
        return None
    name = getattr(entry.orig_guard, "name", None) or entry.name
    if not name or any(local != "self" and local not in closure_names
                       for local in _LOCAL.findall(name)):
        return None
    if ("L[" not in name and "G[" not in name) or "G['__" in name:
        return None  # the second: what Dynamo puts in forward's globals itself (modules, builtins)
    value = stable_value(entry.guard_type, entry.value)
    return None if value is None else (name, entry.guard_type, value)


def closure(forward: types.FunctionType) -> dict[str, Any]:
    """The variables forward's closure holds (a class defined inside a function reads them)."""
    cells = forward.__closure__ or ()
    return {n: c.cell_contents for n, c in zip(forward.__code__.co_freevars, cells)
            if _filled(c)}


def _filled(cell: types.CellType) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _evaluate(name: str, model: torch.nn.Module) -> Any:
    from torch._dynamo import guards

    forward = type(model).forward
    scope = dict(guards._get_closure_vars()) if hasattr(guards, "_get_closure_vars") else {}
    scope.update(L={**closure(forward), "self": model}, G=forward.__globals__,
                 __builtins__=builtins)
    return eval(name, scope)


def _value_now(record: tuple[str, str, str], model: torch.nn.Module) -> str | None:
    name, guard_type, _ = record
    try:
        return stable_value(guard_type, _evaluate(name, model))
    except Exception:  # noqa: BLE001  (the attribute is gone, a key is missing: not what was traced)
        return "<cannot be read>"


def checkable_values(records: list[tuple[str, str, str]], model: torch.nn.Module) -> list:
    """The records that evaluate, in the process that traced them, to what Dynamo saw: only those
    can be compared in another one."""
    return [r for r in dict.fromkeys(records) if _value_now(r, model) == r[2]]


# --- sources ------------------------------------------------------------------------------------

def _resolve(module: str | None, qualname: str) -> Any:
    """The object `module.qualname` names now, or None."""
    obj = sys.modules.get(module) if module else None
    for part in qualname.split("."):
        if obj is None:
            return None
        obj = inspect.getattr_static(obj, part, None)
        obj = getattr(obj, "__func__", obj)  # a staticmethod or classmethod: its function
    return obj


def _source(obj: Any) -> str | None:
    code = getattr(obj, "__code__", None)
    try:
        return inspect.getsource(code) if code is not None else None
    except (OSError, TypeError):
        return None


def source_record(code: types.CodeType, module: str | None) -> dict:
    """How the traced `code` is found and compared again in another process."""
    if os.path.isfile(code.co_filename):
        with open(code.co_filename, "rb") as f:
            return {"file": code.co_filename, "sha256": hashlib.sha256(f.read()).hexdigest()[:16]}
    # not in a file: by its text, found again by module and name. Code defined inside a function
    # is part of that function's text: the outermost function stands for it
    qualname = code.co_qualname.split(".<locals>")[0]
    where = f"{code.co_qualname} ({code.co_filename})"
    obj = _resolve(module, qualname)
    text = _source(obj)
    if text is None or getattr(obj, "__code__", None) is None \
            or obj.__code__.co_filename != code.co_filename:
        return {"unreadable": where}
    return {"module": module, "qualname": qualname, "sha256": _sha(text)}


def source_records(traced: list[tuple[types.CodeType, str | None]]) -> list[dict]:
    records = {}
    for code, module in traced:
        record = source_record(code, module)
        records[repr(sorted(record.items()))] = record
    return list(records.values())


def changed_sources(records: list[dict]) -> list[str]:
    """The recorded sources that differ now (or cannot be found)."""
    changed = []
    for r in records:
        if "file" in r:
            try:
                with open(r["file"], "rb") as f:
                    same = hashlib.sha256(f.read()).hexdigest()[:16] == r["sha256"]
            except OSError:
                same = False
            if not same:
                changed.append(r["file"])
        elif "qualname" in r:
            text = _source(_resolve(r["module"], r["qualname"]))
            if text is None or _sha(text) != r["sha256"]:
                changed.append(f"{r['module']}.{r['qualname']}")
        else:
            changed.append(r["unreadable"])
    return changed


# --- the record, and its check ------------------------------------------------------------------

def record(model: torch.nn.Module) -> dict:
    """What the model's first compile assumed: its traced sources and the values it baked in."""
    return {"sources": source_records(getattr(model, "traced_code", [])),
            "values": checkable_values(getattr(model, "guard_values", []), model)}


def unreadable(rec: dict) -> list[str]:
    return [r["unreadable"] for r in rec.get("sources", []) if "unreadable" in r]


def check(rec: dict, model: torch.nn.Module) -> None:
    """Raise, naming the first differences, if the loading model is not what was traced."""
    changed = changed_sources(rec.get("sources", []))
    if changed:
        raise RuntimeError(f"traced source changed since it was saved: {', '.join(changed[:3])}")
    for r in rec.get("values", []):
        now = _value_now(tuple(r), model)
        if now != r[2]:
            name = re.sub(r"G\['([^']+)'\]", r"\1", _LOCAL.sub(r"\1", r[0]))
            raise RuntimeError(f"a value the compiled graph baked in differs: {name} was {r[2]} "
                               f"when it was compiled, now {now}")
