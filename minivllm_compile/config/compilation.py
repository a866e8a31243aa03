"""Compilation settings (vLLM's vllm/config/compilation.py, made small). A bad value fails here, at
construction, with a message naming the field, rather than deep inside torch later."""

from __future__ import annotations

import difflib
import enum
import functools
import hashlib
import inspect
import logging
import marshal
import os
import types
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any, Iterator

from minivllm_compile.config.utils import (
    CompileFactors,
    Range,
    get_compile_factors,
    normalize_value,
)

DEFAULT_SPLITTING_OPS = ["minivllm::unified_attention_with_output", "minivllm::short_conv"]
# the layers that can run as a custom op or as plain torch (vLLM's CustomOp:
# forward_cuda / forward_native)
CUSTOM_OPS = ("rms_norm", "silu_and_mul", "rotary_embedding", "fused_qk_norm_rope", "quant_fp8")


class CUDAGraphMode(enum.Enum):
    """vLLM's CUDAGraphMode. NONE, PIECEWISE and FULL are also the runtime modes the dispatcher
    picks per step; the two tuple members name a (decode, mixed) pair of routines."""

    NONE = 0
    PIECEWISE = 1  # a graph per compiled piece; the splitting ops (attention, conv) run eagerly
    FULL = 2  # one graph over the whole forward, attention included
    # full graphs for uniform decode batches, nothing for mixed ones
    FULL_DECODE_ONLY = (FULL, NONE)
    # full for uniform decode, piecewise for mixed (vLLM's default)
    FULL_AND_PIECEWISE = (FULL, PIECEWISE)

    def separate_routine(self) -> bool:
        return isinstance(self.value, tuple)

    def decode_mode(self) -> "CUDAGraphMode":
        return CUDAGraphMode(self.value[0]) if self.separate_routine() else self

    def mixed_mode(self) -> "CUDAGraphMode":
        return CUDAGraphMode(self.value[1]) if self.separate_routine() else self

    def has_mode(self, mode: "CUDAGraphMode") -> bool:
        assert not mode.separate_routine(), mode
        return mode.value in self.value if self.separate_routine() else self == mode

    def requires_piecewise_compilation(self) -> bool:
        return self.has_mode(CUDAGraphMode.PIECEWISE)

    def without_piecewise(self) -> "CUDAGraphMode":
        return {CUDAGraphMode.PIECEWISE: CUDAGraphMode.NONE,
                CUDAGraphMode.FULL_AND_PIECEWISE: CUDAGraphMode.FULL_DECODE_ONLY}.get(self, self)

    def max_cudagraph_mode(self) -> "CUDAGraphMode":
        return CUDAGraphMode(max(self.value)) if self.separate_routine() else self

    def has_full_cudagraphs(self) -> bool:
        return self.max_cudagraph_mode() == CUDAGraphMode.FULL

    def has_piecewise_cudagraphs(self) -> bool:
        return self.requires_piecewise_compilation()

    @classmethod
    def valid_runtime_modes(cls) -> frozenset["CUDAGraphMode"]:
        return frozenset({cls.NONE, cls.PIECEWISE, cls.FULL})

    def is_valid_runtime_mode(self) -> bool:
        return self in CUDAGraphMode.valid_runtime_modes()

    def __str__(self) -> str:
        return self.name

    def __bool__(self) -> bool:
        return self != CUDAGraphMode.NONE


class AttentionCGSupport(enum.Enum):
    """What a splitting op can have captured in a FULL graph (vLLM's v1/attention/backend.py)."""

    ALWAYS = 3  # any batch, mixed prefill-decode included
    UNIFORM_BATCH = 2  # batches whose requests all have the same query length
    UNIFORM_SINGLE_TOKEN_DECODE = 1  # pure decode batches only
    NEVER = 0


class CompilationMode(enum.IntEnum):
    NONE = 0  # eager
    STOCK_TORCH_COMPILE = 1  # plain torch.compile: Dynamo's guards kept, recompiles on new shapes
    DYNAMO_TRACE_ONCE = 2  # one Dynamo trace, guards dropped, the whole graph to Inductor
    VLLM_COMPILE = 3  # one trace, guards dropped, the graph split and compiled piecewise


def _require_bool(owner: str, name: str, value: Any) -> None:
    # bool only: "no" is truthy, and 1 or 0 reads as a count somewhere else
    if not isinstance(value, bool):
        raise ValueError(f"{owner}.{name} must be True or False, got {value!r}")


class DynamicShapesType(str, enum.Enum):
    BACKED = "backed"  # mark_dynamic: symbols with a hint; Dynamo may specialise (0/1, >= 2)
    UNBACKED = "unbacked"  # mark_unbacked: no hint, never specialised silently
    BACKED_SIZE_OBLIVIOUS = "backed_size_oblivious"  # backed, but reasoned about as unbacked


@dataclass
class DynamicShapesConfig:
    type: DynamicShapesType = DynamicShapesType.BACKED
    # keep Dynamo's SHAPE_ENV guards and fail on a recompile: finds unexpected specialisations
    evaluate_guards: bool = False
    assume_32_bit_indexing: bool = False

    def __post_init__(self):
        try:
            self.type = DynamicShapesType(self.type)
        except ValueError:
            raise ValueError(f"DynamicShapesConfig.type={self.type!r} is not one of "
                             f"{[t.value for t in DynamicShapesType]}") from None
        for name in ("evaluate_guards", "assume_32_bit_indexing"):
            _require_bool("DynamicShapesConfig", name, getattr(self, name))
        if self.type == DynamicShapesType.UNBACKED and self.evaluate_guards:
            raise ValueError("DynamicShapesConfig(type=UNBACKED, evaluate_guards=True): "
                             "unbacked symbols add no shape guards to evaluate; use BACKED "
                             "to look for specialisations")

    def compile_factors(self) -> CompileFactors:
        """Every field: each changes how Dynamo traces the sizes (vLLM's)."""
        return get_compile_factors(self, set())


@functools.cache
def _warn_torch_compile_disable(mode: str) -> None:
    logging.getLogger("minivllm_compile").warning(
        "TORCH_COMPILE_DISABLE is set, disabling torch.compile: mode=%s becomes mode=NONE "
        "(vLLM says the same, as -cc.mode=none)", mode)


@functools.cache
def _warn_enforce_eager() -> None:
    logging.getLogger("minivllm_compile").warning(
        "Enforce eager set, disabling torch.compile and CUDAGraphs. This is equivalent to setting "
        "mode=NONE and cudagraph_mode=NONE (vLLM: -cc.mode=none -cc.cudagraph_mode=none)")


@dataclass
class PassConfig:
    # ours, to measure it: vLLM always runs FixFunctionalizationPass
    enable_fix_functionalization: bool = True
    eliminate_noops: bool = True  # remove no-op reshapes/slices before the other passes
    # vLLM's names: rms_norm (+ residual add) + static FP8 quant -> one op (RMSNormQuantFusionPass),
    # silu_and_mul + static FP8 quant -> silu_and_mul_quant (ActivationQuantFusionPass), q/k RMSNorm
    # + RoPE -> fused_qk_norm_rope (QKNormRoPEFusionPass). Off here, so that notebook 13 shows
    # before and after; vLLM leaves the two quant fusions to its optimization level (on from O1 when
    # the custom ops they match are enabled, config/vllm.py) and the QK-norm one off at every level.
    fuse_norm_quant: bool = False
    fuse_act_quant: bool = False
    enable_qk_norm_rope_fusion: bool = False
    # a range-gated pass, after vLLM's rope_kvcache_fusion_max_token_num: the fusion applies only to
    # compile ranges that end at or below this many tokens (the decode-sized ones), and the value
    # becomes a compile-range endpoint so that such a range exists. None: every range.
    qk_norm_rope_fusion_max_token_num: int | None = None
    # vLLM's name: all-reduce + RMSNorm -> one op (AllReduceFusionPass), under tensor parallelism
    # only (the pass is not added at TP=1). Off, as vLLM leaves it off where FlashInfer is missing.
    fuse_allreduce_rms: bool = False
    # its range gate: the fusion applies to compile ranges ending at or below this many tokens, and
    # the value becomes a compile-range endpoint (from TP=2). vLLM derives it from FlashInfer's
    # workspace size (fi_allreduce_fusion_max_size_mb / (hidden size x dtype size), at most
    # max_num_batched_tokens); with no workspace here it is given in tokens. None: every range.
    allreduce_fusion_max_token_num: int | None = None

    def __post_init__(self):
        for f in fields(self):
            if f.type == "bool":
                _require_bool("PassConfig", f.name, getattr(self, f.name))
        for name in ("qk_norm_rope_fusion_max_token_num", "allreduce_fusion_max_token_num"):
            n = getattr(self, name)
            if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
                raise ValueError(f"PassConfig.{name} must be a positive int or None, "
                                 f"got {n!r}")

    def compile_factors(self) -> CompileFactors:
        """Every field: each turns a pass on or off, or moves its range gate (vLLM's). A new
        field that changes nothing compiled goes into ignored_factors here."""
        return get_compile_factors(self, set())

    def range_endpoints(self) -> list[int]:
        """The compile-range endpoints the enabled range-gated passes need (vLLM adds them in
        VllmConfig._set_compile_ranges). The all-reduce one only where that pass runs, from TP=2
        (vLLM: no FlashInfer size for one rank, so no endpoint)."""
        from minivllm_compile.distributed.parallel_state import get_tensor_model_parallel_world_size

        ends = []
        n = self.qk_norm_rope_fusion_max_token_num
        if self.enable_qk_norm_rope_fusion and n is not None:
            ends.append(n)
        n = self.allreduce_fusion_max_token_num
        if self.fuse_allreduce_rms and n is not None and get_tensor_model_parallel_world_size() > 1:
            ends.append(n)
        return ends


@dataclass
class CompilationConfig:
    mode: CompilationMode = CompilationMode.VLLM_COMPILE
    backend: str = "inductor"
    compile_sizes: list[int] | None = None  # None means [] (the seed's §5 bug cannot happen)
    compile_ranges_endpoints: list[int] | None = None
    max_num_batched_tokens: int = 256
    splitting_ops: list[str] | None = None  # None: the attention and short-conv ops
    dynamic_shapes_config: DynamicShapesConfig = field(default_factory=DynamicShapesConfig)
    inductor_compile_config: dict[str, Any] = field(default_factory=dict)
    pass_config: PassConfig = field(default_factory=PassConfig)
    enable_layerwise_nvtx_tracing: bool = False
    # vLLM's custom_ops: "all" / "none", then "+name" / "-name" per op (names: CUSTOM_OPS). "all"
    # keeps the in-place custom ops in the graph (what these notebooks study); "none" gives Inductor
    # the plain-torch versions to fuse, which is vLLM's default when compiling with Inductor.
    custom_ops: list[str] = field(default_factory=lambda: ["all"])
    cache_dir: str = ""
    compile_cache_save_format: str = "binary"  # "unpacked": the generated code as editable files
    debug_dump_path: str | None = None
    # vLLM's enforce_eager (on its ModelConfig, applied in VllmConfig.__post_init__): turns off
    # torch.compile and CUDA graphs together, the same as mode=NONE plus cudagraph_mode=NONE
    enforce_eager: bool = False
    # filled while Dynamo traces: every source file the graph came from (invalidates the cache)
    traced_files: set[str] = field(default_factory=set)
    # CUDA graphs (vLLM's fields). None resolves to NONE on every platform: vLLM turns CUDA graphs
    # off where the platform has no support_static_graph_mode(), a CPU among them (config/vllm.py),
    # and on CUDA its default (FULL_AND_PIECEWISE) would change
    # what every existing notebook counts, so here a mode is opt-in. On a CPU an explicit mode runs
    # the static-buffer stand-in (cuda_graph.StaticBufferReplay) to show the same contract.
    cudagraph_mode: CUDAGraphMode | str | None = None
    cudagraph_capture_sizes: list[int] | None = None  # None: vLLM's generated list, capped
    max_cudagraph_capture_size: int | None = None  # None: min(512, max_num_batched_tokens)
    cudagraph_copy_inputs: bool = False  # False: the caller passes the same input buffers each step
    # vLLM IR (config/kernel.py): which provider implements each IR op, the platform's defaults
    # appended. vLLM keeps it in VllmConfig.kernel_config; this project's one config is this one.
    kernel_config: Any = None  # a KernelConfig (or a dict of its fields); None: the defaults
    # vLLM's: call IR ops through their torch op (one node for the lowering pass to replace). None:
    # on exactly when VLLM_COMPILE compiles with Inductor, the one path that lowers
    ir_enable_torch_wrap: bool | None = None

    def __post_init__(self):
        try:
            if isinstance(self.mode, bool):  # True would be STOCK_TORCH_COMPILE
                raise ValueError
            self.mode = CompilationMode(self.mode)
        except ValueError:
            raise ValueError(f"CompilationConfig.mode={self.mode!r} is not one of "
                             f"{[f'{m.name}={m.value}' for m in CompilationMode]}") from None
        _require_bool("CompilationConfig", "enforce_eager", self.enforce_eager)
        if self.enforce_eager:
            # vLLM (VllmConfig.__post_init__) overrides both, whatever else was asked for
            _warn_enforce_eager()
            self.mode, self.cudagraph_mode = CompilationMode.NONE, CUDAGraphMode.NONE
        if os.environ.get("TORCH_COMPILE_DISABLE") == "1" and self.mode != CompilationMode.NONE:
            # vLLM (VllmConfig.__post_init__): torch's own switch turns compilation off as
            # mode=NONE, so the model runs eagerly instead of meeting a
            # torch.compile that does nothing
            _warn_torch_compile_disable(self.mode.name)
            self.mode = CompilationMode.NONE
        if self.compile_cache_save_format not in ("binary", "unpacked"):
            raise ValueError("CompilationConfig.compile_cache_save_format="
                             f"{self.compile_cache_save_format!r}: use 'binary' or 'unpacked'")
        if self.backend not in ("inductor", "eager"):
            raise ValueError(f"CompilationConfig.backend={self.backend!r}: "
                             "use 'inductor' or 'eager'")
        n = self.max_num_batched_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError("CompilationConfig.max_num_batched_tokens must be "
                             f"a positive int, got {n!r}")
        self.compile_sizes = self._sizes("compile_sizes", self.compile_sizes, upto=n)
        # vLLM (VllmConfig._set_compile_ranges) keeps the endpoints e with 1 < e <
        # max_num_batched_tokens and drops the others without a word: 1 would make Range(1, 1), and
        # an endpoint at or past the end adds nothing (max_num_batched_tokens
        # always ends the last range)
        endpoints = self._sizes("compile_ranges_endpoints", self.compile_ranges_endpoints,
                                upto=None)
        if self.splitting_ops is None:
            self.splitting_ops = list(DEFAULT_SPLITTING_OPS)
        if not isinstance(self.splitting_ops, list):
            raise ValueError("CompilationConfig.splitting_ops must be a list of op names, "
                             f"got {self.splitting_ops!r}")
        bad = [op for op in self.splitting_ops if not isinstance(op, str) or "::" not in op]
        if bad:
            raise ValueError(f"CompilationConfig.splitting_ops {bad}: write each op as "
                             "'namespace::name' or 'namespace::name.overload', e.g. "
                             "'minivllm::unified_attention_with_output'")
        self._check_custom_ops()
        for name, cls in (("dynamic_shapes_config", DynamicShapesConfig),
                          ("pass_config", PassConfig)):
            value = getattr(self, name)
            if isinstance(value, dict):
                try:
                    value = cls(**value)
                except TypeError as e:  # an unknown key
                    names = [f.name for f in fields(cls)]
                    hints = [f"did you mean {m[0]!r} for {k!r}? " for k in value if k not in names
                             for m in [difflib.get_close_matches(str(k), names, n=1)] if m]
                    raise ValueError(f"CompilationConfig.{name}: {e}; "
                                     f"{''.join(hints)}its fields are {names}") from None
                setattr(self, name, value)
            elif not isinstance(value, cls):
                raise ValueError(f"CompilationConfig.{name} must be a {cls.__name__} (or a dict of "
                                 f"its fields), got {value!r}")
        # a range-gated pass's endpoint joins the user's, filtered the same way
        endpoints = sorted(set(endpoints) | set(self.pass_config.range_endpoints()))
        self.compile_ranges_endpoints = [e for e in endpoints if 1 < e < n]
        for name in ("cache_dir", "debug_dump_path"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (str, os.PathLike)):
                raise ValueError(f"CompilationConfig.{name} must be a path (str or "
                                 f"os.PathLike), got {value!r}")
        # "~/x" means the home folder, as in vLLM's paths (it expands debug_dump_path); unexpanded,
        # it made a folder named "~" in the current directory
        self.cache_dir = os.path.expanduser(os.fspath(self.cache_dir or ""))
        if self.debug_dump_path is not None:
            self.debug_dump_path = os.path.expanduser(os.fspath(self.debug_dump_path))
        _require_bool("CompilationConfig", "enable_layerwise_nvtx_tracing",
                      self.enable_layerwise_nvtx_tracing)
        if (n < 2 and self.mode in (CompilationMode.DYNAMO_TRACE_ONCE, CompilationMode.VLLM_COMPILE)
                and self.dynamic_shapes_config.type != DynamicShapesType.UNBACKED):
            # the model compiles in a warm-up at max_num_batched_tokens, and Dynamo specialises a
            # dynamic size of 1: that one trace could serve 1 token and nothing else
            raise ValueError(f"CompilationConfig.max_num_batched_tokens={n} under "
                             f"{self.mode.name}: the one trace is made at "
                             "max_num_batched_tokens, and Dynamo specialises a size of 1, so "
                             "nothing else could ever run compiled. Use at least 2 (or "
                             "DynamicShapesType.UNBACKED, which never specialises).")
        if not isinstance(self.inductor_compile_config, dict):
            raise ValueError("CompilationConfig.inductor_compile_config must be a dict of "
                             "torch._inductor.config names to values, got "
                             f"{type(self.inductor_compile_config)}")
        unknown = [k for k in self.inductor_compile_config if k != "guard_filter_fn"
                   and k not in inductor_options()]
        if unknown:  # else torch raises it at the first call, after Dynamo's trace
            hints = {k: difflib.get_close_matches(str(k), inductor_options(), n=1) for k in unknown}
            import torch

            raise ValueError(f"CompilationConfig.inductor_compile_config: {unknown} are not "
                             f"options of this torch's Inductor ({torch.__version__}; the "
                             "names are in torch/_inductor/config.py, nested ones dotted "
                             "like 'triton.cudagraphs')"
                             + "".join(f"; did you mean {h[0]!r} for {k!r}?"
                                       for k, h in hints.items() if h))
        self._refuse_freezing()
        # as vLLM's __post_init__: the passes (FixFunctionalization, the fusions) read v1
        # auto_functionalized nodes, in every mode that reaches Inductor; a user's value wins
        self.inductor_compile_config.setdefault("enable_auto_functionalized_v2", False)
        self.traced_files = set(self.traced_files)
        self._init_cudagraph()
        self._init_ir()

    def _init_ir(self) -> None:
        """vLLM's VllmConfig.__post_init__ for the IR: the torch-wrap default, then the platform's
        priority defaults behind the user's lists (KernelConfig.set_platform_defaults)."""
        from minivllm_compile.config.kernel import KernelConfig

        if self.kernel_config is None:
            self.kernel_config = KernelConfig()
        elif isinstance(self.kernel_config, dict):
            self.kernel_config = KernelConfig(**self.kernel_config)
        elif not isinstance(self.kernel_config, KernelConfig):
            raise ValueError("CompilationConfig.kernel_config must be a KernelConfig (or a dict of "
                             f"its fields), got {self.kernel_config!r}")
        if self.ir_enable_torch_wrap is None:
            self.ir_enable_torch_wrap = (self.mode == CompilationMode.VLLM_COMPILE
                                         and self.backend == "inductor")
        _require_bool("CompilationConfig", "ir_enable_torch_wrap", self.ir_enable_torch_wrap)
        self.kernel_config.set_platform_defaults(self)

    def _refuse_freezing(self) -> None:
        """Inductor's freezing (TORCHINDUCTOR_FREEZING=1, torch._inductor.config.freezing, or
        "freezing" here) under VLLM_COMPILE: the split pieces take the weights as inputs, so there
        is nothing to freeze, and torch fails on the first call. With the compile cache on,
        standalone_compile cannot save a piece compiled for freezing (AOTAutograd's cache asserts
        "expected OutputCode"); set globally, freezing also makes Dynamo keep the weights inside the
        graph, and the split pieces, run on fake inputs, meet real weights. The whole-graph modes
        do not fail on it."""
        if self.mode != CompilationMode.VLLM_COMPILE:
            return
        import torch._inductor.config as inductor_config

        if self.inductor_compile_config.get("freezing"):
            source = 'inductor_compile_config={"freezing": True}'
        elif inductor_config.freezing:
            source = ("TORCHINDUCTOR_FREEZING=1" if os.environ.get("TORCHINDUCTOR_FREEZING") == "1"
                      else "torch._inductor.config.freezing = True")
            if "freezing" in self.inductor_compile_config:  # False here reaches Inductor only
                source += (", which inductor_compile_config's freezing=False does not undo for "
                           "Dynamo")
        else:
            return
        raise ValueError(
            f"Inductor freezing ({source}) cannot be used with mode=VLLM_COMPILE: the piecewise "
            "backend gives each piece the weights as inputs, so there is nothing to freeze, and "
            "torch fails on the first call (saving a frozen piece to the compile cache, or, when "
            "set globally, running pieces whose weights Dynamo kept inside the graph). Turn "
            "freezing off, or use mode=DYNAMO_TRACE_ONCE or STOCK_TORCH_COMPILE, which compile the "
            "whole graph at once.")

    def _init_cudagraph(self) -> None:
        mode = self.cudagraph_mode
        if mode is None:
            mode = CUDAGraphMode.NONE
        elif isinstance(mode, str):  # vLLM: CUDAGraphMode[value.upper()]
            mode = CUDAGraphMode.__members__.get(mode.upper(), mode)
        if not isinstance(mode, CUDAGraphMode):
            raise ValueError(f"CompilationConfig.cudagraph_mode={self.cudagraph_mode!r} is not one "
                             f"of {list(CUDAGraphMode.__members__)}")
        if self.mode == CompilationMode.STOCK_TORCH_COMPILE and mode != CUDAGraphMode.NONE:
            # vLLM 0.34's VllmConfig._disable_cudagraphs_for_stock_torch_compile: the CUDA graph
            # manager would otherwise capture around the stock-compiled model; the sizes are
            # emptied by the NONE branch below, as vLLM empties them
            logging.getLogger("minivllm_compile").info(
                "CUDA graphs are not supported with stock torch.compile. Overriding "
                "cudagraph_mode %s to NONE.", mode.name)
            mode = CUDAGraphMode.NONE
        self.cudagraph_mode = mode
        _require_bool("CompilationConfig", "cudagraph_copy_inputs", self.cudagraph_copy_inputs)
        n = self.max_num_batched_tokens
        user_sizes, user_max = self.cudagraph_capture_sizes, self.max_cudagraph_capture_size
        if user_max is not None and (not isinstance(user_max, int) or isinstance(user_max, bool)
                                     or user_max < 1):
            raise ValueError("CompilationConfig.max_cudagraph_capture_size must be a positive int "
                             f"or None, got {user_max!r}")
        if user_sizes is not None:
            # vLLM drops sizes above max_num_batched_tokens with a warning (config/vllm.py
            # _set_cudagraph_sizes); here, as for compile_sizes, a size that
            # can never run is an error
            sizes = self._sizes("cudagraph_capture_sizes", user_sizes, upto=n)
            if not sizes:  # vLLM asserts it (config/vllm.py, "should contain at least one element")
                raise ValueError("CompilationConfig.cudagraph_capture_sizes is empty: give at "
                                 "least one size, or None for the default list")
        if mode.requires_piecewise_compilation() and self.mode != CompilationMode.VLLM_COMPILE:
            # vLLM quietly falls back to without_piecewise() (config/vllm.py
            # _normalize_piecewise_cudagraph_mode) because its default mode is piecewise; ours is
            # NONE, so a piecewise mode here was asked for, and the pieces it needs do not exist
            why = " (TORCH_COMPILE_DISABLE=1 set it)" if os.environ.get(
                "TORCH_COMPILE_DISABLE") == "1" else ""
            raise ValueError(f"CompilationConfig.cudagraph_mode={mode.name} needs "
                             "mode=VLLM_COMPILE (the pieces it captures come from splitting the "
                             f"graph), got mode={self.mode.name}{why}; use "
                             f"{mode.without_piecewise().name} instead")
        if mode.requires_piecewise_compilation() and not self.splitting_ops:
            # vLLM's set_splitting_ops_for_v1: with no splitting op there is one
            # piece and no piecewise graph
            mode = self.cudagraph_mode = (CUDAGraphMode.NONE if mode == CUDAGraphMode.PIECEWISE
                                          else CUDAGraphMode.FULL)
        if mode == CUDAGraphMode.NONE:  # vLLM: no CUDA graphs, no sizes
            self.cudagraph_capture_sizes, self.max_cudagraph_capture_size = [], 0
            return
        if user_sizes is not None:
            max_size = sizes[-1]
            # vLLM raises when both are given and disagree
            if user_max is not None and user_max != max_size:
                raise ValueError(f"CompilationConfig.max_cudagraph_capture_size={user_max} "
                                 "must equal the largest of cudagraph_capture_sizes "
                                 f"({max_size}); give one of the two")
        else:
            # vLLM's generated list: 1, 2, 4, multiples of 8 below 256, multiples of 16 from 256,
            # capped at the max size (default 512, vLLM's min(2 * max_num_seqs, 512) without a
            # scheduler) and at max_num_batched_tokens, which is itself added when it fits
            max_size = min(n, user_max if user_max is not None else 512)
            sizes = [s for s in (1, 2, 4)
                     if s <= max_size] + list(range(8, min(max_size + 1, 256), 8)) \
                + list(range(256, max_size + 1, 16))
            if n <= max_size:
                sizes.append(n)
            sizes = sorted(set(sizes))
        self.cudagraph_capture_sizes, self.max_cudagraph_capture_size = sizes, sizes[-1]

    def splitting_ops_contain_attention(self) -> bool:
        return DEFAULT_SPLITTING_OPS[0] in (self.splitting_ops or [])

    def resolve_cudagraph_mode(self, min_cg_support: AttentionCGSupport,
                               backend_name: str = "attention") -> None:
        """Resolve cudagraph_mode down to what the splitting ops can be captured in, as vLLM's
        CompilationConfig.resolve_cudagraph_mode_and_sizes does once the model's attention backends
        are known (called by the model runner, here LM, before the first compile)."""
        mode = self.cudagraph_mode
        if mode == CUDAGraphMode.NONE:
            return
        if mode.mixed_mode() == CUDAGraphMode.FULL and min_cg_support != AttentionCGSupport.ALWAYS:
            if min_cg_support == AttentionCGSupport.NEVER:
                raise ValueError(f"CompilationConfig.cudagraph_mode={mode.name} is not supported "
                                 f"by {backend_name} (support: {min_cg_support.name}); try "
                                 "cudagraph_mode=PIECEWISE with VLLM_COMPILE")
            mode = CUDAGraphMode.FULL_AND_PIECEWISE if self.splitting_ops_contain_attention() \
                else CUDAGraphMode.FULL_DECODE_ONLY
        if mode.decode_mode() == CUDAGraphMode.FULL and min_cg_support == AttentionCGSupport.NEVER:
            mode = (CUDAGraphMode.PIECEWISE if (self.mode == CompilationMode.VLLM_COMPILE
                                                and self.splitting_ops_contain_attention())
                    else CUDAGraphMode.NONE)
        self.cudagraph_mode = mode
        if mode == CUDAGraphMode.NONE:
            self.cudagraph_capture_sizes, self.max_cudagraph_capture_size = [], 0

    def _check_custom_ops(self) -> None:
        """vLLM's rules: every entry 'all', 'none', '+op' or '-op'; one base mode at most; no op
        both enabled and disabled."""
        ops = self.custom_ops
        if not isinstance(ops, list):
            raise ValueError(f"CompilationConfig.custom_ops must be a list such as ['all'] or "
                             f"['none', '+rms_norm'], got {ops!r}")
        bad = [c for c in ops if not isinstance(c, str) or (c not in ("all", "none")
                                                           and not (c[:1] in "+-"
                                                                    and c[1:] in CUSTOM_OPS))]
        if bad:  # each message carries vLLM's wording too, so a search for vLLM's finds it
            raise ValueError(f"Invalid syntax {bad[0]!r} for custom op: "
                             f"CompilationConfig.custom_ops {bad}: use 'all', 'none', '+name' or "
                             f"'-name' with a name from {list(CUSTOM_OPS)}")
        base = [c for c in ops if c in ("all", "none")]
        if len(base) > 1:
            raise ValueError(f"CompilationConfig.custom_ops={ops}: custom_ops can contain only one "
                             f"base mode: give one base mode at most, 'all' or 'none' (got {base})")
        both = sorted({c[1:] for c in ops if c[0] == "+"} & {c[1:] for c in ops if c[0] == "-"})
        if both:
            raise ValueError(f"CompilationConfig.custom_ops={ops} both enables and disables {both} "
                             "(custom_ops cannot both enable and disable the same operation(s)): "
                             "keep either the '+' or the '-' entry")

    @staticmethod
    def _sizes(name: str, sizes, upto: int | None) -> list[int]:
        if sizes is not None and not isinstance(sizes, (list, tuple, set)):
            raise ValueError(f"CompilationConfig.{name} must be a list of ints, got {sizes!r} "
                             f"(for one size, write [{sizes!r}])")
        sizes = list(sizes or [])
        bad = [s for s in sizes if not isinstance(s, int) or isinstance(s, bool) or s < 1
               or (upto is not None and s > upto)]
        if bad:
            raise ValueError(f"CompilationConfig.{name} {bad}: every entry must be an int in "
                             + (f"[1, max_num_batched_tokens={upto}]" if upto else "[1, ...)"))
        return sorted(set(sizes))

    def custom_op_enabled(self, name: str) -> bool:
        """vLLM's CustomOp.enabled(): an explicit +name/-name wins over all/none (default: all)."""
        if f"+{name}" in self.custom_ops:
            return True
        if f"-{name}" in self.custom_ops:
            return False
        return "none" not in self.custom_ops

    def get_compile_ranges(self) -> list[Range]:
        """[Range(1, e0), Range(e0+1, e1), ..., Range(e_last+1, max_num_batched_tokens)], as vLLM
        builds them (it appends max_num_batched_tokens to the endpoints)."""
        ends = sorted(set(self.compile_ranges_endpoints) | {self.max_num_batched_tokens})
        return [Range(s + 1, e) for s, e in zip([0, *ends[:-1]], ends)]

    def compile_debug_dump_path(self) -> str | None:
        """Where this process dumps its compile: debug_dump_path itself in one process; from TP=2
        on, its `rank_{rank}_dp_0` folder below it (vLLM's VllmConfig.compile_debug_dump_path adds
        that folder in one process too), so the ranks' graphs do not overwrite each other."""
        if not self.debug_dump_path:
            return None
        from minivllm_compile.distributed import parallel_state

        world = parallel_state._WORLD
        if world is None or world.world_size == 1:
            return self.debug_dump_path
        return os.path.join(self.debug_dump_path, f"rank_{world.rank}_dp_0")

    def inductor_config_and_guard_filter(self) -> tuple[dict[str, Any], Any]:
        """inductor_compile_config without "guard_filter_fn", and that function (or None). It rides
        in the same dict in vLLM but is an option of torch.compile, not an Inductor setting:
        STOCK_TORCH_COMPILE passes it on, the other modes replace it with their own (seed §4)."""
        config = dict(self.inductor_compile_config)
        return config, config.pop("guard_filter_fn", None)

    def compile_factors(self) -> CompileFactors:
        """The fields that change what is compiled (vLLM's CompilationConfig.compile_factors),
        the nested configs by their own factors (dynamic_shapes_config, pass_config, and
        kernel_config, which vLLM keeps beside this config in VllmConfig). The CUDA-graph fields
        are hashed, as vLLM hashes them: an artifact compiled under one cudagraph_mode is not
        served to another.

        WARNING: a new field is hashed unless it is named in `ignored_factors` here, with why.
        """
        ignored_factors = {
            # where things go and what the trace read (the key's `code` hashes the traced files'
            # contents): vLLM leaves the same three out
            "cache_dir", "debug_dump_path", "traced_files",
            # acts through mode and cudagraph_mode, which are hashed (vLLM keeps it on ModelConfig,
            # whose factors leave it out)
            "enforce_eager",
            # hashed below, without what is no Inductor setting
            "inductor_compile_config",
        }
        factors = get_compile_factors(self, ignored_factors)
        factors["inductor_compile_config"] = self._inductor_compile_factors()
        return factors

    def _inductor_compile_factors(self) -> CompileFactors:
        """inductor_compile_config, normalized. guard_filter_fn is left out: an option of
        torch.compile riding in this dict, it changes no compiled code. A user's
        post_grad_custom_post_pass is its uuid() (vLLM's normalize_value does the same with the
        InductorPass vLLM requires there); a plain function (or another callable without a uuid),
        which the backend wraps in CallableInductorPass (make_pass_manager), is the uuid that
        wrapper will have: the hash of its source. A function's repr carries its address, new in
        every process."""
        config, _ = self.inductor_config_and_guard_filter()
        user_pass = config.get("post_grad_custom_post_pass")
        if callable(user_pass) and not callable(getattr(user_pass, "uuid", None)):
            config["post_grad_custom_post_pass"] = callable_uuid(user_pass)
        try:
            return normalize_value(config)
        except TypeError as e:
            raise TypeError("get_compile_factors: unsupported type in 'inductor_compile_config' "
                            f"of CompilationConfig: {e} (give a pass an uuid(): an InductorPass, "
                            "or CallableInductorPass(fn))") from e


def callable_uuid(fn: Any) -> str:
    """CallableInductorPass(fn).uuid() (InductorPass.hash_source), computed here: config/ imports
    nothing of compilation/. The SHA-256 of the source of the function (of the class, for another
    callable), or of a function's bytecode where no source is kept."""
    obj = fn if isinstance(fn, (types.FunctionType, type)) else type(fn)
    try:
        text = inspect.getsource(obj)
    except (OSError, TypeError):  # defined where no source is kept (python -c)
        if not isinstance(obj, types.FunctionType):
            raise
        text = repr(marshal.dumps(obj.__code__))
    return hashlib.sha256(text.encode()).hexdigest()


@functools.lru_cache(maxsize=1)
def inductor_options() -> frozenset[str]:
    """Every name torch._inductor.config.patch() takes, nested ones dotted ("triton.cudagraphs").
    get_config_copy() leaves out the aliases of other modules' settings (force_disable_caches is
    torch.compiler.config's), which patch() accepts; its _config holds them all."""
    import torch._inductor.config as inductor_config

    return frozenset(getattr(inductor_config, "_config", None) or inductor_config.get_config_copy())


_current_config: CompilationConfig | None = None


@contextmanager
def set_current_compilation_config(config: CompilationConfig) -> Iterator[None]:
    """The config layers see while a model is built (vLLM: set_current_vllm_config)."""
    global _current_config
    prev, _current_config = _current_config, config
    try:
        yield
    finally:
        _current_config = prev


def get_current_compilation_config() -> CompilationConfig:
    return _current_config or CompilationConfig(mode=CompilationMode.NONE)
