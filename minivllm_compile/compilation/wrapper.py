"""TorchCompileWithNoGuardsWrapper: torch.compile with Dynamo's guards dropped, and the bytecode
hook that calls Dynamo's transformed code directly (vLLM's compilation/wrapper.py; seed §2-§4, §8).

A decorated model is its own wrapper (support_torch_compile adds this class to its bases), so
`self` below is the model. Dynamo traces `forward` once; with every guard dropped that one trace
serves every later shape. With the hook on, the transformed bytecode Dynamo produced for
`forward` is captured, and later calls run it as a plain Python function: Dynamo is never entered
again. (vLLM swaps it into the class's shared `forward.__code__` for each call; here each instance
compiles a copy of forward's code of its own and calls the transformed code as its own function:
see own_forward.)
"""

from __future__ import annotations

import ast
import dis
import inspect
import io
import logging
import os
import sys
import textwrap
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from types import CodeType, FunctionType, MethodType
from typing import Any, Callable

import torch
import torch._C._dynamo.guards

from minivllm_compile import envs
from minivllm_compile.compilation.counter import compilation_counter
from minivllm_compile.compilation.monitor import dynamo_transform_time, watch_dynamo_compiles
from minivllm_compile.compilation.traced_state import value_record
from minivllm_compile.config import (
    CompilationConfig,
    CompilationMode,
    CUDAGraphMode,
)
from minivllm_compile.config.kernel import ir_dispatch_scope

logger = logging.getLogger("minivllm_compile")


@dataclass
class GuardRow:
    """One guard Dynamo offered to guard_filter_fn, and whether it was kept."""

    name: str
    guard_type: str
    kept: bool


def _keep_shape_env_guards(entries) -> list[bool]:
    return [e.guard_type == "SHAPE_ENV" for e in entries]


@contextmanager
def _compilation_context():
    """As vLLM's (wrapper.py) around a call that goes through Dynamo: room for recompiles (each new
    backend instance may cause one). Nothing else: the GLOBAL_STATE and TORCH_FUNCTION_STATE guards
    go with the rest, through the guard_filter_fn (which keeps only SHAPE_ENV, or nothing)."""
    with torch._dynamo.config.patch(cache_size_limit=2048, accumulated_cache_size_limit=8192):
        yield


class WholeGraphBackend:
    """The backend for DYNAMO_TRACE_ONCE (and the caller's for STOCK_TORCH_COMPILE): record the
    Dynamo graph for inspection, then hand it whole to Inductor (or run it eagerly).
    VLLM_COMPILE uses backends.VllmBackend instead."""

    def __init__(self, backend: str, inductor_config: dict, trace_once: bool = False):
        self.backend, self.inductor_config = backend, inductor_config
        self.trace_once = trace_once  # DYNAMO_TRACE_ONCE (STOCK recompiles as torch.compile does)
        self.graphs: list[torch.fx.GraphModule] = []  # one per Dynamo trace (recompiles add more)
        self.dynamo_time_s: float | None = None

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
        if self.trace_once and self.graphs:
            # with the guards dropped, Dynamo traces again only when the cache entry is gone:
            # someone ran remove_from_cache on the code object this model compiled. Each instance
            # compiles a copy of its own (wrapper.own_forward), so that takes a class whose
            # instances share one, as vLLM's do: another instance's first call with the hook on.
            # This trace is no first call, so nothing marked the dims dynamic: its graph is static,
            # and nothing stops it serving every size (notebook 04, exercise 04.1)
            logger.warning("DYNAMO_TRACE_ONCE traced this model again (trace %d): its cache entry "
                           "was dropped (remove_from_cache on the forward code it compiled: by an "
                           "instance sharing that code object, with VLLM_USE_BYTECODE_HOOK=1?); "
                           "this graph has static shapes and will serve every size. Let each "
                           "instance compile its own forward code "
                           "(TorchCompileWithNoGuardsWrapper.own_forward), or use one "
                           "VLLM_USE_BYTECODE_HOOK setting per process, as vLLM "
                           "does", len(self.graphs) + 1)
        self.dynamo_time_s = dynamo_transform_time()
        self.graphs.append(gm)
        # vLLM passes the backend's name to torch.compile in these modes: none of its counters
        # moves (no VllmBackend, no adaptor), only ours
        compilation_counter.num_dynamo_traces += 1
        compilation_counter.num_unique_compiles += 1  # the whole graph, once per trace
        if self.backend == "eager":
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs, config_patches=self.inductor_config)


def compile_model_with_stock_torch(module: torch.nn.Module,
                                   compilation_config: CompilationConfig) -> Callable:
    """STOCK_TORCH_COMPILE, done by the caller as vLLM's model runner does: plain torch.compile of
    the whole forward, guards kept (a user's guard_filter_fn too), recompiling on new shapes.
    Returns the compiled forward for the caller to call (vLLM compiles the model in place with
    model.compile(); a decorated model's own __call__ here would step around that), and passes
    the config's Inductor settings and guard filter, which vLLM's leaves out."""
    compilation_counter.stock_torch_compile_count += 1
    watch_dynamo_compiles()  # no monitor_torch_compile here: time the trace from Dynamo's own start
    cfg, guard_filter = compilation_config.inductor_config_and_guard_filter()
    options = {"guard_filter_fn": guard_filter} if guard_filter is not None else None
    backend = WholeGraphBackend(compilation_config.backend, cfg)
    compiled = torch.compile(module.forward, fullgraph=True, backend=backend, options=options)

    def run(*args: Any, **kwargs: Any) -> Any:
        with ir_dispatch_scope(compilation_config):  # vLLM IR: this model's priority and wrap
            return compiled(*args, **kwargs)

    run.backend = backend  # for inspection: backend.graphs holds one graph per (re)compile
    return run



class TorchCompileWithNoGuardsWrapper:
    """torch.compile of self.forward, its guards dropped, except under STOCK_TORCH_COMPILE: there,
    as in vLLM, the wrapper keeps Dynamo's guards (a guard_filter_fn in inductor_compile_config is
    the only filter) and a guarded function recompiles as stock torch.compile would, with no
    bytecode hook. The decorator never builds one in STOCK_TORCH_COMPILE (the caller compiles);
    a class of one's own may (vLLM's tests/compile/test_wrapper.py)."""

    model_factors: dict | None = None  # set by support_torch_compile at the model's first call

    def __init__(self) -> None:
        cc = self.compilation_config
        mode, ds = cc.mode, cc.dynamic_shapes_config
        stock = mode == CompilationMode.STOCK_TORCH_COMPILE
        hook = envs.VLLM_USE_BYTECODE_HOOK and not stock
        if mode is None:  # vLLM's words (wrapper.py)
            raise RuntimeError("Compilation mode cannot be NO_COMPILATION")
        if mode == CompilationMode.NONE:
            raise RuntimeError("CompilationMode.NONE compiles nothing: "
                               "TorchCompileWithNoGuardsWrapper needs STOCK_TORCH_COMPILE, "
                               "DYNAMO_TRACE_ONCE or VLLM_COMPILE")
        # settings that cannot work together fail here, at construction, saying what to change
        if ds.evaluate_guards and hook:
            raise ValueError("dynamic_shapes_config.evaluate_guards=True needs "
                             "VLLM_USE_BYTECODE_HOOK=0: the hook's remove_from_cache would wipe "
                             "the guards it should evaluate")
        # UNBACKED with the hook on runs, as in vLLM 0.34 (its wrapper.py keeps only a comment,
        # "unbacked dynamic shapes require VLLM_USE_BYTECODE_HOOK=False", with no check): seed §3
        # asks for the hook off, but each instance traces its own forward once here (own_forward),
        # its symbol stays unbacked, and the result is eager's (notebook 03 §7)
        self.first_compile = True
        self.guard_table: list[GuardRow] = []
        # what this instance compiles: forward, with a code object of its own (see own_forward)
        self._forward_function = self.own_forward()
        self._compiled_bytecode: CodeType | None = None
        self._compiled_forward: FunctionType | None = None  # the transformed code, as a function
        # seed §4: a guard_filter_fn the user put in inductor_compile_config is overwritten here,
        # but in STOCK_TORCH_COMPILE, which keeps the guards
        inductor_config, user_filter = cc.inductor_config_and_guard_filter()
        guard_filter = user_filter if stock else \
            _keep_shape_env_guards if ds.evaluate_guards else torch.compiler.skip_all_guards_unsafe
        if stock:
            self.backend = backend = WholeGraphBackend(cc.backend, inductor_config)  # recompiles
            watch_dynamo_compiles()  # compiled outside monitor_torch_compile
        elif mode == CompilationMode.VLLM_COMPILE:
            from minivllm_compile.compilation.backends import VllmBackend

            # the decorated model's cache-key factors, known at its first call (None: a bare one)
            self.backend = backend = VllmBackend(cc, model_factors=lambda: self.model_factors)
        else:
            self.backend = backend = WholeGraphBackend(cc.backend, inductor_config, trace_once=True)
        if envs.VLLM_USE_AOT_COMPILE:
            # as vLLM does: torch.compile(...) only grows .aot_compile under this flag, which torch
            # 2.11 leaves off (2.13 turns it on by default)
            torch._dynamo.config.enable_aot_compile = True
        options = None if guard_filter is None else \
            {"guard_filter_fn": self._recording(guard_filter)}
        self._compiled_callable = torch.compile(
            MethodType(self._forward_function, self), fullgraph=True, dynamic=False,
            backend=backend,
            options=options)
        if hook:
            # a weak reference, so a registered hook does not keep every model ever built alive
            ref = weakref.ref(self)

            def hook_fn(old_code: CodeType, new_code: CodeType) -> None:
                owner = ref()
                if owner is not None:
                    owner.bytecode_hook(old_code, new_code)

            handle = torch._dynamo.convert_frame.register_bytecode_hook(hook_fn)
            weakref.finalize(self, handle.remove)

    @property
    def captured_graphs(self) -> list[torch.fx.GraphModule]:
        return self.backend.graphs

    @property
    def dynamo_time_s(self) -> float | None:
        return self.backend.dynamo_time_s

    def _recording(self, guard_filter: Callable) -> Callable:
        def filter_and_record(entries):
            keep = guard_filter(entries)
            self.guard_table = [GuardRow(e.name, e.guard_type, k) for e, k in zip(entries, keep)]
            # what each dropped guard checked, for the AOT artifact's record (traced_state.py): the
            # values the graph baked in, which a later process must still have to load it
            names = tuple(self._forward_function.__code__.co_freevars)
            self.guard_values = [r for e in entries if (r := value_record(e, names)) is not None]
            return keep

        return filter_and_record

    def aot_compile(self, *args: Any, **kwargs: Any):
        """Trace and compile now, returning torch's AOTCompiledFunction (saveable, loadable)."""
        if not hasattr(self._compiled_callable, "aot_compile"):
            raise RuntimeError(f"this torch ({torch.__version__}) has no "
                               "torch.compile(...).aot_compile; set VLLM_USE_AOT_COMPILE=0")
        self.first_compile = False
        return self._compiled_callable.aot_compile((args, kwargs))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if envs.VLLM_USE_BYTECODE_HOOK:
            if self.compilation_config.mode == CompilationMode.STOCK_TORCH_COMPILE:
                return self._compiled_callable(*args, **kwargs)  # guarded: Dynamo checks every call
            if self._compiled_bytecode is None:
                # several instances share forward's code object: drop Dynamo's cache entry for it so
                # this instance gets its own trace, and so its own hook call
                torch._dynamo.eval_frame.remove_from_cache(self.original_code_object())
                output = self._compiled_callable(*args, **kwargs)
                if self._compiled_bytecode is None:  # else every call would trace again
                    raise RuntimeError("the bytecode hook did not capture Dynamo's "
                                       f"transformed code for {type(self).__name__}.forward; "
                                       "set VLLM_USE_BYTECODE_HOOK=0")
                return output
            return self._compiled_forward(self, *args, **kwargs)
        # hook off: every call goes through Dynamo's frame evaluation (guards all dropped, or only
        # SHAPE_ENV kept under evaluate_guards, where any recompile after the first is an error)
        evaluate = self.compilation_config.dynamic_shapes_config.evaluate_guards
        stance = nullcontext() if self.first_compile or not evaluate \
            else torch.compiler.set_stance("fail_on_recompile")
        self.first_compile = False
        with _compilation_context(), stance:
            return self._compiled_callable(*args, **kwargs)

    def own_forward(self) -> FunctionType:
        """forward, as a function with a code object of its own (recorded once, at construction).

        vLLM compiles the class's forward, whose code object every instance shares, and Dynamo
        keeps its cache entries on the code object: the hook's remove_from_cache at one instance's
        first call drops another instance's entry, whose next call (hook off) traces again, a
        static graph serving every size (exercise 04.1); and a swap of the shared __code__ for the
        length of a call lets another thread run this instance's code. A code object per
        instance keeps both apart."""
        forward = type(self).forward
        fn = FunctionType(forward.__code__.replace(), forward.__globals__, forward.__name__,
                          forward.__defaults__, forward.__closure__)
        fn.__kwdefaults__, fn.__qualname__ = forward.__kwdefaults__, forward.__qualname__
        fn.__module__, fn.__doc__ = forward.__module__, forward.__doc__
        fn.__annotations__ = dict(getattr(forward, "__annotations__", {}))
        return fn

    def original_code_object(self) -> CodeType:
        """The code object this instance compiles (its own copy of forward's)."""
        return self._forward_function.__code__

    def bytecode_hook(self, old_code: CodeType, new_code: CodeType) -> None:
        """Called by Dynamo for every frame it transforms: keep the code made for this instance."""
        if old_code is not self.original_code_object():
            return
        frame = sys._getframe()
        # walk up to Dynamo's _compile, whose `frame` argument is the frame being compiled
        while frame is not None and not (frame.f_code.co_name == "_compile"
                                         and frame.f_code.co_filename.endswith("convert_frame.py")):
            frame = frame.f_back
        if frame is None or frame.f_locals["frame"].f_locals.get("self") is not self:
            return  # another instance of the same class is being compiled
        dump = self.compilation_config.compile_debug_dump_path()
        if dump:
            path = Path(dump) / "transformed_code.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(decompile(new_code))
            logger.debug("Dynamo transformed code saved to %s", path)
        # vLLM's condition (compilation/wrapper.py): only a captured graph loses the replayed
        # assignment; without one, `update` runs each call and the buffer is right. Checked before
        # keeping the code, so that a retry cannot run it
        if (self.compilation_config.cudagraph_mode != CUDAGraphMode.NONE
                and "update" in new_code.co_names):
            raise RuntimeError(buffer_mutation_message(self, new_code))
        self._compiled_bytecode = new_code
        # called as a plain function from now on: sound because Dynamo keeps the transformed
        # code's arguments, cells and free variables identical to the original's. vLLM swaps it
        # into the shared forward.__code__ for each call instead, which two threads cannot share
        fn = self._forward_function
        self._compiled_forward = FunctionType(new_code, fn.__globals__, fn.__name__,
                                              fn.__defaults__, fn.__closure__)
        self._compiled_forward.__kwdefaults__ = fn.__kwdefaults__


def decompile(code: CodeType) -> str:
    """Readable source of a code object: depyf's decompiler when installed, else the disassembly."""
    try:
        import depyf

        return depyf.decompile(code)
    except Exception:  # depyf missing, or a construct it cannot decompile
        out = io.StringIO()
        dis.dis(code, file=out)
        return "# depyf unavailable: disassembly instead\n" + out.getvalue()


def buffer_mutation_message(module: torch.nn.Module, new_code: CodeType) -> str:
    """Name the forward lines that assign a buffer, and show the
    transformed code that replays it."""
    buffers = {name for name, _ in module.named_buffers(recurse=False)}
    src_lines, first = inspect.getsourcelines(type(module).forward)
    file = inspect.getsourcefile(type(module).forward)
    culprits = []
    for node in ast.walk(ast.parse(textwrap.dedent("".join(src_lines)))):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for t in targets:
            if isinstance(t, ast.Attribute) and isinstance(t.value,
                                                           ast.Name) and t.value.id == "self" \
                    and t.attr in buffers:
                line = first + node.lineno - 1
                culprits.append(f"  {os.path.basename(file)}:{line}: "
                                f"{src_lines[node.lineno - 1].strip()}")
    where = "\n".join(
        culprits) or "  (no direct `self.<buffer> = ...` found; search the code below)"
    return ("forward assigns a buffer of the module, which the compiled code replays with "
            "`update`: with captured graphs (CUDA graphs) the new value would be silently lost. "
            "Keep state out of forward or run it eagerly (CompilationMode.NONE). The "
            f"assignment:\n{where}\nDynamo's transformed code (search for "
            f"`update`):\n{decompile(new_code)}")
