"""Turn off one piece at a time: vLLM's debugging switches, and reruns under each of them.

vLLM's guide (docs/design/debug_vllm_compile.md) isolates the piece that went wrong by turning
pieces off one at a time, each with its own flag, and rerunning. `SWITCHES` holds those flags as
this project spells them; `rerun` builds a model afresh under each one, runs it, and compares it
with eager, so a notebook (or a grader) can read which switch makes the bug go away:

    rows = rerun(lambda cc: Toy(compilation_config=cc), config, inputs, reference)
    print(table(rows))

The narrowest switch that makes it go away names the broken piece; a switch that turns off more
than needed costs performance for nothing (the guide: "turn off the minimal number of things").
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from minivllm_compile import envs
from minivllm_compile.config import CompilationConfig, CompilationMode, CUDAGraphMode, PassConfig


@dataclass(frozen=True)
class Switch:
    name: str
    # the pieces it turns off: dynamo, trace_once, inductor, passes, ir_lowering (the vLLM IR ops as
    # graph nodes, and the IR passes that functionalize and lower them), cudagraphs, cache
    turns_off: frozenset[str]
    vllm: str  # how vLLM spells it, online (vllm serve) / offline
    config: dict[str, Any] = dataclasses.field(
        default_factory=dict
    )  # CompilationConfig fields to set
    env: dict[str, str] = dataclasses.field(default_factory=dict)  # environment switches to set

    def narrower_than(self, other: Switch) -> bool:
        return self.turns_off < other.turns_off


_COMPILE = frozenset({"dynamo", "trace_once", "inductor", "passes", "ir_lowering", "cache"})

# the guide's table, then the pieces it names in its sections (the cache, the passes); the IR's
# ir_enable_torch_wrap=False joins them with vLLM IR
SWITCHES: dict[str, Switch] = {
    s.name: s
    for s in (
        Switch(
            "enforce_eager",
            _COMPILE | {"cudagraphs"},
            "--enforce-eager / enforce_eager=True",
            {"enforce_eager": True},
        ),
        Switch(
            "mode=NONE",
            _COMPILE,
            "-O.mode=0 / CompilationConfig(mode=CompilationMode.NONE)",
            {"mode": CompilationMode.NONE},
        ),
        Switch(
            "mode=STOCK_TORCH_COMPILE",
            frozenset({"trace_once", "ir_lowering", "cache"}),
            "-O.mode=1 / CompilationConfig(mode=CompilationMode.STOCK_TORCH_COMPILE)",
            {"mode": CompilationMode.STOCK_TORCH_COMPILE},
        ),
        Switch(
            "cudagraph_mode=NONE",
            frozenset({"cudagraphs"}),
            "-O.cudagraph_mode=NONE / CompilationConfig(cudagraph_mode=CUDAGraphMode.NONE)",
            {"cudagraph_mode": CUDAGraphMode.NONE},
        ),
        Switch(
            "backend=eager",
            frozenset({"inductor", "passes", "ir_lowering", "cache"}),
            "-O.backend=eager / CompilationConfig(backend='eager')",
            {"backend": "eager"},
        ),
        Switch(
            "passes off",
            frozenset({"passes"}),
            "each pass's PassConfig flag, and no post_grad_custom_post_pass in "
            "inductor_compile_config",
            {"pass_config": "off"},
        ),
        Switch(
            "ir_enable_torch_wrap=False",
            frozenset({"ir_lowering"}),
            "-O.ir_enable_torch_wrap=False / CompilationConfig(ir_enable_torch_wrap=False)",
            {"ir_enable_torch_wrap": False},
        ),
        Switch(
            "VLLM_DISABLE_COMPILE_CACHE=1",
            frozenset({"cache"}),
            "VLLM_DISABLE_COMPILE_CACHE=1",
            env={"VLLM_DISABLE_COMPILE_CACHE": "1"},
        ),
    )
}


def apply_switch(cc: CompilationConfig, name: str) -> CompilationConfig:
    """A copy of `cc` with one switch turned on (the config is validated again, as a new one)."""
    if name not in SWITCHES:
        raise KeyError(f"no switch {name!r}; the switches are {list(SWITCHES)}")
    changes = dict(SWITCHES[name].config)
    if changes.get("pass_config") == "off":
        changes["pass_config"] = PassConfig(
            **{
                f.name: False
                for f in dataclasses.fields(PassConfig)
                if isinstance(getattr(cc.pass_config, f.name), bool)
            }
        )
        changes["inductor_compile_config"] = {
            k: v for k, v in cc.inductor_compile_config.items() if k != "post_grad_custom_post_pass"
        }
    mode = changes.get("mode", cc.mode)
    cg = changes.get("cudagraph_mode", cc.cudagraph_mode)
    if mode != CompilationMode.VLLM_COMPILE and cg.requires_piecewise_compilation():
        changes["cudagraph_mode"] = (
            cg.without_piecewise()
        )  # as vLLM normalises it: no pieces, no piecewise graphs
    # the CUDA-graph sizes and the IR torch wrap were resolved for the old mode and backend: let
    # the new config resolve its own, as vLLM resolves them from the flags a user passes
    if "mode" in changes or "backend" in changes:
        changes.setdefault("ir_enable_torch_wrap", None)
    changes.setdefault("cudagraph_capture_sizes", cc.cudagraph_capture_sizes or None)
    changes.setdefault("max_cudagraph_capture_size", None)
    return dataclasses.replace(cc, traced_files=set(), **changes)


def runner(module: torch.nn.Module) -> Callable:
    """What calls a decorated module the way vLLM's model runner does: under STOCK_TORCH_COMPILE the
    caller compiles it (plain torch.compile); in every other mode the module is its own wrapper."""
    cc = getattr(module, "compilation_config", None)
    if cc is not None and cc.mode == CompilationMode.STOCK_TORCH_COMPILE:
        from minivllm_compile.compilation.wrapper import compile_model_with_stock_torch

        return compile_model_with_stock_torch(module, cc)
    return module


@dataclass
class Outcome:
    switch: str  # "" for the config as given
    ok: bool  # ran, and every output matched the reference
    said: str  # "matches eager", "wrong at 4 tokens (max |diff| 1.0)", "RuntimeError: ..."


def run_and_compare(
    build: Callable[[CompilationConfig], Callable],
    cc: CompilationConfig,
    inputs: Sequence[Any],
    reference: Callable,
    *,
    env: dict[str, str] | None = None,
    atol: float = 1e-4,
    rtol: float = 1e-4,
) -> tuple[bool, str]:
    """Build a model under `cc` (and `env`), call it on each input in order, compare each output
    with the reference's."""
    with envs.override(**(env or {})):
        try:
            model = build(cc)
            for x in inputs:
                args = x if isinstance(x, tuple) else (x,)
                got, want = model(*args), reference(*args)
                if not torch.allclose(got, want, atol=atol, rtol=rtol):
                    diff = (got - want).abs().max().item()
                    return False, f"wrong at {_size(args)} (max |diff| {diff:.3g})"
        except Exception as e:  # noqa: BLE001  (the outcome of this rerun)
            e = _root_cause(e)
            first = (str(e).strip().splitlines() or [""])[0]
            return False, f"{type(e).__name__}: {first[:150]}"
    return True, "matches eager"


def rerun(
    build: Callable[[CompilationConfig], Callable],
    cc: CompilationConfig,
    inputs: Sequence[Any],
    reference: Callable,
    switches: Sequence[str] = tuple(SWITCHES),
    **tol: float,
) -> list[Outcome]:
    """The config as given, then each switch in turn: a fresh model each time, against eager."""
    rows = [Outcome("", *run_and_compare(build, cc, inputs, reference, **tol))]
    for name in switches:
        rows.append(
            Outcome(
                name,
                *run_and_compare(
                    build, apply_switch(cc, name), inputs, reference, env=SWITCHES[name].env, **tol
                ),
            )
        )
    return rows


def narrowest(rows: Sequence[Outcome]) -> list[str]:
    """The switches that fix it with no narrower switch that also does: where to look."""
    fixed = [SWITCHES[r.switch] for r in rows if r.switch and r.ok]
    return [s.name for s in fixed if not any(o.narrower_than(s) for o in fixed)]


def table(rows: Sequence[Outcome]) -> str:
    width = max(len(r.switch or "(as configured)") for r in rows)
    lines = [f"{'rerun with':<{width}}  outcome", f"{'-' * width}  {'-' * 40}"]
    lines += [
        f"{r.switch or '(as configured)':<{width}}  {'ok   ' if r.ok else 'BUG  '}{r.said}"
        for r in rows
    ]
    return "\n".join(lines)


def _factors_of(entry: str | Path | dict) -> dict:
    """The factors themselves, from a dict, a cache_key_factors.json, or the backend folder that
    holds one."""
    if isinstance(entry, dict):
        return entry
    path = Path(entry)
    if path.is_dir():
        path = path / "cache_key_factors.json"
    return json.loads(path.read_text())


def changed_factors(entry_a: str | Path | dict,
                    entry_b: str | Path | dict) -> dict[str, tuple[Any, Any]]:
    """The cache-key factors two compile-cache entries differ in, each named down to the field
    (`config.compilation.pass_config.fuse_norm_quant`, `env.VLLM_USE_AOT_COMPILE`) with its two
    values (None where one side has no such field): why the second one missed. An entry is a
    backend folder (as viz.describe_cache() lists them), its cache_key_factors.json, or the factors
    themselves (cache_keys.backend_cache_key's). The three hashes (config_hash, code_hash,
    compiler_hash) are left out: one differs whenever a field under it does. A list is one value
    (code.files: every traced file with its hash)."""
    from minivllm_compile.distributed.rank_check import flatten

    a, b = (flatten({k: v for k, v in _factors_of(e).items() if not k.endswith("_hash")})
            for e in (entry_a, entry_b))
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _root_cause(e: BaseException) -> BaseException:
    """The error a backend raised, not Dynamo's wrapper around it: BackendCompilerFailed (and
    Inductor's InductorError inside it) name the backend on their first line, the cause later."""
    while True:
        inner = getattr(e, "inner_exception", None)
        if inner is None and type(e).__name__ == "InductorError":
            inner = e.__cause__
        if not isinstance(inner, BaseException):
            return e
        e = inner


def _size(args: tuple) -> str:
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    return f"{first.shape[0]} tokens" if first is not None and first.dim() else "this input"
