"""Notebook 09's exercises: which factor of the compile cache's key a change moves (computed with
cache_keys.backend_cache_key and cache_keys.aot_cache_key on real models and configs), and what a
cold start, a warm start and a warm start without the mega artifact do (counted on real compiles
into a fresh cache)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from minivllm_compile.exercises import ExerciseFailed, env, exercise, measured_once

# ---------------------------------------------------------------------------------------------
# 09.1: which factor of the key covers each change

def user_pass(graph: torch.fx.Graph) -> None:
    """The user's post-grad pass (inductor_compile_config["post_grad_custom_post_pass"])."""
    for node in graph.nodes:
        pass


def user_pass_edited(graph: torch.fx.Graph) -> None:
    """The user's post-grad pass (inductor_compile_config["post_grad_custom_post_pass"])."""
    for node in graph.nodes:
        node.meta["seen_by_user_pass"] = True  # the one line edited


# label -> why that change moves the factor it moves (or none): the grader computes which one it is
CHANGES: dict[str, str] = {
    "compile_sizes=[4, 8]":
        "a CompilationConfig field that changes what is compiled: "
        "CompilationConfig.compile_factors() holds it, under config.compilation",
    "cudagraph_mode='PIECEWISE'":
        "vLLM 0.34 hashes the CUDA-graph fields (they are not among CompilationConfig's "
        "ignored_factors): an artifact compiled under one cudagraph_mode is not served to "
        "another, and the mode brings its capture sizes along",
    "rms_norm_eps 1e-05 -> 1e-06 in config.json":
        "the eps is a plain float an RMSNorm holds; Dynamo bakes it into the graph as a "
        "constant, so the key holds every plain value of the module tree "
        "(cache_keys.model_constants) in config.model.constants",
    "other weights, same shapes (a fine-tuned checkpoint)":
        "weights are graph inputs: their names, shapes, dtypes and devices are in "
        "config.model.parameters, their values in no factor, so a fine-tuned checkpoint of the "
        "same architecture loads the same kernels",
    "a comment added to models/llama.py":
        "every file Dynamo traced is hashed by content in code.files, a comment too; that "
        "factor is only in the backend key (the AOT key is computed before Dynamo runs, so the AOT "
        "load compares the traced sources itself, aot._verify_source_unchanged)",
    "the model built under set_model_tag('draft')":
        "the tag names which compiled part of a model this is (config.model.tag), and gets its "
        "own folder <hash>/rank_0_0/<tag> (rank_{rank}_{dp_rank} is the process's rank: rank_0_0 "
        "in one process)",
    "one line of the user's post-grad pass edited":
        "a user pass is keyed by its uuid (the hash of its source) in "
        "config.compilation.inductor_compile_config, where vLLM hashes it too (a function's repr "
        "carries its address, new in every process)",
    "torch._inductor.config.max_autotune = True in this process":
        "Inductor's own settings in this process (not the config's inductor_compile_config) are "
        "the compiler's factors: compiler.inductor.inductor_config",
    "the first call passes input_ids as int32":
        "the first call's tensors' dtypes, devices, static sizes and contiguity are "
        "config.model.inputs: with the guards dropped they are baked into the compiled code",
}

# label -> what to look at when the factor named for it is wrong (a question, not the factor)
QUESTIONS: dict[str, str] = {
    "compile_sizes=[4, 8]": "Does it change what is compiled? Then find where the key holds "
                            "CompilationConfig's fields (CompilationConfig.compile_factors).",
    "cudagraph_mode='PIECEWISE'": "Is every CompilationConfig field hashed? Read the "
                                  "ignored_factors of CompilationConfig.compile_factors: are the "
                                  "CUDA-graph fields among them, in vLLM 0.34 and here?",
    "rms_norm_eps 1e-05 -> 1e-06 in config.json": "The eps is a plain float an RMSNorm holds: is "
                                                  "it a graph input (a tensor) or a value Dynamo "
                                                  "bakes into the graph? Which part of the key "
                                                  "holds the module tree's plain values "
                                                  "(cache_keys.model_constants)?",
    "other weights, same shapes (a fine-tuned checkpoint)": "Weights are graph inputs: which of "
                                                            "their properties are hashed, and "
                                                            "are their values among them?",
    "a comment added to models/llama.py": "Which factor hashes the files Dynamo traced, and by "
                                          "what: their text, or the code it compiles to?",
    "the model built under set_model_tag('draft')": "set_model_tag names which compiled part of a "
                                                    "model this is: which part of the key "
                                                    "describes the model (§2's tree)?",
    "one line of the user's post-grad pass edited": "How is a user's pass keyed: by its repr "
                                                    "(an address, new in every process) or by "
                                                    "its uuid, the hash of its source? And where "
                                                    "in the config is the pass given?",
    "torch._inductor.config.max_autotune = True in this process":
        "Inductor's own settings in this process are not the config's inductor_compile_config: "
        "which top-level part of the key holds the compiler's own state?",
    "the first call passes input_ids as int32": "With the guards dropped, the first call's dtypes, "
                                                "devices, static sizes and contiguity are baked "
                                                "into the compiled code: which factor holds them?",
}

_KEY_SOLUTION = {
    "compile_sizes=[4, 8]": "config.compilation.compile_sizes",
    "cudagraph_mode='PIECEWISE'": "config.compilation.cudagraph_mode",
    "rms_norm_eps 1e-05 -> 1e-06 in config.json": "config.model.constants",
    "other weights, same shapes (a fine-tuned checkpoint)": None,
    "a comment added to models/llama.py": "code.files",
    "the model built under set_model_tag('draft')": "config.model.tag",
    "one line of the user's post-grad pass edited": "config.compilation.inductor_compile_config",
    "torch._inductor.config.max_autotune = True in this process":
        "compiler.inductor.inductor_config",
    "the first call passes input_ids as int32": "config.model.inputs",
}


def factor_of(name: str) -> str:
    """A field as viz.debugging.changed_factors names it, cut to the factor this exercise asks for:
    three parts at most (`config.model.constants.norm.eps` -> `config.model.constants`;
    `env.VLLM_USE_AOT_COMPILE` and `code.files` stay as they are)."""
    return ".".join(name.split(".")[:3])


def _factor_names(factors: dict) -> set[str]:
    from minivllm_compile.distributed.rank_check import flatten

    return {factor_of(n) for n in flatten({k: v for k, v in factors.items()
                                           if not k.endswith("_hash")})}


def factor_names() -> list[str]:
    """The names an answer can give: every factor of the backend key, as factor_of cuts them."""
    from minivllm_compile import CompilationConfig
    from minivllm_compile.compilation import cache_keys

    return sorted(_factor_names(cache_keys.backend_cache_key(
        CompilationConfig(), "cpu", cache_keys.model_factors(torch.nn.Module()))[1]))


@measured_once
def _key_truth() -> tuple[dict[str, tuple[list[str], bool]], set[str]]:
    """For each change: the backend-key factors it moves, and whether the AOT key moves; and the
    backend key's factors."""
    import minivllm_compile.models.llama as llama_module
    from minivllm_compile import CompilationConfig, CompilationMode
    from minivllm_compile.compilation import cache_keys
    from minivllm_compile.compilation.backends import set_model_tag
    from minivllm_compile.compilation.decorators import input_spec
    from minivllm_compile.models import CHECKPOINTS, load_model
    from minivllm_compile.viz.debugging import changed_factors

    def config(**kw: Any) -> CompilationConfig:
        kw.setdefault("compile_sizes", [4])
        kw.setdefault("inductor_compile_config", {"post_grad_custom_post_pass": user_pass})
        return CompilationConfig(mode=CompilationMode.VLLM_COMPILE, max_num_batched_tokens=16, **kw)

    tmp = Path(tempfile.mkdtemp(prefix="minivllm_ex09_"))
    try:
        checkpoint = tmp / "tiny-llama"  # a copy whose config.json can be edited
        checkpoint.mkdir()
        shutil.copy(CHECKPOINTS / "tiny-llama" / "config.json", checkpoint / "config.json")
        (checkpoint / "model.safetensors").symlink_to(CHECKPOINTS / "tiny-llama"
                                                      / "model.safetensors")
        # stands in for the traced models/llama.py: the package stays untouched
        traced = tmp / "llama.py"
        source = Path(llama_module.__file__).read_text()
        traced.write_text(source)
        ids = torch.arange(7)

        def keys(lm: Any, cc: CompilationConfig | None = None,
                 first_ids: torch.Tensor = ids) -> tuple[dict, str]:
            cc = cc or config()
            cc.traced_files = {str(traced)}  # what the decorator records during the trace
            spec = input_spec(lm.model, (first_ids, torch.arange(7)), {},
                              {"input_ids": 0, "positions": 0}, None)
            factors_of_model = cache_keys.model_factors(lm.model, spec)
            _, factors = cache_keys.backend_cache_key(cc, "cpu", factors_of_model)
            return factors, cache_keys.aot_cache_key(lm.model, cc, factors_of_model)[0]

        base = load_model(checkpoint, compilation_config=config())
        base_factors, base_aot = keys(base)
        variants: dict[str, Callable[[], tuple[dict, str]]] = {}
        variants["compile_sizes=[4, 8]"] = lambda: keys(base, config(compile_sizes=[4, 8]))
        variants["cudagraph_mode='PIECEWISE'"] = lambda: keys(base,
                                                              config(cudagraph_mode="PIECEWISE"))

        def eps() -> tuple[dict, str]:
            original = (checkpoint / "config.json").read_text()
            cfg = json.loads(original)
            assert cfg["rms_norm_eps"] == 1e-05, cfg["rms_norm_eps"]
            (checkpoint / "config.json").write_text(json.dumps({**cfg, "rms_norm_eps": 1e-06}))
            try:
                return keys(load_model(checkpoint, compilation_config=config()))
            finally:
                (checkpoint / "config.json").write_text(original)

        def weights() -> tuple[dict, str]:
            tuned = load_model(checkpoint, compilation_config=config())
            with torch.no_grad():
                for p in tuned.model.parameters():
                    p.add_(0.01)
            return keys(tuned)

        def comment() -> tuple[dict, str]:
            traced.write_text(source + "\n# a comment\n")
            try:
                return keys(base)
            finally:
                traced.write_text(source)

        def tag() -> tuple[dict, str]:
            with set_model_tag("draft"):  # the backend takes the tag when the model is built
                return keys(load_model(CHECKPOINTS / "tiny-llama", compilation_config=config()))

        def inductor() -> tuple[dict, str]:
            with torch._inductor.config.patch(max_autotune=True):
                return keys(base)

        variants["rms_norm_eps 1e-05 -> 1e-06 in config.json"] = eps
        variants["other weights, same shapes (a fine-tuned checkpoint)"] = weights
        variants["a comment added to models/llama.py"] = comment
        variants["the model built under set_model_tag('draft')"] = tag
        variants["one line of the user's post-grad pass edited"] = lambda: keys(
            base, config(inductor_compile_config={"post_grad_custom_post_pass": user_pass_edited}))
        variants["torch._inductor.config.max_autotune = True in this process"] = inductor
        variants["the first call passes input_ids as int32"] = lambda: keys(
            base, first_ids=ids.to(torch.int32))
        truth = {}
        for label, make in variants.items():
            factors, aot = make()
            moved = sorted({factor_of(n) for n in changed_factors(base_factors, factors)})
            truth[label] = (moved, aot != base_aot)
        return {label: truth[label] for label in CHANGES}, _factor_names(base_factors)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _factor_of(value: Any, label: str, known: set[str]) -> str | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("none", "same", "")):
        return None
    if isinstance(value, (set, list, tuple)) and len(value) == 1:
        value = next(iter(value))
    if isinstance(value, str) and value.strip() in known:
        return value.strip()
    raise ExerciseFailed(f"{label!r}: give the name of one factor, one of nb09.factor_names() "
                         f"({', '.join(sorted(known))}), or None for 'the key stays the same'; "
                         f"got {value!r}")


def _grade_keys(answer: Any) -> str:
    if not isinstance(answer, dict):
        raise ExerciseFailed(f"give a dict {{change: factor or None}} with one entry per change in "
                             f"nb09.CHANGES; got {type(answer).__name__}")
    missing, unknown = [c for c in CHANGES if c not in answer], [c for c in answer
                                                                 if c not in CHANGES]
    if missing or unknown:
        raise ExerciseFailed("answer one entry per change, labelled as in nb09.CHANGES: missing "
                             f"{missing}, not a change of this exercise {unknown}")
    known = set(factor_names())
    said = {label: _factor_of(answer[label], label, known) for label in CHANGES}
    truth, names = _key_truth()
    assert names == known, (names ^ known)
    problems, measured = [], []
    for label, why in CHANGES.items():
        said_factor = said[label]
        moved, _ = truth[label]
        # a change may move several fields of one config (a mode and the sizes it brings): any of
        # them names it
        if (said_factor in moved) if moved else said_factor is None:
            continue
        problems.append(f"{label}: not {said_factor!r}. {QUESTIONS[label]}")
        did = f"it moves {', '.join(moved)}" if moved else "the key stays the same"
        measured.append(f"{label}: {did} ({why})")
    if problems:
        raise ExerciseFailed(f"{len(problems)} of {len(CHANGES)} wrong (recomputed "
                             "with cache_keys.backend_cache_key; notebook 09 §3, §4 and "
                             "§8, the factor table):\n  - " + "\n  - ".join(problems),
                             measured="; ".join(measured))
    new_key = [label for label, (moved, _) in truth.items() if moved]
    aot_blind = [label for label in new_key if not truth[label][1]]
    assert aot_blind == ["a comment added to models/llama.py"], aot_blind
    return (f"{len(new_key)} of the {len(CHANGES)} changes give a new backend key; the AOT key "
            f"moves for all of them but one, {aot_blind[0]!r}: it is computed before Dynamo runs, "
            "so it cannot know the traced files, and the AOT load checks their sources instead "
            "(aot._verify_source_unchanged).")


@exercise("09.1", "which factor of the cache key covers each change", section="notebook 09 §3, §4 "
          "and §8 (the keys, what invalidates them, what they cover)",
          hint="read what each factor holds in section 8's table, and the ignored_factors of "
               "CompilationConfig.compile_factors for the config fields left out; tell a "
               "tensor's shape from its values, and both from a plain Python value a module holds",
          deeper_hint="For each change ask two questions. Does it change the code Inductor would "
                      "generate, or what the compiled pieces are served to? If not (only the "
                      "numbers in a tensor), the key should stay the same. If it does, where does "
                      "the change live: in the compilation config, in the model's plain values, "
                      "in a traced file's text, in Inductor's process-wide settings, in the first "
                      "call's tensors, or in the folder name? Each place is one part of the key: "
                      "cache_keys.py's docstring lists what each one holds.",
          solution=lambda: dict(_KEY_SOLUTION),
          wrong=lambda: {**_KEY_SOLUTION, "cudagraph_mode='PIECEWISE'": None,
                         "one line of the user's post-grad pass edited":
                             "compiler.inductor.inductor_config"},
          wrong_says="ignored_factors",
          gives_away="cudagraph_mode='PIECEWISE': it moves")
def grade_keys(answer: Any) -> str:
    return _grade_keys(answer)


# ---------------------------------------------------------------------------------------------
# 09.2: cold, warm, and warm without the mega artifact

STARTS = ("cold", "warm", "warm_non_mega")
COUNTERS = ("num_graphs_seen", "num_backend_compilations", "num_inductor_compiles",
            "num_aot_artifacts_loaded",
            "num_compiled_artifacts_loaded")
LAYERS, SIZES, MAX_TOKENS = 1, [], 16


@measured_once
def _starts_truth() -> tuple[dict[str, dict[str, int]], dict[str, Any]]:
    """Four first calls into a fresh cache: cold and warm, then cold and warm with the mega
    artifact off (its own key: VLLM_USE_MEGA_AOT_ARTIFACT is among the 'env' factors)."""
    from minivllm_compile import CompilationConfig, CompilationMode, compilation_counter
    from minivllm_compile.models import build_model

    def first_call(lm: Any) -> dict[str, int]:
        before = compilation_counter.clone()
        lm(torch.arange(7) % 200 + 1, torch.arange(7))
        return {c: getattr(compilation_counter, c) - getattr(before, c) for c in COUNTERS}

    def model() -> Any:
        cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, compile_sizes=SIZES,
                               max_num_batched_tokens=MAX_TOKENS)
        return build_model("llama", num_layers=LAYERS, compilation_config=cc)

    root = tempfile.mkdtemp(prefix="minivllm_ex09_cache_")
    try:
        with env(VLLM_CACHE_ROOT=root, VLLM_DISABLE_COMPILE_CACHE="0", VLLM_FORCE_AOT_LOAD=None,
                  VLLM_USE_AOT_COMPILE=None, VLLM_USE_MEGA_AOT_ARTIFACT=None,
                 VLLM_USE_STANDALONE_COMPILE=None):
            cold_lm = model()
            truth = {"cold": first_call(cold_lm), "warm": first_call(model())}
            with env(VLLM_USE_MEGA_AOT_ARTIFACT="0"):
                first_call(model())  # its own cold start
                truth["warm_non_mega"] = first_call(model())
    finally:
        shutil.rmtree(root, ignore_errors=True)
    backend = cold_lm.model.backend
    shape = {"pieces": len(backend.piecewise_graphs), "compiled": len(backend.piecewise_backends),
             "entries": len(backend.piecewise_backends[0].range_entries),
             "entry_names": ", ".join(map(str, backend.piecewise_backends[0].range_entries))}
    return truth, shape


def _grade_starts(answer: Any) -> str:
    if not isinstance(answer, dict) or set(answer) != set(STARTS) or not all(
            isinstance(answer[s], dict) and set(answer[s]) == set(COUNTERS)
            and all(isinstance(v, int) for v in answer[s].values()) for s in STARTS):
        raise ExerciseFailed(f"give {{start: {{counter: int}}}} for the starts {list(STARTS)} and, "
                             f"in each, the counters {list(COUNTERS)}; got {answer!r}")
    truth, shape = _starts_truth()
    n = shape["compiled"] * shape["entries"]
    why = {
        "cold": (f"nothing to load: Dynamo traces once, the graph splits into {shape['pieces']} "
                 f"pieces of which {shape['compiled']} are compiled (the attention pieces run "
                 f"eagerly), each for its entries {shape['entry_names']} (compile_sizes={SIZES}, "
                 f"one entry per size and per range): {n} backend compilations, {n} Inductor "
                 "compiles; the AOT file is saved, nothing loaded"),
        "warm": (f"the mega AOT file holds the stitching graph and all {n} pieces' artifacts: "
                 f"one AOT load, {n} artifacts rebuilt from it, and no Dynamo graph, no "
                 "backend, no Inductor compile"),
        "warm_non_mega": ("without the mega artifact the AOT file holds the Dynamo graph: the load "
                          "runs VllmBackend on it (1 graph seen), every piece and entry goes "
                          f"through CompilerManager.compile ({n} backend compilations), which "
                          f"finds each in its index (vllm_compile_cache.py) and loads it ({n} "
                          "artifacts loaded, 0 Inductor compiles)"),
    }
    questions = {
        "cold": "Nothing is on disk yet: how many pieces are compiled, for how many entries each "
                "(one per size, one per range)? What is saved, what is loaded?",
        "warm": "With the mega artifact on (the default from torch 2.12), what does the AOT file "
                "hold, and does the load run Dynamo, the backend or Inductor? (§1, §2)",
        "warm_non_mega": "Without the mega artifact the AOT file holds the Dynamo graph: what runs "
                         "on it at the load, and what does CompilerManager.compile then find in "
                         "the index for each piece and entry? (§2, 'Without the mega artifact')",
    }
    problems, measured = [], []
    for s in STARTS:
        wrong = [c for c in COUNTERS if answer[s][c] != truth[s][c]]
        if wrong:
            problems.append(f"{s}: {', '.join(wrong)} wrong. {questions[s]}")
            measured.append(f"{s}: " + ", ".join(f"{c} {truth[s][c]}" for c in COUNTERS)
                            + f" ({why[s]})")
    if problems:
        raise ExerciseFailed("the counters of the four first calls into a fresh cache say "
                             "otherwise (notebook 09 §1 and §2):\n  "
                             "- " + "\n  - ".join(problems), measured="; ".join(measured))
    return (f"Cold: {n} compiles ({shape['compiled']} compiled pieces x {shape['entries']} entry "
            f"per piece, {shape['entry_names']}); warm: one AOT load and {n} artifacts, nothing "
            "traced; warm without the mega artifact: the backend runs again on the saved graph and "
            f"loads the same {n} artifacts through its index, compiling none.")


def _starts_solution() -> dict[str, dict[str, int]]:
    return {"cold": {"num_graphs_seen": 1, "num_backend_compilations": 2,
                     "num_inductor_compiles": 2,
                     "num_aot_artifacts_loaded": 0, "num_compiled_artifacts_loaded": 0},
            "warm": {"num_graphs_seen": 0, "num_backend_compilations": 0,
                     "num_inductor_compiles": 0,
                     "num_aot_artifacts_loaded": 1, "num_compiled_artifacts_loaded": 2},
            "warm_non_mega": {"num_graphs_seen": 1, "num_backend_compilations": 2,
                              "num_inductor_compiles": 0,
                              "num_aot_artifacts_loaded": 1, "num_compiled_artifacts_loaded": 2}}


@exercise("09.2", "cold, warm, and warm without the mega artifact", section="notebook 09 §1 and §2 "
          "(cold, warm and AOT-load starts; what is on disk)",
          hint="count the compiled pieces and the entries per piece first; then read §2 for what "
               "the AOT file holds with and without the mega artifact, and what a load runs",
          deeper_hint="Cold: one trace, one split, then one backend compilation (and one "
                      "Inductor compile) per compiled piece and entry. Warm: open §2's tree and "
                      "the cell that lists the AOT file's contents: if the artifacts are inside "
                      "it, what is left for Dynamo, the backend or Inductor to do? Warm without "
                      "the mega artifact: the file holds a graph, not kernels: the backend must "
                      "run on that graph, and for each piece it asks CompilerManager, which "
                      "looks in its index before it compiles.",
          solution=_starts_solution,
          # the non-mega load taken for a mega one: no backend run
          wrong=lambda: {**_starts_solution(), "warm_non_mega": {
              **_starts_solution()["warm_non_mega"], "num_graphs_seen": 0,
              "num_backend_compilations": 0}},
          wrong_says="holds the Dynamo graph",
          gives_away="warm_non_mega: num_graphs_seen 1")
def grade_starts(answer: Any) -> str:
    return _grade_starts(answer)
