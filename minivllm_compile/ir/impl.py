"""`IrOpImpl`: one provider's implementation of an IR op (vLLM 0.34's vllm/ir/op.py, IrOpImpl).

Every check a registration makes is here, and each refusal names the op, what was wrong and what
to do: a provider name that is reserved, malformed or taken; a schema that differs from the
native implementation's; a `supports_args` whose parameters differ from the op's. Each message
starts with vLLM's words (its tests match them: tests/ir/test_op.py) and the exception type is
vLLM's: AssertionError for a reserved or taken name (vLLM asserts; here it is raised, so it holds
under `python -O` too), ValueError for the rest.

Ops and providers record where they were registered (`_registration_stack`, as in vLLM 0.34: the
stack of the registering call, this package's own frames left out), so a name registered twice
is refused naming both places.
"""

from __future__ import annotations

import inspect
import re
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.library import infer_schema

from minivllm_compile.ir.util import source_hash

if TYPE_CHECKING:
    from minivllm_compile.ir.op import IrOp

NAME_PATTERN = re.compile(r"^[a-z_][a-z_0-9]*$")  # vLLM's: also a valid torch op name

RESERVED_PROVIDERS = ["native", "unfused"]
"""`native` is the op's own Python body; `unfused` is kept free by vLLM for the decomposed form."""


def validate_name(name: Any, entity: str, op_name: str | None = None) -> None:
    if isinstance(name, str) and NAME_PATTERN.match(name):
        return
    where = f" for op {op_name}" if op_name else ""
    raise ValueError(
        f"{entity} name {name!r}{where} is invalid: a name starts with a lowercase letter or an "
        f"underscore, followed by lowercase letters, digits or underscores (e.g. "
        f"{'my_provider' if entity == 'Provider' else 'my_op'!r})"
    )


# the files whose frames a registration stack leaves out: the registering call is the user's
_IR_FILES = {str(Path(__file__).with_name(n)) for n in ("op.py", "impl.py")}


def registration_stack() -> list[str]:
    """The stack of the call registering an op or a provider, as `traceback.format_stack` lines
    (vLLM 0.34's `_registration_stack`), without this package's frames: the last line is the
    user's `@register_op` or `@op.register_impl(...)`, whichever form the decorator took."""
    frames = traceback.extract_stack()[:-1]
    while frames and frames[-1].filename in _IR_FILES:
        frames.pop()
    return traceback.format_list(frames)


def where(stack: list[str]) -> str:
    """`File "...", line N, in f: <the line>` of a registration stack's last frame."""
    if not stack:
        return "an unknown place (constructed directly, not through a decorator)"
    place, *code = stack[-1].strip().splitlines()
    return f"{place.strip()}: {code[0].strip()}" if code else place.strip()


def check_provider_name(op: IrOp, provider: str) -> None:
    """The three ways a provider name is refused (vLLM asserts the first and the last)."""
    if provider in RESERVED_PROVIDERS:
        raise AssertionError(
            f"Provider name {provider} is reserved. {RESERVED_PROVIDERS} are reserved names for "
            f"op {op.name}: 'native' is the op's own body, registered with the op. Give your "
            f"implementation another name, e.g. 'my_{provider}'."
        )
    validate_name(provider, "Provider", op.name)
    if provider in op.impls:
        first = where(op.impls[provider]._registration_stack)
        raise AssertionError(
            f"Implementation for provider {provider} already registered for op {op.name} "
            f"(registered: {list(op.impls)}): first at {first}; again at "
            f"{where(registration_stack())}. Choose another name; to change the "
            f"implementation, edit the registered function instead of registering it twice."
        )


class IrOpImpl:
    def __init__(
        self,
        op: IrOp,
        provider: str,
        impl_fn: Callable,
        supported: bool,
        supports_args: Callable[..., bool] | None,
        inplace: bool = False,
        registration_stack: list[str] | None = None,
    ):
        # the exact schema of the native body: argument names, types and defaults alike
        try:
            schema = infer_schema(impl_fn, mutates_args=())
        except ValueError as e:  # torch's message names neither the op nor the provider
            raise ValueError(
                f"Implementation for provider {provider} of op {op.name}: its schema cannot be "
                f"inferred ({e}). Annotate it exactly as the native function: {op.py_signature}"
            ) from None
        if schema != op.schema_str:
            raise ValueError(
                f"Implementation for provider {provider} has schema '{schema}' which does not "
                f"match native schema '{op.schema_str}' for op {op.name}. Give it the same "
                f"parameter names, types and defaults as the native function (copy its signature)."
            )
        if supports_args is not None:
            _check_supports_args(op, provider, supports_args)
        if inplace and not op.allow_inplace:
            raise ValueError(
                f"Implementation {provider!r} is registered inplace=True, but op {op.name} was not "
                f"registered with allow_inplace=True: drop inplace=True, or return new tensors."
            )
        if not isinstance(supported, bool):
            raise ValueError(
                f"supported= for provider {provider!r} of op {op.name} must be True or "
                f"False (a platform check made once), got {supported!r}"
            )
        self.op = op
        self.provider = provider
        self.impl_fn = impl_fn
        self.supported = supported
        self._supports_args = supports_args
        self.inplace = inplace
        self._registration_stack = registration_stack or []
        self._uuid: str | None = None

    def __repr__(self) -> str:
        return f"IrOpImpl({self.op.name}.{self.provider})"

    @property
    def supports_all_args(self) -> bool:
        return self._supports_args is None

    def supports_args(self, *args: Any, **kwargs: Any) -> bool:
        return self._supports_args is None or bool(self._supports_args(*args, **kwargs))

    def uuid(self) -> str:
        """What the compiled code depends on: the source of the file that defines the function
        (vLLM hashes the file too), so an edited body, or a helper beside it, changes the cache
        key. Computed once: a process does not see its files change."""
        if self._uuid is None:
            self._uuid = source_hash(self.impl_fn)
        return self._uuid

    def func_impl_fn(self, *args: Any, **kwargs: Any) -> Any:
        """Functional semantics for an in-place implementation: it writes into copies of the
        activations (the lowering traces this; UnsafeCloneEliminationPass removes the copies it
        can prove nobody needs)."""
        if not self.inplace:
            return self.impl_fn(*args, **kwargs)
        new_args = list(args)
        for i in self.op.activation_indices:
            if i < len(args):
                assert isinstance(args[i], torch.Tensor), (self.op.name, i, type(args[i]))
                new_args[i] = args[i].clone()
        return self.impl_fn(*new_args, **kwargs)


def _check_supports_args(op: IrOp, provider: str, fn: Callable) -> None:
    """Same parameters (names, defaults, no keyword-only) as the op, so dispatch passes the
    call's arguments straight through (vLLM checks the same, for a fast hot path)."""
    if not callable(fn):
        raise ValueError(
            f"supports_args for provider {provider} must be a callable taking the arguments of op "
            f"{op.name}, got {fn!r}"
        )
    params = list(inspect.signature(fn).parameters.values())
    op_params = list(op.py_signature.parameters.values())
    fix = f" (op {op.name}); write it with the op's parameters: {op.py_signature}"
    if any(p.kind == inspect.Parameter.KEYWORD_ONLY for p in params):
        raise ValueError(
            f"supports_args for provider {provider} cannot have keyword-only parameters{fix}"
        )
    if len(params) != len(op_params):
        raise ValueError(
            f"supports_args for provider {provider} must have the same number of parameters "
            f"({len(params)}) as the native implementation ({len(op_params)}){fix}"
        )
    for p, q in zip(params, op_params):
        if p.name != q.name:
            raise ValueError(
                f"supports_args for provider {provider} has parameter '{p.name}' which does not "
                f"match native parameter '{q.name}'{fix}"
            )
        if p.default != q.default:
            raise ValueError(
                f"supports_args for provider {provider} has parameter '{p.name}' with default "
                f"{p.default} which does not match native default {q.default}{fix}"
            )
