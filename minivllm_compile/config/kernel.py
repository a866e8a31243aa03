"""`KernelConfig` and the vLLM IR op priority (vLLM 0.34's config/kernel.py, and each platform's
get_default_ir_op_priority in platforms/).

    priority = IrOpPriorityConfig(rms_norm=["vllm_c"])
    CompilationConfig(kernel_config=KernelConfig(ir_op_priority=priority))

A list names providers in the order dispatch and the lowering try them. The platform's defaults are
appended to it (a user's list goes in front, as vLLM does):

    CPU                                         ["native"]            (vLLM's Platform default)
    CUDA, Inductor compiling                    ["native"]            (Inductor writes the kernel)
    CUDA, mode NONE or backend "eager"          ["vllm_c", "native"]  (nothing would fuse the norm)
    CUDA, gelu_and_mul_sparse                   ["triton", "native"]  (vLLM's Triton kernel)

(vLLM's ROCm and XPU platforms choose the norms' defaults as its CUDA one does, ROCm with `aiter`
first when AITER's RMSNorm is on under CUDA graphs, and leave gelu_and_mul_sparse on native; this
project runs on a CPU or CUDA.)

The priority, and the source of every implementation it names, are compile-cache factors
(`IrOpPriorityConfig.compile_factors`, under the key's `config.compilation.kernel_config`): a
change to either changes what the lowering produces.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from minivllm_compile.config.utils import CompileFactors, get_compile_factors

if TYPE_CHECKING:
    from minivllm_compile.config.compilation import CompilationConfig
    from minivllm_compile.ir.op import IrOp


def _ir_ops() -> dict[str, IrOp]:
    """The IR ops with every provider registered (vLLM: current_platform.import_ir_kernels())."""
    import minivllm_compile.ir.kernels  # noqa: F401  (registers the providers)
    from minivllm_compile.ir.op import IrOp

    return IrOp.registry


@dataclass
class IrOpPriorityConfig:
    """One priority list per IR op; a comma-separated string is accepted too."""

    rms_norm: list[str] = field(default_factory=list)
    fused_add_rms_norm: list[str] = field(default_factory=list)
    gelu_and_mul_sparse: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, str):
                value = [p for p in value.replace(" ", "").split(",") if p]
            if not isinstance(value, (list, tuple)) or not all(isinstance(p, str) for p in value):
                raise ValueError(
                    f"IrOpPriorityConfig.{f.name} must be a list of provider names "
                    f"(or one comma-separated string), got {value!r}"
                )
            setattr(self, f.name, list(value))

    @classmethod
    def with_default(cls, default: list[str], /, **kwargs: list[str]) -> IrOpPriorityConfig:
        """Every op not named in kwargs gets `default`, less the providers another op has and
        this one lacks (native when nothing is left): `["vllm_c", "native"]`, the norms' custom
        ops, leaves gelu_and_mul_sparse, which has no vllm_c, on native. A name no op has stays,
        so a typo is still refused. (vLLM copies `default` as it is, and names
        gelu_and_mul_sparse's list apart where it defaults the others to vllm_c.)"""
        ops = _ir_ops()

        def for_op(name: str) -> list[str]:
            kept = [p for p in default if p in ops[name].impls
                    or not any(p in op.impls for op in ops.values())]
            return kept or ["native"]

        return cls(**{f.name: list(kwargs[f.name]) if f.name in kwargs else for_op(f.name)
                      for f in fields(cls)})

    def items(self) -> Iterator[tuple[str, list[str]]]:
        for f in fields(self):
            yield f.name, getattr(self, f.name)

    def validate(self) -> None:
        """Each list checked by its op: an unknown or unsupported provider is an error that names
        the op and the provider (IrOp._filter_priority_impls)."""
        ops = _ir_ops()
        for name, priority in self.items():
            ops[name]._filter_priority_impls(priority)

    def compile_factors(self) -> CompileFactors:
        """The lists, and the uuid of every implementation they name (vLLM's): the lowering's
        output depends on both, and Dynamo never traces a lowered implementation, so no traced
        file would notice an edit to one."""
        factors = get_compile_factors(self, set())
        ops = _ir_ops()
        assert "_impls" not in factors
        factors["_impls"] = {
            name: {p: ops[name].impls[p].uuid() for p in priority}
            for name, priority in self.items()
        }
        return factors

    def set_default(self) -> None:
        """Set every op's priority for the process (vLLM's worker does this at start-up)."""
        ops = _ir_ops()
        for name, priority in self.items():
            ops[name].set_default(priority)

    @contextlib.contextmanager
    def set_priority(self) -> Iterator[None]:
        """Every op's priority for the duration of a `with` block."""
        ops = _ir_ops()
        with contextlib.ExitStack() as stack:
            for name, priority in self.items():
                stack.enter_context(ops[name].set_priority(priority))
            yield


@dataclass
class KernelConfig:
    """Which kernel implements what (vLLM's KernelConfig, which also picks MoE and linear
    backends)."""

    ir_op_priority: IrOpPriorityConfig = field(default_factory=IrOpPriorityConfig)

    def __post_init__(self) -> None:
        if isinstance(self.ir_op_priority, dict):
            names = [f.name for f in fields(IrOpPriorityConfig)]
            unknown = [k for k in self.ir_op_priority if k not in names]
            if unknown:
                raise ValueError(
                    f"KernelConfig.ir_op_priority: {unknown} are not IR ops; the ops are {names}"
                )
            self.ir_op_priority = IrOpPriorityConfig(**self.ir_op_priority)
        elif not isinstance(self.ir_op_priority, IrOpPriorityConfig):
            raise ValueError(
                "KernelConfig.ir_op_priority must be an IrOpPriorityConfig (or a dict "
                f"of op name -> providers), got {self.ir_op_priority!r}"
            )

    def compile_factors(self) -> CompileFactors:
        """Every field (vLLM's KernelConfig leaves out its warm-up and autotuning switches, which
        this one does not have); ir_op_priority by its own factors."""
        return get_compile_factors(self, set())

    def set_platform_defaults(self, cc: CompilationConfig) -> None:
        """Append the platform's defaults to each list (idempotent: a config built twice keeps
        one copy), then check every list against its op."""
        defaults = get_default_ir_op_priority(cc)
        for name, priority in defaults.items():
            current = getattr(self.ir_op_priority, name)
            current.extend(p for p in priority if p not in current)
        self.ir_op_priority.validate()


def get_default_ir_op_priority(cc: CompilationConfig) -> IrOpPriorityConfig:
    """The platform's defaults (vLLM: CudaPlatform / Platform.get_default_ir_op_priority). On
    CUDA, Inductor gets the native norm to fuse into its neighbours; with no compiler to fuse it,
    the hand-written kernel is faster. Elsewhere (vLLM's CPU platform included) native."""
    from minivllm_compile import envs

    if envs.default_device() != "cuda":
        return IrOpPriorityConfig.with_default(["native"])
    # the mode by its name: config/compilation.py imports this module, never the other way round
    using_inductor = cc.backend == "inductor" and cc.mode.name != "NONE"
    # gelu_and_mul_sparse has vLLM's Triton kernel on CUDA whatever compiles (platforms/cuda.py)
    return IrOpPriorityConfig.with_default(["native"] if using_inductor else ["vllm_c", "native"],
                                           gelu_and_mul_sparse=["triton", "native"])


class ir_dispatch_scope:  # a context manager, named as the function it was
    """One model call under its config's IR priority and torch wrap. vLLM sets both once per
    worker process (set_default, set_default_torch_wrap); here one process holds models built
    with different priorities (notebook 15 compares three), so each call of a model scopes them.
    A plain class, not ExitStack and generators: it runs on every call. The providers each list
    resolves to are looked up once per config and list, and again if a provider is replaced."""

    __slots__ = ("cc", "chosen")

    def __init__(self, cc: CompilationConfig):
        self.cc = cc

    # The priority and the wrap are process-wide, as in vLLM (which sets them once per worker).
    # Scopes of two threads overlap. So the module keeps the scopes open in any thread and the
    # settings from before the first one opened: when a scope closes, the newest one still open
    # is put in force, and when the last one closes, those first settings come back. Nothing a
    # model set outlives its calls. (Known gap: while two threads run models of different IR
    # configs at the same moment, a call may see the other model's settings.)
    def __enter__(self) -> None:
        self.chosen = _resolved(self.cc.kernel_config.ir_op_priority)
        with _scopes_lock:
            module = _op_module()
            if not _open_scopes:
                _before["wrap"] = module._ENABLE_TORCH_WRAP
            for op, _ in self.chosen:
                _before_priority.setdefault(op, op._priority_impls)
            _open_scopes.append(self)
            self._apply(module)

    def __exit__(self, *exc: object) -> None:
        with _scopes_lock:
            module = _op_module()
            _open_scopes.remove(self)
            for op, impls in _before_priority.items():
                op._priority_impls = impls
            module._ENABLE_TORCH_WRAP = _before["wrap"]
            if _open_scopes:
                _open_scopes[-1]._apply(module)
            else:
                _before_priority.clear()

    def _apply(self, module: Any) -> None:
        for op, impls in self.chosen:
            op._priority_impls = impls
        module._ENABLE_TORCH_WRAP = self.cc.ir_enable_torch_wrap


_scopes_lock = threading.Lock()
_open_scopes: list[ir_dispatch_scope] = []  # open now, in any thread, oldest first
_before: dict[str, Any] = {}  # the wrap before the first of them opened
_before_priority: dict[Any, list] = {}  # each op's priority before the first scope set it


@functools.cache
def _op_module() -> Any:
    from minivllm_compile.ir import op as op_module

    return op_module


_RESOLVED: dict[tuple, list] = {}  # priority lists -> what they resolve to


def _resolved(priority: IrOpPriorityConfig) -> list[tuple[IrOp, list]]:
    """(op, the providers dispatch tries) per op, for these lists; recomputed when a provider they
    resolved to has been replaced (or removed) since."""
    key = tuple((op_name, tuple(p)) for op_name, p in priority.items())
    chosen = _RESOLVED.get(key)
    if chosen is None or not all(
        op.impls.get(i.provider) is i for op, impls in chosen for i in impls
    ):
        ops = _ir_ops()
        chosen = _RESOLVED[key] = [
            (ops[name], ops[name]._filter_priority_impls(list(p))) for name, p in key
        ]
    return chosen
