"""Exercises of notebook 15 (vLLM IR): predict which provider each IR node lowers to from a
priority list and `supports_args`, and register a provider of your own that the lowering picks."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from minivllm_compile.exercises import ExerciseFailed, env, exercise, quiet

MAX_TOKENS = 16
WIDE = 64  # 15.1's made-up kernel takes rows of at least this many elements


@contextmanager
def _compiling() -> Iterator[None]:
    """Every compile really compiles (a cache hit skips the lowering), quietly; the switch and the
    log levels are put back as they were."""
    with env(VLLM_DISABLE_COMPILE_CACHE="1"), quiet():
        yield


@contextmanager
def _providers_restored() -> Iterator[None]:
    """Whatever providers a grader (or a student's function) registers are gone afterwards, so a
    notebook cell can run again (a name registered twice is refused)."""
    from minivllm_compile import ir

    ops = (ir.ops.rms_norm, ir.ops.fused_add_rms_norm)
    saved = {op: dict(op.impls) for op in ops}
    try:
        yield
    finally:
        for op, impls in saved.items():
            op.impls.clear()
            op.impls.update(impls)


def _compile(arch: str, num_layers: int, priority: dict[str, list[str]]):
    """The model under VLLM_COMPILE with Inductor, one compile range, this IR priority; compiled
    at its first call. Returns (lm, the lowering pass)."""
    from minivllm_compile import CompilationConfig, CompilationMode
    from minivllm_compile.config.kernel import IrOpPriorityConfig, KernelConfig
    from minivllm_compile.models import build_model

    cc = CompilationConfig(
        mode=CompilationMode.VLLM_COMPILE,
        max_num_batched_tokens=MAX_TOKENS,
        inductor_compile_config={"fx_graph_cache": False},
        kernel_config=KernelConfig(IrOpPriorityConfig(**priority)),
    )
    lm = build_model(arch, num_layers=num_layers, compilation_config=cc)
    ids = torch.randint(0, 258, (8,), generator=torch.Generator().manual_seed(0))
    out = lm(ids, torch.arange(8))
    return lm, lm.model.backend.post_grad_pass_manager.ir_lowering, out


# --- 15.1: predict the lowering -------------------------------------------------------------------

PRIORITY_15_1 = {"rms_norm": ["wide", "vllm_c", "native"], "fused_add_rms_norm": ["wide", "native"]}


def _wide_rows(x, weight, epsilon, variance_size=None) -> bool:
    return x.shape[-1] >= WIDE


def _wide_rows_add(x, x_residual, weight, epsilon, variance_size=None) -> bool:
    return x.shape[-1] >= WIDE


def register_wide() -> None:
    """A provider for rows of at least 64 elements (as vLLM's oink provider refuses shapes it cannot
    vectorize): it computes what native does, its supports_args is the point."""
    from minivllm_compile import ir

    @ir.ops.rms_norm.register_impl("wide", supports_args=_wide_rows)
    def rms_norm_wide(
        x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
    ) -> Tensor:
        return ir.ops.rms_norm.impls["native"].impl_fn(x, weight, epsilon, variance_size)

    @ir.ops.fused_add_rms_norm.register_impl("wide", supports_args=_wide_rows_add)
    def fused_add_rms_norm_wide(
        x: Tensor,
        x_residual: Tensor,
        weight: Tensor | None,
        epsilon: float,
        variance_size: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        return ir.ops.fused_add_rms_norm.impls["native"].impl_fn(
            x, x_residual, weight, epsilon, variance_size
        )


def _lowering_solution() -> dict[str, dict[str, int]]:
    # the 2-layer hybrid: layer 0 (conv) starts the residual stream with rms_norm over the hidden
    # size 96; its post-conv norm, layer 1's two norms and the final norm add the residual (4
    # fused_add_rms_norm, 96 wide); layer 1's attention norms q and k per head: rms_norm over
    # head_dim 24 rows, too narrow for "wide", which vllm_c takes
    return {"rms_norm": {"wide": 1, "vllm_c": 2}, "fused_add_rms_norm": {"wide": 4}}


def _lowering_wrong() -> dict[str, dict[str, int]]:
    return {"rms_norm": {"wide": 3}, "fused_add_rms_norm": {"wide": 4}}  # every norm is 96 wide?


def _counts(answer) -> dict[str, dict[str, int]]:
    ok = (
        isinstance(answer, dict)
        and set(answer) <= {"rms_norm", "fused_add_rms_norm"}
        and all(
            isinstance(v, dict)
            and all(isinstance(p, str) and isinstance(n, int) for p, n in v.items())
            for v in answer.values()
        )
    )
    if not ok:
        raise ExerciseFailed(
            "answer a dict {op: {provider: number of nodes}}, e.g. "
            "{'rms_norm': {'native': 1}, 'fused_add_rms_norm': {'native': 2}}; "
            f"got {answer!r}"
        )
    return {
        op: {p: n for p, n in answer.get(op, {}).items() if n}
        for op in ("rms_norm", "fused_add_rms_norm")
    }


@exercise(
    "15.1",
    "predict which provider each IR node lowers to",
    section="notebook 15 §1 (dispatch by priority, supports_args) and §2 (the IR nodes)",
    hint="walk the hybrid's norms (notebook 15 §2 lists its IR nodes with their shapes): for each, "
    "the first provider of its op's priority whose supports_args takes the node's arguments wins",
    deeper_hint="List every norm of the 2-layer hybrid in order: the conv layer's two norms, the "
    "attention layer's two, its q and k norms, the final norm. For each, write its op (does it add "
    f"the residual?) and the width of the rows it normalises. 'wide' takes rows of at least {WIDE} "
    "elements; the printed model config gives hidden_size and head_dim.",
    solution=_lowering_solution,
    wrong=_lowering_wrong,
    wrong_says="rows of one head",
    gives_away="'vllm_c': 2",
)
def grade_lowering(answer) -> str:
    want_shape = _counts(answer)
    with _compiling(), _providers_restored():
        register_wide()
        lm, lowering, _ = _compile("hybrid", 2, PRIORITY_15_1)
    got: dict[str, dict[str, int]] = {"rms_norm": {}, "fused_add_rms_norm": {}}
    for (op, provider), n in sorted(lowering.lowered.items()):
        got[op][provider] = n
    cfg = lm.config
    facts = (
        f"The lowering picked {got} (hidden size {cfg.hidden_size}, head_dim {cfg.head_dim}, "
        f"priority {PRIORITY_15_1}, native appended where no listed provider takes every argument)."
    )
    if want_shape != got:
        why = "Walk the norms again, one by one: which op, and how wide are its rows?"
        if want_shape["rms_norm"].get("wide", 0) > got["rms_norm"].get("wide", 0):
            why = ("The attention layer's q_norm and k_norm are rms_norm too, over rows of one "
                   "head, not of the hidden size: what does 'wide''s supports_args make of them?")
        elif sum(want_shape["fused_add_rms_norm"].values()) != sum(
            got["fused_add_rms_norm"].values()
        ):
            why = "Count the residual adds: which norms add the residual, the final norm included?"
        raise ExerciseFailed(f"Your prediction {want_shape} is not what the lowering picked. {why}",
                             measured=facts)
    return facts


# --- 15.2: a provider of your own -----------------------------------------------------------------


def _provider_solution() -> Callable:
    def my_provider(ir):
        @ir.ops.rms_norm.register_impl("my_rms_norm")
        def my_rms_norm(
            x: Tensor, weight: Tensor | None, epsilon: float, variance_size: int | None = None
        ) -> Tensor:
            xf = x.float()
            out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
            return (out.to(weight.dtype) * weight).to(x.dtype)

        return {"rms_norm": ["my_rms_norm", "native"]}

    return my_provider


def _provider_wrong() -> Callable:
    solution = _provider_solution()

    def my_provider(ir):
        solution(ir)
        return {"rms_norm": ["native", "my_rms_norm"]}  # native first: it takes every argument

    return my_provider


@exercise(
    "15.2",
    "register a provider and make the lowering pick it",
    section="notebook 15 §1 (register_impl, dispatch by priority) and §3 (a priority per model)",
    hint="register a function with rms_norm's exact signature as a provider of ir.ops.rms_norm, "
    "then return a priority under which the lowering picks it",
    deeper_hint="@ir.ops.rms_norm.register_impl('a_name') above def f(x, weight, epsilon, "
    "variance_size=None) computes x * rsqrt(mean(x**2) + epsilon) * weight in float32. The "
    "lowering walks the priority list in order and takes the first provider whose supports_args "
    "accepts the node: where must yours stand?",
    solution=_provider_solution,
    wrong=_provider_wrong,
    wrong_says="first provider",
    gives_away='"rms_norm": ["my_rms_norm", "native"]',
)
def grade_provider(answer: Callable) -> str:
    from minivllm_compile import ir

    if not callable(answer):
        raise ExerciseFailed(
            f"answer a function my_provider(ir) that registers a provider and returns a "
            f"priority dict, got {answer!r}"
        )
    with _compiling(), _providers_restored():
        before = set(ir.ops.rms_norm.impls)
        try:
            priority = answer(ir)
        # a refusal of the registration (vLLM's AssertionError for a taken or reserved provider
        # name): its message says what to fix
        except (ValueError, AssertionError) as e:
            raise ExerciseFailed(f"registering your provider was refused: {e}") from None
        new = sorted(set(ir.ops.rms_norm.impls) - before)
        if not new:
            raise ExerciseFailed(
                "your function registered no new provider of ir.ops.rms_norm "
                "(decorate your function with @ir.ops.rms_norm.register_impl('a_name'))"
            )
        if not isinstance(priority, dict) or not isinstance(priority.get("rms_norm"), list):
            raise ExerciseFailed(
                f"return the priority as a dict, e.g. {{'rms_norm': [{new[0]!r}, 'native']}}; "
                f"got {priority!r}"
            )
        try:
            _, lowering, out = _compile("llama", 1, priority)
        except ValueError as e:
            raise ExerciseFailed(f"the config refused your priority: {e}") from None
        picked = Counter(
            p for (op, p), n in lowering.lowered.items() if op == "rms_norm" for _ in range(n)
        )
    from minivllm_compile import CompilationConfig, CompilationMode
    from minivllm_compile.models import build_model

    eager = build_model(
        "llama", num_layers=1, compilation_config=CompilationConfig(mode=CompilationMode.NONE)
    )
    ids = torch.randint(0, 258, (8,), generator=torch.Generator().manual_seed(0))
    diff = (out - eager(ids, torch.arange(8))).abs().max().item()
    mine = new[0]
    if set(picked) != {mine}:
        raise ExerciseFailed(
            f"The lowering did not pick your {mine!r} for every rms_norm node: the first provider "
            f"in your priority {priority['rms_norm']} whose supports_args takes the node's "
            "arguments wins, and native takes every argument.",
            measured=f"the lowering picked {dict(picked)}")
    if diff > 1e-4:
        raise ExerciseFailed(
            f"The lowering picked {mine!r}, and the model's logits now differ from native's: your "
            "implementation computes something else than rms_norm.",
            measured=f"the logits differ from native's by {diff:.2e}")
    return (
        f"every rms_norm node ({sum(picked.values())}) was lowered to {mine!r}, and the logits "
        f"match the native model's (max difference {diff:.1e}). The provider is gone again (the "
        "grader restores the "
        "op's providers), so this cell can run twice."
    )
