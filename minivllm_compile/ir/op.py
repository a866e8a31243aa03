"""vLLM IR: an op declared once, implemented by several providers, picked by priority
(vLLM 0.34's vllm/ir/op.py).

    @register_op
    def rms_norm(x: Tensor, weight: Tensor | None, epsilon: float,
                 variance_size: int | None = None) -> Tensor:
        ...                                   # plain torch: the `native` implementation

    @rms_norm.register_impl("vllm_c", supports_args=...)
    def rms_norm_vllm_c(x, weight, epsilon, variance_size=None): ...   # same signature

An op is also a functional torch op, `torch.ops.minivllm_ir.<name>`, so Dynamo records one node
for it; the post-grad VllmIRLoweringPass later replaces that node with the provider the priority
picks. Called outside a graph (eager), the op dispatches by priority at once. With the torch wrap
off (`enable_torch_wrap(False)`), a call skips the torch op and dispatches directly, so Dynamo
traces the chosen implementation itself.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch
from torch.library import Library, infer_schema

from minivllm_compile.ir.impl import (
    IrOpImpl,
    check_provider_name,
    registration_stack,
    validate_name,
    where,
)
from minivllm_compile.ir.tolerances import DEFAULT_TOLERANCES, ToleranceSpec

logger = logging.getLogger(__name__)

# the IR ops' torch library, beside the custom ops' `minivllm` (vLLM: "vllm_ir" beside "vllm");
# tests swap it for a scratch library (and IrOp.registry for a copy) to register ops of their own
ir_torch_lib = Library("minivllm_ir", "FRAGMENT")

_ENABLE_TORCH_WRAP = True  # vLLM's global switch: CompilationConfig.ir_enable_torch_wrap sets it
_warned: set[str] = set()


def set_default_torch_wrap(enable: bool = True) -> None:
    """Set the torch wrap for the process (vLLM's worker does this once at start-up)."""
    global _ENABLE_TORCH_WRAP
    _ENABLE_TORCH_WRAP = enable


@contextlib.contextmanager
def enable_torch_wrap(enable: bool = True) -> Iterator[None]:
    """Scoped form: with the wrap off, IR ops dispatch straight to an implementation, so Dynamo
    traces that implementation and no lowering is needed (vLLM's default without Inductor)."""
    global _ENABLE_TORCH_WRAP
    old, _ENABLE_TORCH_WRAP = _ENABLE_TORCH_WRAP, enable
    try:
        yield
    finally:
        _ENABLE_TORCH_WRAP = old


def torch_wrap_enabled() -> bool:
    return _ENABLE_TORCH_WRAP


def register_op(
    f: Callable | None = None,
    *,
    name: str | None = None,
    activations: list[str] | None = None,
    allow_inplace: bool = False,
):
    """Declare an IR op; `f`, plain torch, is its `native` implementation and fixes its schema.
    `activations` (default: the parameters whose name starts with "x") are the tensors an
    in-place provider may overwrite; `allow_inplace` adds the `maybe_inplace` overload."""

    def decorator(fn: Callable) -> IrOp:
        op_name = fn.__name__ if name is None else name
        validate_name(op_name, "Op")
        stack = registration_stack()
        if op_name in IrOp.registry:  # vLLM asserts it, with the words that start this message
            raise AssertionError(
                f"Op '{op_name}' is already registered. First at "
                f"{where(IrOp.registry[op_name]._registration_stack)}; again at {where(stack)}. "
                f"Use it through IrOp.registry[{op_name!r}], or register under another name="
            )
        cls = IrOpInplace if allow_inplace else IrOp
        op = cls(op_name, fn, activations, stack)
        IrOp.registry[op_name] = op
        return op

    return decorator(f) if f is not None else decorator


def _warn_once(msg: str, *args: Any) -> None:
    key = msg % args
    if key not in _warned:
        _warned.add(key)
        logger.warning(msg, *args)


class IrOp:
    registry: ClassVar[dict[str, IrOp]] = {}
    allow_inplace: bool = False

    def __init__(
        self,
        name: str,
        native_impl: Callable,
        activations: list[str] | None = None,
        registration_stack: list[str] | None = None,
    ):
        self.py_signature = inspect.signature(native_impl)
        params = self.py_signature.parameters.values()
        if any(p.kind == inspect.Parameter.KEYWORD_ONLY for p in params):
            raise ValueError(
                f"Op {name} has keyword-only arguments which are not currently supported: the "
                f"lowering passes a node's arguments by position, so make them positional"
            )
        if activations is None:  # vLLM's convention: the parameters named x...
            activations = [p.name for p in params if p.name.startswith("x")]
        unknown = [a for a in activations if a not in self.py_signature.parameters]
        if unknown:
            raise ValueError(
                f"Op {name}: activations {unknown} are not parameters of {self.py_signature}"
            )
        self.name = name
        self.doc = inspect.getdoc(native_impl) or ""
        # where register_op was called (empty for an op constructed directly, as in vLLM)
        self._registration_stack = registration_stack or []
        self.activations = activations
        self.activation_indices = [i for i, p in enumerate(params) if p.name in activations]
        self.schema_str = infer_schema(native_impl, mutates_args=())
        self.impls: dict[str, IrOpImpl] = {}
        self.impls["native"] = IrOpImpl(
            self,
            "native",
            native_impl,
            supported=True,
            supports_args=None,
            registration_stack=self._registration_stack,
        )
        self._priority_impls: list[IrOpImpl] = []
        self._fake_fn = native_impl
        self._input_generator: Callable[..., tuple] | None = None
        self._tolerance_overrides: ToleranceSpec = {}
        lib = ir_torch_lib
        lib.define(name + self.schema_str)
        # CompositeExplicitAutograd: AOTAutograd keeps the op whole (it does not decompose it)
        lib.impl(name, self._inner_call, dispatch_key="CompositeExplicitAutograd")
        lib._register_fake(name, self._fake_call)
        self.torch_op: torch._ops.OpOverload = getattr(getattr(torch.ops, lib.ns), name).default

    def __repr__(self) -> str:
        return f"IrOp({self.name!r})"

    def __str__(self) -> str:
        first = self.doc.split("\n")[0].strip()
        return f"IrOp({self.name!r})" + (f" - {first}" if first else "")

    # --- registration ---------------------------------------------------------------------------

    def register_impl(
        self,
        provider: str,
        *,
        supported: bool = True,
        supports_args: Callable[..., bool] | None = None,
        inplace: bool = False,
    ) -> Callable[[Callable], IrOpImpl]:
        """Add a provider. `supported`: a platform check made once (is there a GPU?);
        `supports_args`: a check of one call's arguments (dtype, a parameter the kernel lacks);
        `inplace`: the implementation writes its outputs into the activations. Which provider
        runs is the priority's business, never these checks'."""
        check_provider_name(self, provider)

        def register(fn: Callable) -> IrOpImpl:
            check_provider_name(self, provider)  # again: the name may be taken by now
            impl = IrOpImpl(
                self, provider, fn, supported, supports_args, inplace, registration_stack()
            )
            self.impls[provider] = impl
            if self._priority_impls:
                logger.warning(
                    "registering provider %s for op %s while a priority is set (%s): "
                    "it is not in it",
                    provider,
                    self.name,
                    self.get_priority(),
                )
            return impl

        return register

    def register_fake(self, fn: Callable) -> Callable:
        self._fake_fn = fn
        return fn

    def _fake_call(self, *args: Any, **kwargs: Any) -> Any:
        return self._fake_fn(*args, **kwargs)

    # --- priority and dispatch ------------------------------------------------------------------

    def get_priority(self) -> list[str]:
        return [impl.provider for impl in self._priority_impls]

    def supported_providers(self) -> list[str]:
        return [p for p, impl in self.impls.items() if impl.supported]

    def _filter_priority_impls(self, priority: list[str]) -> list[IrOpImpl]:
        """The providers dispatch tries, in order, up to the first that takes any arguments;
        native is added last when none does (vLLM). Unlike vLLM, which skips an unsupported
        provider quietly, naming one is an error here: only a user's list can."""
        if isinstance(priority, str) or not all(isinstance(p, str) for p in priority):
            raise ValueError(
                f"priority for op {self.name} must be a list of provider names, got {priority!r}"
            )
        for p in priority:
            if p not in self.impls:
                raise ValueError(
                    f"priority {priority} for op {self.name} names {p!r}, which is not "
                    f"a provider of it (registered: {list(self.impls)}): fix the name, "
                    f"or register the provider before setting the priority"
                )
            if not self.impls[p].supported:
                raise ValueError(
                    f"priority {priority} for op {self.name} names {p!r}, which is not "
                    f"supported on this machine (registered with supported=False; "
                    f"supported here: {self.supported_providers()}): remove it from "
                    f"the priority"
                )
        impls: list[IrOpImpl] = []
        for p in priority:
            impls.append(self.impls[p])
            if self.impls[p].supports_all_args:
                return impls
        _warn_once(  # vLLM's words (its tests match "fallback to native")
            "Op %s: No implementation in priority list %s supports all args, execution fallback "
            "to native is possible. To silence this warning, explicitly add 'native' to the end "
            "of the priority list",
            self.name,
            priority,
        )
        return impls + [self.impls["native"]]

    def set_default(self, priority: list[str]) -> None:
        """Set the priority for the process (vLLM's worker start-up)."""
        self._priority_impls = self._filter_priority_impls(priority)

    @contextlib.contextmanager
    def set_priority(self, priority: list[str]) -> Iterator[None]:
        """The priority for the duration of a `with` block."""
        old = self._priority_impls
        self._priority_impls = self._filter_priority_impls(priority)
        try:
            yield
        finally:
            self._priority_impls = old

    def dispatch(self, *args: Any, **kwargs: Any) -> IrOpImpl:
        """The first provider in the priority that takes these arguments (on the hot path)."""
        if not self._priority_impls:
            if not torch.compiler.is_compiling():  # logging does not trace
                _warn_once(
                    "Priority not set for op %s, using native implementation.", self.name
                )
            return self.impls["native"]
        for impl in self._priority_impls:
            if impl.supports_args(*args, **kwargs):
                return impl
        raise RuntimeError(
            f"op {self.name}: no provider in {self.get_priority()} took the "
            "arguments, and the last one must take all (native does)"
        )

    def apply_arg_defaults(self, args: tuple) -> tuple:
        """`args` with the native signature's defaults filled in (the lowering needs them all)."""
        bound = self.py_signature.bind(*args)
        bound.apply_defaults()
        return bound.args

    def _inner_call(self, *args: Any, **kwargs: Any) -> Any:
        # the default overload is functional: an in-place provider writes into copies
        return self.dispatch(*args, **kwargs).func_impl_fn(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _ENABLE_TORCH_WRAP:
            return self._inner_call(*args, **kwargs)
        return self.torch_op(*args, **kwargs)

    # --- testing: inputs and tolerances ---------------------------------------------------------

    def register_input_generator(self, fn: Callable[..., tuple]) -> Callable[..., tuple]:
        self._input_generator = fn
        return fn

    @property
    def has_input_generator(self) -> bool:
        return self._input_generator is not None

    def generate_inputs(self, **kwargs: Any) -> tuple:
        if self._input_generator is None:
            raise RuntimeError(
                f"No input generator registered for op {self.name!r}: decorate one "
                f"with @ir.ops.{self.name}.register_input_generator"
            )
        return self._input_generator(**kwargs)

    def override_tolerance(self, dtype: torch.dtype, *, atol: float, rtol: float) -> None:
        self._tolerance_overrides[dtype] = {"atol": atol, "rtol": rtol}

    def get_tolerance(self, dtype: torch.dtype) -> dict[str, float]:
        if dtype in self._tolerance_overrides:
            return self._tolerance_overrides[dtype]
        if dtype in DEFAULT_TOLERANCES:
            return DEFAULT_TOLERANCES[dtype]
        raise ValueError(
            f"No tolerance defined for dtype {dtype} in op '{self.name}'. Use "
            f"op.override_tolerance({dtype}, atol=..., rtol=...) or add {dtype} to "
            f"DEFAULT_TOLERANCES."
        )


class IrOpInplace(IrOp):
    """An op registered with allow_inplace=True: it gains `maybe_inplace`."""

    allow_inplace = True

    def __init__(
        self,
        name: str,
        native_impl: Callable,
        activations: list[str] | None = None,
        registration_stack: list[str] | None = None,
    ):
        super().__init__(name, native_impl, activations, registration_stack)
        self.maybe_inplace = IrOpInplaceOverload(self)


class IrOpInplaceOverload:
    """`op.maybe_inplace(...)`: same signature and results, but the caller donates the
    activations, whose contents are undefined afterwards, so an in-place provider may write its
    outputs into them (the residual stream's `x, residual = norm(x, residual)`). Before AOTAutograd
    VllmIRInplaceFunctionalizationPass turns it into the functional op, after checking that nothing
    reads a donated activation later."""

    def __init__(self, op: IrOp):
        returns = op.schema_str.split(" -> ")[1]
        n_outputs = returns.count("Tensor")
        if n_outputs != len(op.activations) or returns.count(",") != n_outputs - 1:
            raise ValueError(
                f"Op {op.name}: allow_inplace needs one Tensor output per activation "
                f"({op.activations}), its schema returns {returns}"
            )
        self.op = op
        self.name = f"{op.name}.maybe_inplace"
        self.schema_str = infer_schema(op.impls["native"].impl_fn, mutates_args=op.activations)
        lib = ir_torch_lib
        lib.define(self.name + self.schema_str)
        lib.impl(self.name, self._inner_call, dispatch_key="CompositeExplicitAutograd")
        lib._register_fake(self.name, op._fake_call)
        self.torch_op: torch._ops.OpOverload = getattr(
            getattr(torch.ops, lib.ns), op.name
        ).maybe_inplace

    def _inner_call(self, *args: Any, **kwargs: Any) -> Any:
        # the activations were donated: an in-place provider may write into them directly
        return self.op.dispatch(*args, **kwargs).impl_fn(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not _ENABLE_TORCH_WRAP:
            return self._inner_call(*args, **kwargs)
        return self.torch_op(*args, **kwargs)
