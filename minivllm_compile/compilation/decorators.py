"""support_torch_compile and ignore_torch_compile (vLLM's
compilation/decorators.py; seed §7, §11, §13).

The decorator makes the model class its own TorchCompileWithNoGuardsWrapper. Nothing compiles at
construction (torch.compile is lazy, §13). The first call marks the num_tokens dimensions dynamic,
then compiles with torch.compile(dynamic=False, fullgraph=True): every other dimension is a
constant and only the marked ones become SymInts in the graph (§7). While Dynamo traces, every
source file it reads is recorded in compilation_config.traced_files (§11).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import typing
from typing import Any, Callable, Iterator, TypeVar
from unittest.mock import patch

import torch
from torch import nn
from torch._dynamo.symbolic_convert import InliningInstructionTranslator

from minivllm_compile.compilation import aot, cache_keys, caching
from minivllm_compile.compilation.counter import compilation_counter
from minivllm_compile.compilation.monitor import monitor_torch_compile
from minivllm_compile.compilation.wrapper import TorchCompileWithNoGuardsWrapper
from minivllm_compile.config import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
    DynamicShapesType,
)
from minivllm_compile.config.kernel import ir_dispatch_scope
from minivllm_compile.distributed.parallel_state import (
    get_tensor_model_parallel_world_size,
    peers_may_be_compiling,
)
from minivllm_compile.distributed.rank_check import check_same_on_all_ranks

IGNORE_COMPILE_KEY = "_ignore_compile_minivllm"
# First calls (load or compile) take turns, process-wide: the compile patches, the backend's model
# tag and the loading config are process-wide too. Later calls run side by side.
_FIRST_CALLS = threading.RLock()
_T = TypeVar("_T", bound=type[nn.Module])


def ignore_torch_compile(cls: _T) -> _T:
    """Run this subclass of a decorated class eagerly (its decorated submodules still compile)."""
    setattr(cls, IGNORE_COMPILE_KEY, True)
    return cls


def support_torch_compile(
    cls: _T | None = None,
    *,
    dynamic_arg_dims: dict[str, int | list[int]] | None = None,
    mark_unbacked_dims: dict[str, int | list[int]] | None = None,
    enable_if: Callable[[CompilationConfig], bool] | None = None,
) -> Callable[[_T], _T] | _T:
    """Bare (`@support_torch_compile`), or with `dynamic_arg_dims={"input_ids": 0, ...}`. Without
    dynamic_arg_dims, dim 0 of every forward argument annotated `torch.Tensor` (or Optional) is
    dynamic. The decorated class takes `compilation_config=` in its constructor."""

    def decorate(cls: _T) -> _T:
        if not hasattr(cls, "forward"):
            raise TypeError(f"{cls.__name__} has no forward method to compile")
        sig = inspect.signature(cls.forward)
        dims = dynamic_arg_dims
        if dims is None:
            try:  # annotations may be strings (from __future__ import annotations)
                hints = typing.get_type_hints(cls.forward)
            except Exception:
                hints = {k: p.annotation for k, p in sig.parameters.items()}
            tensor_types = (torch.Tensor, torch.Tensor | None, typing.Optional[torch.Tensor])
            dims = {k: 0 for k in sig.parameters if hints.get(k) in tensor_types}
        if not dims:
            raise ValueError(f"no dynamic dimensions found in {cls.__name__}.forward: annotate its "
                             "tensor arguments as torch.Tensor or pass dynamic_arg_dims explicitly")
        for k in [*dims, *(mark_unbacked_dims or {})]:
            if k not in sig.parameters:
                raise ValueError(f"argument {k!r} is not a parameter of "
                                 f"{cls.__name__}.forward{sig}")
        return _support_torch_compile(cls, dims, mark_unbacked_dims, enable_if)

    return decorate(cls) if cls is not None else decorate


@functools.cache
def _compile_patches_supported() -> dict[str, bool]:
    """Probed once: which of vLLM's compile patches this torch has."""
    import torch._inductor.config as inductor_config
    import torch.fx.experimental._config as fx_config

    return {"enable_cpp_symbolic_shape_guards": hasattr(torch._dynamo.config,
                                                        "enable_cpp_symbolic_shape_guards"),
            "backed_size_oblivious": hasattr(fx_config, "backed_size_oblivious"),
            "assume_32bit_indexing": hasattr(inductor_config, "assume_32bit_indexing"),
            "mark_unbacked_hint_override": "hint_override" in inspect.signature(
                torch._dynamo.decorators.mark_unbacked).parameters}


def _mark_dims(arg: torch.Tensor, dims: int | list[int], unbacked: bool) -> None:
    dims = _dims(arg, dims)
    if not unbacked:
        torch._dynamo.mark_dynamic(arg, dims)
    elif _compile_patches_supported()["mark_unbacked_hint_override"]:
        for d in dims:  # keep the real size as a hint for Inductor's tuning, as vLLM does
            torch._dynamo.decorators.mark_unbacked(arg, d, hint_override=arg.shape[d])
    else:
        torch._dynamo.decorators.mark_unbacked(arg, dims)


def _dims(arg: torch.Tensor, dims: int | list[int]) -> list[int]:
    dims = [dims] if isinstance(dims, int) else list(dims)
    return [arg.ndim + d if d < 0 else d for d in dims]


def input_spec(model: nn.Module, args: tuple, kwargs: dict, dynamic_arg_dims: dict,
               mark_unbacked_dims: dict | None) -> dict[str, dict]:
    """What the first call passed, as the trace saw it: each tensor's dtype, device, sizes (None
    where the dimension is dynamic) and contiguity; each other argument's value. With Dynamo's
    guards dropped, all of it is baked into the compiled code."""
    bound = inspect.signature(type(model).forward).bind(model, *args, **kwargs)
    spec = {}
    for name, value in list(bound.arguments.items())[1:]:
        if isinstance(value, torch.Tensor):
            dynamic = set()
            for marks in (dynamic_arg_dims, mark_unbacked_dims or {}):
                if name in marks:
                    dynamic |= set(_dims(value, marks[name]))
            spec[name] = {"dtype": str(value.dtype), "device": value.device.type,
                          "shape": [None if d in dynamic else n for d, n in enumerate(value.shape)],
                          "contiguous": value.is_contiguous()}
        else:
            constant = cache_keys.constant_value(value)
            spec[name] = {"value": type(value).__name__ if constant is None else constant}
    return spec


@contextlib.contextmanager
def compile_patches(model: nn.Module) -> Iterator[None]:
    """What the first compile runs under (vLLM's decorators.py; seed §11): (1) every file Dynamo
    reads joins compilation_config.traced_files, the forward's own and each function Dynamo
    inlines (InliningInstructionTranslator.inline_call_, patched); (2) the config patches: no
    C++ symbolic-shape guards (they are dropped anyway, so compiling them is wasted time),
    backed_size_oblivious for BACKED_SIZE_OBLIVIOUS shapes, and Inductor's 32-bit indexing when
    dynamic_shapes_config.assume_32_bit_indexing asks for it (each where this torch has it)."""
    traced = model.compilation_config.traced_files
    traced.add(model.original_code_object().co_filename)
    # the code objects themselves, with their module: the AOT artifact's record of its sources
    # (traced_state.py) finds code that is in no file on disk by them
    model.traced_code = [(model.original_code_object(), type(model).__module__)]
    inline_call = InliningInstructionTranslator.inline_call_

    def patched_inline_call(tracer):  # every function Dynamo inlines passes through here
        traced.add(tracer.f_code.co_filename)
        model.traced_code.append((tracer.f_code, tracer.f_globals.get("__name__")))
        return inline_call(tracer)

    ds = model.compilation_config.dynamic_shapes_config
    supported = _compile_patches_supported()
    dynamo_patches = {"enable_cpp_symbolic_shape_guards": False} \
        if supported["enable_cpp_symbolic_shape_guards"] else {}
    fx_patches = {"backed_size_oblivious": True} \
        if ds.type == DynamicShapesType.BACKED_SIZE_OBLIVIOUS else {}
    inductor_patches = {"assume_32bit_indexing": True} \
        if ds.assume_32_bit_indexing and supported["assume_32bit_indexing"] else {}
    with (patch.object(InliningInstructionTranslator, "inline_call_", patched_inline_call),
          torch._dynamo.config.patch(**dynamo_patches),
          torch.fx.experimental._config.patch(**fx_patches),
          torch._inductor.config.patch(**inductor_patches)):
        yield


def _compile_checks(model: nn.Module, spec: dict[str, dict]) -> tuple:
    """The spec as tuples check_inputs can walk fast (it runs on every call)."""
    params = list(inspect.signature(type(model).forward).parameters)[1:]
    checks = []
    for name, s in spec.items():
        if "dtype" in s:
            dtype = getattr(torch, s["dtype"].removeprefix("torch."))
            static = tuple((d, n) for d, n in enumerate(s["shape"]) if n is not None)
            checks.append((name, params.index(name), dtype, s["device"], len(s["shape"]), static,
                           s["contiguous"]))
    return tuple(checks)


def check_inputs(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """Refuse a call the compiled code was not traced for. Its guards were dropped, so nothing else
    would notice: int32 ids read as int64 run off the end of a buffer (the process aborts), a
    strided tensor read as contiguous gives wrong numbers."""
    for name, pos, dtype, device, ndim, static, contiguous in model._input_checks:
        value = args[pos] if pos < len(args) else kwargs.get(name)
        if (not isinstance(value, torch.Tensor) or value.dtype != dtype or value.dim() != ndim
                or (contiguous and not value.is_contiguous()) or value.device.type != device
                or any(value.shape[d] != n for d, n in static)):
            raise ValueError(_input_mismatch(model, name, value, model.input_spec[name]))


def _input_mismatch(model: nn.Module, name: str, value: Any, spec: dict) -> str:
    cls = type(model).__name__
    traced = (f"{spec['dtype']} on {spec['device']}, {len(spec['shape'])}-D, sizes "
              f"{['num_tokens' if n is None else n for n in spec['shape']]}"
              + (", contiguous" if spec["contiguous"] else ""))
    if not isinstance(value, torch.Tensor):
        got = f"a {type(value).__name__}"
    else:
        got = f"{value.dtype} on {value.device.type}, {value.dim()}-D, sizes {list(value.shape)}"
        if spec["contiguous"] and not value.is_contiguous():
            got += f", not contiguous (strides {list(value.stride())})"
    fix = (f"pass {name}.to({spec['dtype']})" if isinstance(value, torch.Tensor)
           and str(value.dtype) != spec["dtype"]
           else f"pass {name}.contiguous()" if isinstance(value, torch.Tensor)
           and spec["contiguous"]
           and not value.is_contiguous() else "pass what the first call passed")
    return (f"{cls} was compiled once, on its first call, for {name}: {traced}; this call passes "
            f"{got}. The compiled code has no guards to notice (they were dropped), so it would "
            f"read the tensor wrongly: {fix}, or build another model for these inputs.")


def check_input_values(model: nn.Module, args: tuple, kwargs: dict) -> None:
    """The model's own check of its inputs' values, if it has one (`model.check_input_values(...)`,
    taking forward's arguments): an out-of-range index that compiled code looks up aborts the
    process inside Inductor's bounds check instead of raising (LlamaModel checks its token ids and
    positions). Skipped while a CUDA graph is captured: a check reads values back to the host,
    which a capture forbids."""
    check = getattr(model, "check_input_values", None)
    if check is None or (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        return
    check(*args, **kwargs)


def parameter_layout(model: nn.Module) -> dict[str, tuple]:
    """Each parameter's and buffer's dtype, device, sizes and strides: what the compiled code was
    built for (they are graph inputs; Inductor's code asserts their strides)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return {n: (t.dtype, t.device, tuple(t.shape), t.stride()) for n, t in tensors}


def run_compiled(model: nn.Module, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """Call the compiled code; when it fails, say whether the model changed after it was compiled
    (a parameter of another dtype, device, size or layout), which no guard checks."""
    try:
        return fn(*args, **kwargs)
    except Exception as e:
        changed = _changes_since_compile(model)
        if changed:
            raise RuntimeError(
                f"{type(model).__name__} changed after it was compiled: "
                + "; ".join(changed[:4]) + ("; ..." if len(changed) > 4 else "")
                + ". The compiled code was built for its parameters as they were at the first call "
                "(they are graph inputs, their guards dropped). Change a model before its first "
                "call (.to(dtype), .to(device), contiguous weights), or build a new one.") from e
        raise


def _changes_since_compile(model: nn.Module) -> list[str]:
    before, now = getattr(model, "_parameter_layout", None), parameter_layout(model)
    if before is None:
        return []
    changes = []
    for name in sorted(before.keys() | now.keys()):
        if name not in now or name not in before:
            changes.append(f"{name} {'is gone' if name not in now else 'is new'}")
            continue
        for what, was, is_now in zip(("was {}", "was on {}", "had sizes {}", "had strides {}"),
                                     before[name], now[name]):
            if was != is_now:
                changes.append(f"{name} {what.format(was)}, now {is_now}")
                break
    return changes


def _support_torch_compile(cls: _T, dynamic_arg_dims: dict, mark_unbacked_dims: dict | None,
                           enable_if: Callable | None) -> _T:
    if TorchCompileWithNoGuardsWrapper in cls.__bases__:
        return cls  # decorated twice
    # the model becomes its own wrapper: TorchCompileWithNoGuardsWrapper joins its bases
    cls.__bases__ = cls.__bases__ + (TorchCompileWithNoGuardsWrapper,)
    setattr(cls, IGNORE_COMPILE_KEY, False)
    old_init = cls.__init__

    def __init__(self, *args: Any, compilation_config: CompilationConfig | None = None,
                 **kwargs: Any):
        config = compilation_config or CompilationConfig(mode=CompilationMode.NONE)
        # built sharded (TP > 1): every rank must build it the same way; checked before anything
        # is built. A model built whole inside a TP process (tensor_parallel_disabled) is one
        # rank's own business: it communicates with no one
        tp_size = get_tensor_model_parallel_world_size()
        if tp_size > 1:
            check_same_on_all_ranks("compilation config", {
                "model_class": f"{type(self).__module__}.{type(self).__qualname__}",
                "compilation_config": {**config.compile_factors(), "mode": config.mode.name,
                                       "cudagraph_mode": str(config.cudagraph_mode)}})
        if "compilation_config" in inspect.signature(old_init).parameters:
            kwargs["compilation_config"] = config
        old_init(self, *args, **kwargs)
        self.compilation_config = config
        self._tp_size = tp_size
        self.do_not_compile = (
            config.mode in (CompilationMode.NONE, CompilationMode.STOCK_TORCH_COMPILE)
            or getattr(type(self), IGNORE_COMPILE_KEY, False)
            or (enable_if is not None and not enable_if(config)))
        # eager with layerwise tracing (and no CUDA graphs): the model is called as a module, so
        # the forward hooks a profiler registers on it run (as vLLM's test
        # test_eager_layerwise_nvtx_invokes_module_hooks expects; the 0.34 wheel's __call__ still
        # calls forward directly); otherwise a decorated model's calls go straight to forward
        self._call_module_hooks = (config.mode == CompilationMode.NONE
                                   and config.enable_layerwise_nvtx_tracing
                                   and config.cudagraph_mode == CUDAGraphMode.NONE)
        if self.do_not_compile:
            return
        compilation_counter.num_models_seen += 1
        self.compiled = False
        self.aot_compiled_fn = None
        TorchCompileWithNoGuardsWrapper.__init__(self)

    def mark_dynamic_inputs(self, args, kwargs) -> None:
        bound = inspect.signature(type(self).forward).bind(self, *args, **kwargs)
        unbacked = self.compilation_config.dynamic_shapes_config.type == DynamicShapesType.UNBACKED
        for marks, as_unbacked in ((dynamic_arg_dims, unbacked), (mark_unbacked_dims or {}, True)):
            for name, dims in marks.items():
                arg = bound.arguments.get(name)
                if arg is None:
                    continue
                if not isinstance(arg, torch.Tensor):
                    raise ValueError(f"dynamic dims {dims} given for argument {name!r}, which is a "
                                     f"{type(arg).__name__}, not a tensor")
                dims = _dims(arg, dims)
                small = [d for d in dims if arg.shape[d] < 2]
                if small and not as_unbacked:
                    raise ValueError(
                        f"the first call compiles {type(self).__name__}, and {name!r} has size "
                        f"{arg.shape[small[0]]} in dynamic dim {small[0]}: Dynamo specialises "
                        "sizes 0 and 1, so the one trace would only fit that size. Make the "
                        "first call with at least 2 tokens (vLLM compiles during a warm-up run "
                        "at max_num_batched_tokens).")
                _mark_dims(arg, dims, as_unbacked)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # is_compiling(): we are being traced by an outer compile; just be traced (§13)
        if torch.compiler.is_compiling():
            return self.forward(*args, **kwargs)
        with ir_dispatch_scope(self.compilation_config):  # vLLM IR: this model's priority and wrap
            return _call(self, *args, **kwargs)

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        if self.do_not_compile:
            if self._call_module_hooks:
                return nn.Module.__call__(self, *args, **kwargs)
            return self.forward(*args, **kwargs)
        if self.aot_compiled_fn is not None:  # loaded or AOT-compiled: no Dynamo, no hook
            check_inputs(self, args, kwargs)
            check_input_values(self, args, kwargs)
            return run_compiled(self, self.aot_compiled_fn, (self, *args), kwargs)
        if self.compiled:
            check_inputs(self, args, kwargs)
            check_input_values(self, args, kwargs)
            return run_compiled(self, TorchCompileWithNoGuardsWrapper.__call__,
                                (self, *args), kwargs)
        with _FIRST_CALLS:
            if self.aot_compiled_fn is None and not self.compiled:
                return first_call(self, args, kwargs)
        return _call(self, *args, **kwargs)  # another thread compiled it while this one waited

    def first_call(self, args: tuple, kwargs: dict) -> Any:
        check_input_values(self, args, kwargs)  # the first call runs compiled code too
        # what this one trace will fit: part of the cache key (the backend asks for model_factors
        # when Dynamo hands it the graph), and checked at every later call
        self.input_spec = input_spec(self, args, kwargs, dynamic_arg_dims, mark_unbacked_dims)
        self._input_checks = _compile_checks(self, self.input_spec)
        self.model_factors = cache_keys.model_factors(self, self.input_spec)
        if self._tp_size > 1:
            # before loading or compiling: the cache key's factors, from every rank alike
            check_same_on_all_ranks("compile cache key",
                                    cache_keys.aot_cache_key(self, self.compilation_config,
                                                             self.model_factors)[1])
            # a peer may load or compile for longer than a collective waits: the first one
            # after this waits up to the compile timeout
            peers_may_be_compiling()
        self._parameter_layout = parameter_layout(self)
        aot.refuse_forced_load_without_aot(self.compilation_config)
        use_aot = caching.use_aot_compile(self.compilation_config)
        if use_aot:
            loaded = aot._try_load_aot_compiled_fn(self)
            if loaded is not None:
                self.aot_compiled_fn, self.compiled = loaded, True
                return self.aot_compiled_fn(self, *args, **kwargs)
        # the first call: mark the dynamic dims, then compile under the compile patches
        mark_dynamic_inputs(self, args, kwargs)
        with monitor_torch_compile(self.compilation_config), compile_patches(self):
            if use_aot:  # §10/§11: compile ahead of time, save, then run the compiled function
                self.aot_compiled_fn = self.aot_compile(*args, **kwargs)
                compilation_counter.num_aot_compiles += 1
                # what a later load checks: the model, its sources, values
                aot.record_built_for(self)
                if not self.compilation_config.dynamic_shapes_config.evaluate_guards:
                    # as after a load: the guards were filtered away, so checking what is left
                    # only binds the call's arguments again, every call (~20 us here). vLLM
                    # leaves the check on for a fresh compile and turns it off for a loaded one.
                    self.aot_compiled_fn.disable_guard_check()
                # vLLM saves here, before the first run: every piece is compiled by now (the
                # backend compiles all sizes and ranges up front), and a crash in the warm-up run
                # still leaves the next start something to load
                aot.save_aot_compiled_function(self)
                output = self.aot_compiled_fn(self, *args, **kwargs)
            else:
                output = TorchCompileWithNoGuardsWrapper.__call__(self, *args, **kwargs)
        self.compiled = True
        return output

    cls.__init__ = __init__
    cls.__call__ = __call__
    return cls
