"""Exercises of notebook 13 (fusion passes): predict a range-gated pass's matches on a hybrid
whose attention pieces are identical, and write a pattern that the real model's graph holds."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from minivllm_compile.exercises import ExerciseFailed, env, exercise, measured_once, quiet

MAX_TOKENS = 16  # max_num_batched_tokens of every grader's model: small ranges compile fast
LIMIT = 8  # 13.1's qk_norm_rope_fusion_max_token_num


@contextmanager
def _compiling() -> Iterator[None]:
    """Every compile really compiles (a cache hit would return kernels without running the
    passes); the switch and the pass log are put back as they were."""
    from minivllm_compile.compilation.passes import VllmPatternMatcherPass

    saved_table = VllmPatternMatcherPass.match_table.copy()
    try:
        with env(VLLM_DISABLE_COMPILE_CACHE="1"), quiet():
            yield
    finally:
        VllmPatternMatcherPass.match_table.clear()
        VllmPatternMatcherPass.match_table.update(saved_table)


def _config(*, custom_ops: list[str], pass_config=None, user_pass=None):
    from minivllm_compile import CompilationConfig, CompilationMode, PassConfig

    inductor = {"fx_graph_cache": False}
    if user_pass is not None:
        inductor["post_grad_custom_post_pass"] = user_pass
    return CompilationConfig(mode=CompilationMode.VLLM_COMPILE, compile_sizes=[],
                             max_num_batched_tokens=MAX_TOKENS,
                             custom_ops=custom_ops, pass_config=pass_config or PassConfig(),
                             inductor_compile_config=inductor)


def _n(k: int, one: str, many: str | None = None) -> str:
    return f"{k} {one if k == 1 else many or one + 's'}"


def _tokens(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randint(0, 258, (n,), generator=g), torch.arange(n)


# --- 13.1: predict a range-gated pass's matches ---------------------------------------------------

def _qk_solution() -> dict[str, int]:
    # the two attention layers' pieces (1 and 3) are identical: Inductor compiles piece 1 and piece
    # 3 reuses its artifact; the pass runs on Range(1, 8) only (the limit is an endpoint)
    return {"matches": 1, "calls": 2}


def _qk_wrong() -> dict[str, int]:
    return {"matches": 2, "calls": 2}  # one match per attention layer


@measured_once
def _qk_truth() -> dict:
    """Compile the 4-layer hybrid with the gated pass and read what it did."""
    from minivllm_compile import PassConfig
    from minivllm_compile.compilation.passes import QKNormRoPEFusionPass, VllmPatternMatcherPass
    from minivllm_compile.models import build_model

    name = QKNormRoPEFusionPass.__name__
    passes = PassConfig(enable_qk_norm_rope_fusion=True, qk_norm_rope_fusion_max_token_num=LIMIT)
    with _compiling():
        before = VllmPatternMatcherPass.match_table[name]
        lm = build_model("hybrid", num_layers=4, compilation_config=_config(custom_ops=["all"],
                                                                            pass_config=passes))
        lm(*_tokens(5))
        matches = VllmPatternMatcherPass.match_table[name] - before
    entries = lm.model.backend.compiler_manager.entries
    ranges = lm.model.compilation_config.get_compile_ranges()
    calls_in = {(e.graph_index, e.compile_range):
                "\n".join(e.code).count("minivllm.fused_qk_norm_rope") for e in entries}
    pieces = sorted({i for (i, r), c in calls_in.items() if c})  # pieces with a fused site
    return {"matches": matches, "calls": sum(calls_in.values()), "ranges": ranges, "pieces": pieces,
            "layers": sum(t == "full_attention" for t in lm.config.layer_types),
            "gated": [r for r in ranges if r.end <= LIMIT],
            "compiled": sorted({e.graph_index for e in entries if e.graph_index in pieces
                                and e.reused_from is None}),
            "reused": sorted({(e.graph_index, e.reused_from) for e in entries
                              if e.graph_index in pieces and e.reused_from is not None})}


@exercise("13.1", "predict a range-gated fusion's matches",
          section="notebook 13 §1 and §2 (a range-gated pass)",
          hint="list the entries (the limit 8 is a compile-range endpoint), the pieces that "
               "hold a q/k norm + RoPE, and which of those pieces Inductor compiles "
               "(identical ones compile once)",
          deeper_hint="Three lists. Entries: compile_sizes=[] and the limit 8 become which "
                      "ranges up to 16, and on which does is_applicable_for_range let the pass "
                      "run? Pieces: conv, attention, conv, attention splits at the attention and "
                      "conv ops; which compiled pieces hold an attention layer's q/k norm and "
                      "RoPE, and are any two of them the same graph (CompilerManager then "
                      "compiles one and reuses its artifact, so the pass sees it once)? Matches "
                      "count what the pass replaced while compiling; calls count the generated "
                      "code of every entry, reused ones included.",
          solution=_qk_solution, wrong=_qk_wrong, wrong_says="identical pieces are compiled once",
          gives_away="1 match replaced")
def grade_qk_matches(answer: dict) -> str:
    if not isinstance(answer, dict) or set(answer) != {"matches", "calls"} or not all(
            isinstance(v, int) for v in answer.values()):
        raise ExerciseFailed(f"answer a dict {{'matches': int, 'calls': int}}, got {answer!r}")
    t = _qk_truth()
    matches, calls, layers, gated, ranges = (t["matches"], t["calls"], t["layers"],
                                             t["gated"], t["ranges"])
    facts = (f"The compile ranges are {ranges} (the limit {LIMIT} is an endpoint); the pass runs "
             f"on {', '.join(map(str, gated))} only (is_applicable_for_range: end <= {LIMIT}). The "
             f"{layers} attention layers' q/k norm + RoPE sit in pieces "
             f"{', '.join(map(str, t['pieces']))}; Inductor compiled "
             f"{'piece' if len(t['compiled']) == 1 else 'pieces'} "
             f"{', '.join(map(str, t['compiled']))}, and "
             + ", ".join(f"piece {i} reused piece {j}'s artifact" for i, j in t["reused"])
             + f" (identical pieces compile once). So: {_n(matches, 'match', 'matches')} replaced, "
             f"{_n(calls, 'fused_qk_norm_rope call')} in the generated code.")
    wrong = []
    if answer["matches"] != matches:
        if answer["matches"] == layers * len(gated):
            why = ("You counted one match per attention layer: matches count what the pass "
                   "replaced while Inductor compiled, and identical pieces are compiled "
                   "once (CompilerManager reuses the artifact): does every attention "
                   "layer's piece reach the pass?")
        elif answer["matches"] in (len(t["compiled"]) * len(ranges), layers * len(ranges)):
            why = ("You counted every range: on which ranges does "
                   "is_applicable_for_range let the pass run?")
        else:
            why = ("List the compiled entries the pass runs on: the ranges under the limit, for "
                   "the pieces Inductor actually compiles.")
        wrong.append(f"matches: not {answer['matches']}. {why}")
    if answer["calls"] != calls:
        if answer["calls"] == answer["matches"] or answer["calls"] == matches:
            why = ("The generated code is per entry of every piece, reused ones too: does a piece "
                   "that reuses another's artifact run the fused op?")
        elif answer["calls"] == layers * len(ranges):
            why = "Did the pass run on the entries above the limit? What do they call instead?"
        else:
            why = "Count, entry by entry, the generated code that calls the fused op."
        wrong.append(f"calls: not {answer['calls']}. {why}")
    if wrong:
        raise ExerciseFailed("\n".join(wrong), measured=facts)
    return facts


# --- 13.2: write a pattern and its replacement ----------------------------------------------------

def _silu_solution() -> tuple[Callable, Callable]:
    import torch.nn.functional as F
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    def pattern(x):
        d = x.shape[-1] // 2  # no need to burn it in: the matcher re-traces with the graph's x
        return F.silu(x[..., :d]) * x[..., d:]

    def replacement(x):
        out = torch.empty(x.shape[:-1] + (x.shape[-1] // 2,), dtype=x.dtype, device=x.device)
        res = auto_functionalized(torch.ops.minivllm.silu_and_mul.default, out=out, input=x)
        return res[1]  # res[0] is the op's return value (None); res[1] the `out` it wrote

    return pattern, replacement


def _silu_wrong() -> tuple[Callable, Callable]:
    _, replacement = _silu_solution()

    def pattern(x):  # silu spelled out: the same numbers, not the same graph
        d = x.shape[-1] // 2
        gate = x[..., :d]
        return gate * torch.sigmoid(gate) * x[..., d:]

    return pattern, replacement


def _ops(gm: torch.fx.GraphModule | torch.fx.Graph) -> list[str]:
    graph = gm.graph if isinstance(gm, torch.fx.GraphModule) else gm
    names = []
    for n in graph.nodes:
        if n.op != "call_function" or n.target.__name__ == "getitem":
            continue
        name = str(n.target).removeprefix("aten.").split(".")[0]  # slice.Tensor -> slice
        if "auto_functionalized" in name and n.args:
            name = f"auto_functionalized({str(n.args[0]).removeprefix('minivllm.')})"
        names.append(name)
    return names


def _mlp_ops(graph: torch.fx.Graph) -> list[str]:
    """The ops between the first gate/up slice and the down projection, as the graph holds them."""
    ops = _ops(graph)
    start = next((i for i, o in enumerate(ops) if o.startswith("slice")), None)
    if start is None:
        return []
    end = next((i for i in range(start, len(ops)) if ops[i] in ("mm", "addmm", "permute")),
               len(ops))
    return ops[start:end]


def _eager_checks(pattern: Callable, replacement: Callable, x: torch.Tensor) -> None:
    from minivllm_compile.kernels.activation import silu_and_mul_ref

    expected = torch.empty(x.shape[0], x.shape[1] // 2)
    silu_and_mul_ref(expected, x)
    got = pattern(x.clone())  # a starter's NotImplementedError leaves here: not attempted
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise ExerciseFailed(f"your pattern returns {shape} for an input of shape "
                             f"{tuple(x.shape)}; SiluAndMul returns one tensor of shape "
                             f"{tuple(expected.shape)}: silu(gate) * up, the gate and up halves "
                             "side by side in x's last dim")
    if not torch.allclose(got, expected, atol=1e-5, rtol=1e-5):
        raise ExerciseFailed("your pattern is not SiluAndMul: it differs from silu(x[..., :d]) * "
                             f"x[..., d:] by {(got - expected).abs().max().item():.3g} on a random "
                             "input (the gate is the first half of the last dim)")
    try:
        new = replacement(x.clone())
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001  (a student's code; the op's checks say what is wrong)
        raise ExerciseFailed(f"your replacement fails on an input of shape {tuple(x.shape)}: "
                             f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
    if not isinstance(new, torch.Tensor) or new.shape != expected.shape:
        what = tuple(new.shape) if isinstance(new, torch.Tensor) else type(new).__name__
        raise ExerciseFailed(f"your replacement returns {what}; it must return what the "
                             f"pattern does, one tensor of shape {tuple(expected.shape)}. "
                             "auto_functionalized returns a tuple: the op's own result, "
                             "then every argument it mutated: which element holds what the "
                             "op wrote? (notebook 05 §3)")
    if not torch.allclose(new, expected, atol=1e-5, rtol=1e-5):
        raise ExerciseFailed("your replacement differs from the pattern by "
                             f"{(new - expected).abs().max().item():.3g} on a random input: it "
                             "must compute the same values")


@exercise("13.2", "a pattern for the real graph: SiLU-and-mul back into one custom op",
          section="notebook 13 §5 "
          "(write a pattern yourself)",
          hint="the pattern is SiluAndMul's plain-torch forward, written as models/layers.py "
               "writes it; the replacement calls the custom op functionally, as §5's "
               "replacement does for rms_norm",
          deeper_hint="Pattern: copy the plain-torch branch of SiluAndMul (models/layers.py) "
                      "into a function of x: the matcher traces it the same way Inductor traced "
                      "the model, so write it the same way. Replacement: the custom op writes "
                      "into an `out` you allocate (what shape does silu_and_mul(out, input) "
                      "write?); call it through auto_functionalized as §5 calls rms_norm, and "
                      "return the element of its result that holds what the op wrote (§5 and "
                      "notebook 05 §3 say which).",
          solution=_silu_solution, wrong=_silu_wrong, wrong_says="sigmoid",
          gives_away="res[1]")
def grade_silu_pattern(answer) -> str:
    import torch._inductor.pattern_matcher as pm

    from minivllm_compile import CompilationConfig, CompilationMode
    from minivllm_compile.compilation.passes import CallableInductorPass
    from minivllm_compile.models import build_model

    if not (isinstance(answer, tuple) and len(answer) == 2 and all(callable(f) for f in answer)):
        raise ExerciseFailed("answer the pair (pattern, replacement) of two "
                             f"functions of x, got {answer!r}")
    pattern, replacement = answer
    x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
    _eager_checks(pattern, replacement, x)

    patterns = pm.PatternMatcherPass(pass_name="exercise_13_2")
    try:
        pm.register_replacement(pattern, replacement, [torch.empty(5, 16)], pm.fwd_only, patterns)
    except Exception as e:  # noqa: BLE001  (whatever tracing a student's functions raises)
        raise ExerciseFailed("register_replacement could not trace your functions: "
                             f"{type(e).__name__}: {str(e).splitlines()[0][:300]}") from None
    # per compile: matches, the graph's ops, its MLP's
    seen: list[tuple[int, list[str], list[str]]] = []

    def my_pass(graph: torch.fx.Graph) -> None:
        ops, mlp = _ops(graph), _mlp_ops(graph)
        seen.append((patterns.apply(graph), ops, mlp))

    # the truth: how many silu_and_mul the model calls with its custom ops on, counted as it runs
    sites = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func == torch.ops.minivllm.silu_and_mul.default:
                sites.append(func)
            return func(*args, **(kwargs or {}))

    ids, pos = _tokens(7)
    eager = build_model("llama", num_layers=2,
                        compilation_config=CompilationConfig(mode=CompilationMode.NONE))
    with torch.no_grad(), Count():
        expected = eager(ids, pos)
    with _compiling():
        lm = build_model("llama", num_layers=2, compilation_config=_config(
            custom_ops=["none"], user_pass=CallableInductorPass(my_pass, uuid="exercise 13.2")))
        got = lm(ids, pos)
    entries = lm.model.backend.compiler_manager.entries
    if any(e.reused_from is not None for e in entries) or len(seen) != len(entries):
        raise RuntimeError("grader 13.2: expected every piece compiled once, on one range; got "
                           f"{[(e.graph_index, e.compile_range, e.reused_from) for e in entries]}")
    matched, want = sum(m for m, _, _ in seen), len(sites)
    calls = sum("\n".join(e.code).count("minivllm.silu_and_mul.default(") for e in entries)

    pattern_ops = _ops(pm.fwd_only(pattern, [torch.empty(5, 16)]))
    graph_ops = {o for _, ops, _ in seen for o in ops}
    mlp = next((m for _, _, m in seen if m), [])
    if matched == 0:
        missing = sorted(set(pattern_ops) - graph_ops)
        not_in_mlp = sorted(set(pattern_ops) - set(mlp)) if mlp else []
        has = f"Between the gate_up matmul and the down matmul the graph holds: {', '.join(mlp)}."
        if missing:
            why = (f"Your pattern traces to {', '.join(missing)}, which no graph your pass was "
                   f"given holds. {has} A pattern is compared op by op with the post-grad graph, "
                   "after Inductor's decompositions: trace it the same way (write F.silu as the "
                   "model does, not by hand; the plain-torch form, since custom_ops=['none'] "
                   "leaves no custom op in the graph).")
        elif not_in_mlp:
            why = (f"Your pattern traces to {', '.join(not_in_mlp)}, which the graph holds "
                   f"elsewhere but not in its SiluAndMul. {has} Write the pattern as "
                   "SiluAndMul.forward does (two slices of x).")
        else:
            why = (f"Every op of your pattern ({', '.join(pattern_ops)}) is in the graph, but not "
                   f"connected the way your pattern connects them. {has}")
        raise ExerciseFailed(f"your pattern matched 0 times in the {len(entries)} compiled pieces; "
                             f"the model has {want} SiluAndMul (one per MLP). {why}",
                             measured=f"matches per compiled piece: {[m for m, _, _ in seen]}")
    if matched != want:
        raise ExerciseFailed(f"your pattern matched {matched} times; the model has {want} "
                             "SiluAndMul (one per MLP, each in its own piece, each piece compiled "
                             f"once here). Matches per piece: {[m for m, _, _ in seen]}; your "
                             f"pattern's ops: {', '.join(pattern_ops)}")
    if calls != want:
        raise ExerciseFailed(f"your pattern matched {matched} times, but the generated code "
                             f"calls minivllm.silu_and_mul {calls} times, not {want}: the "
                             "replacement must call torch.ops.minivllm.silu_and_mul.default "
                             "(through auto_functionalized)")
    diff = (got - expected).abs().max().item()
    if not torch.allclose(got, expected, atol=1e-4, rtol=1e-4):
        raise ExerciseFailed(f"the compiled model's logits differ from eager's by {diff:.3g} (7 "
                             "tokens): the replacement is spliced in where the pattern matched, "
                             "so it must compute the same")
    return (f"{_n(matched, 'match', 'matches')}, one per MLP (the model calls silu_and_mul {want} "
            "times with its custom ops on); the generated code calls minivllm.silu_and_mul "
            f"{calls} times where it had {', '.join(mlp) or 'the plain-torch ops'}; the logits "
            f"equal eager's (max diff {diff:.1e}).")
