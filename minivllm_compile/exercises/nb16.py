"""Notebook 16's exercises (tensor parallel): predict the all-reduces of a decode step (how many,
how many bytes), and the cache folders a TP=2 run writes. Each grader measures one real TP=2 run
(`launch.run`, two ranks on gloo, bounded by a timeout; every rank is ended on the way out), once
per process."""

from __future__ import annotations

import math
import shutil
import tempfile
from typing import Any

from minivllm_compile.exercises import ExerciseFailed, env, exercise, measured_once

TP = 2
NUM_LAYERS = 3  # the model of both exercises: build_model("llama", num_layers=3), in bfloat16
BATCH = 6  # a decode step of six sequences, one new token each
SEQ_LEN = 9  # each sequence's length after this step
TAG = "backbone"  # the model's tag: the folder below each rank's

# the profiler names a tensor's dtype as c10 does: torch's name, and its bytes per element
_DTYPES = {"float": ("float32", 4), "double": ("float64", 8), "c10::BFloat16": ("bfloat16", 2),
           "c10::Half": ("float16", 2)}


def _rank_run(root: str, num_layers: int, batch: int, seq_len: int) -> dict[str, Any]:
    """On each rank: compile the model with the compile cache on (in `root`), run one decode step,
    then a second one under torch.profiler, and count the calls of minivllm::all_reduce there."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from minivllm_compile import CompilationConfig, CompilationMode
    from minivllm_compile.distributed import get_tensor_model_parallel_rank
    from minivllm_compile.models import build_model

    with env(VLLM_CACHE_ROOT=root, VLLM_DISABLE_COMPILE_CACHE="0"):
        cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="eager",
                               compile_sizes=[], max_num_batched_tokens=16)
        lm = build_model("llama", num_layers=num_layers, compilation_config=cc,
                         dtype=torch.bfloat16)
        md = lm.metadata([1] * batch, [seq_len] * batch, list(range(batch)),
                         lm.allocate_caches([seq_len] * batch))
        ids, pos = torch.arange(1, batch + 1), torch.full((batch,), seq_len - 1)
        with torch.inference_mode():
            lm.forward_step(ids, pos, md)  # compiles
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                lm.forward_step(ids, pos, md)
    calls = [(e.input_shapes[0], _DTYPES[e.input_dtypes[0]]) for e in prof.events()
             if e.name == "minivllm::all_reduce"]
    return {"rank": get_tensor_model_parallel_rank(), "hidden": lm.config.hidden_size,
            "calls": [(shape, name) for shape, (name, _) in calls],
            "bytes": sum(math.prod(shape) * size for shape, (_, size) in calls)}


@measured_once
def _tp2_run() -> tuple[list[dict[str, Any]], list[str]]:
    """One TP=2 run of the exercises' model: each rank's all-reduces, and the folders below the
    compile cache's root (`<hash>/<rank folder>/<tag>`, the hash written as '<hash>', sorted),
    with the number of distinct hash folders first, as 'hashes=N'."""
    from minivllm_compile import launch

    tmp = tempfile.mkdtemp(prefix="minivllm_ex16_")
    try:
        ranks = launch.run(_rank_run, tp=TP, args=(tmp, NUM_LAYERS, BATCH, SEQ_LEN),
                           backend="gloo", timeout=300)
        with env(VLLM_CACHE_ROOT=tmp):
            from minivllm_compile.compilation.cache_files import cache_root

            top = cache_root()
        hashes = sorted(p.name for p in top.iterdir() if p.is_dir()
                        and p.name != "torch_aot_compile")
        folders = sorted({f"<hash>/{p.parent.name}/{p.name}" for h in hashes
                          for p in (top / h).glob("*/*") if p.is_dir()})
        return ranks, [f"hashes={len(hashes)}", *folders]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# 16.1: the all-reduces of a decode step

def _grade_all_reduces(answer: Any) -> str:
    if not isinstance(answer, dict) or set(answer) != {"calls", "bytes"} \
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in answer.values()):
        raise ExerciseFailed("give {'calls': int, 'bytes': int}: the all-reduces one rank makes in "
                             f"one decode step, and the bytes of the tensors it passes them; got "
                             f"{answer!r}")
    ranks, _ = _tp2_run()
    r0 = ranks[0]
    calls, nbytes = len(r0["calls"]), r0["bytes"]
    assert all(len(r["calls"]) == calls and r["bytes"] == nbytes for r in ranks)  # every rank
    shapes = sorted({(tuple(s), d) for s, d in r0["calls"]})
    measured = (f"rank 0 called minivllm::all_reduce {calls} times in one decode step; on tensors "
                f"{', '.join(f'{list(s)} {d}' for s, d in shapes)}; {nbytes} bytes in all")
    if (answer["calls"], answer["bytes"]) == (calls, nbytes):
        return (f"{calls} all-reduces: two per layer (after o_proj and after down_proj, the row-"
                f"parallel linears) and one after the vocabulary-parallel embedding; each sums a "
                f"[{BATCH}, {r0['hidden']}] bfloat16 tensor (one token per sequence), "
                f"{BATCH * r0['hidden'] * 2} bytes, so {nbytes} bytes per step on each rank.")
    why = []
    if answer["calls"] != calls:
        why.append("the number of calls is off: count the linears whose partial sums must be "
                   "added up (the row-parallel ones) in each layer, and ask whether any other "
                   "layer of the model is split so that each rank holds only part of its output "
                   "(what does a rank's embedding return for a token id outside its half of the "
                   "vocabulary?)")
    per_call = answer["bytes"] / answer["calls"] if answer["calls"] else 0
    if per_call != nbytes / calls:
        why.append("the bytes per call are off: each call all-reduces a [num_tokens, hidden] "
                   "tensor in the model's dtype; how many tokens does a decode step of these "
                   "sequences bring, and how many bytes is one bfloat16 element?")
    elif answer["calls"] == calls:
        why.append("calls times bytes per call must give the bytes")
    raise ExerciseFailed("\n".join(why), measured=measured)


@exercise("16.1", "the all-reduces of a decode step", section="notebook 16 §1 and §4",
          hint=f"build_model('llama', num_layers={NUM_LAYERS}, dtype=torch.bfloat16) at TP={TP}, "
               f"a decode step of {BATCH} sequences: count the all-reduce nodes per layer (§1 "
               "draws them), then multiply by the bytes of one call (§4)",
          deeper_hint="§1's graph has one all-reduce after each row-parallel linear and one more "
                      "that is not in a decoder layer: find where it comes from and whether the "
                      "number of layers changes it. §4: a call sums a [num_tokens, hidden] tensor "
                      "(hidden_size is 96 in build_model's llama); num_tokens of a decode step is "
                      "one per sequence; bfloat16 takes 2 bytes an element. Then calls x bytes "
                      "per call.",
          solution=lambda: {"calls": 2 * NUM_LAYERS + 1,
                            "bytes": (2 * NUM_LAYERS + 1) * BATCH * 96 * 2},
          wrong=lambda: {"calls": 2 * NUM_LAYERS, "bytes": 2 * NUM_LAYERS * BATCH * 96 * 2},
          wrong_says="what does a rank's embedding return",
          gives_away=f"minivllm::all_reduce {2 * NUM_LAYERS + 1} times")
def grade_all_reduces(answer: Any) -> str:
    return _grade_all_reduces(answer)


# ---------------------------------------------------------------------------------------------
# 16.2: the cache folders of a TP=2 run

def _grade_folders(answer: Any) -> str:
    if not isinstance(answer, dict) or set(answer) != {"hashes", "folders"} \
            or not isinstance(answer["hashes"], int) \
            or not isinstance(answer["folders"], (set, frozenset, list, tuple)) \
            or not all(isinstance(f, str) for f in answer["folders"]):
        raise ExerciseFailed("give {'hashes': int, 'folders': {'<hash>/<rank folder>/<tag>', "
                             "...}}: how many hash folders the run makes, and the folders below "
                             f"them, each hash written as '<hash>'; got {answer!r}")
    _, listing = _tp2_run()
    hashes, folders = int(listing[0].removeprefix("hashes=")), set(listing[1:])
    said = {f.strip("/") for f in answer["folders"]}
    if (answer["hashes"], said) == (hashes, folders):
        return (f"one hash folder for both ranks (the TP size is a factor of the hash, the rank is "
                f"not), and below it a folder per rank, rank_<rank>_<dp rank>, each holding the "
                f"model's tag: {sorted(folders)}.")
    why = []
    if answer["hashes"] != hashes:
        why.append("the number of hash folders is off: which factors of the hash differ between "
                   "the two ranks? (the config, the code and the TP size are the same on both; is "
                   "the rank a factor?)")
    if said != folders:
        why.append("the folders below the hash are off: each rank writes its own folder, named "
                   "after its rank and its data-parallel rank, and the model's tag below it "
                   "(notebook 09 §2 shows a TP=1 run's tree)")
    raise ExerciseFailed("\n".join(why), measured=(
        f"{hashes} hash folder(s); below them: {', '.join(sorted(folders))}"))


@exercise("16.2", "the cache folders of a TP=2 run", section="notebook 16 §2",
          hint="the run of 16.1 with the compile cache on (a fresh VLLM_CACHE_ROOT): which "
               "factors of the hash differ between the ranks, and what each rank names its own "
               "folder (§2 lists a run's tree)",
          deeper_hint="A TP=1 run writes <root>/torch_compile_cache/<hash>/rank_0_0/backbone "
                      "(notebook 09 §2). At TP=2 each rank computes the hash from its own "
                      "config: ask which factor could differ (the TP size is the same on "
                      "both ranks; is the rank in the hash?). Then each rank writes below "
                      "the hash a folder named rank_<its rank>_<its data-parallel rank>; "
                      "there is no data parallelism here.",
          solution=lambda: {"hashes": 1,
                            "folders": {"<hash>/rank_0_0/backbone", "<hash>/rank_1_0/backbone"}},
          wrong=lambda: {"hashes": 2,
                         "folders": {"<hash>/rank_0_0/backbone", "<hash>/rank_1_0/backbone"}},
          wrong_says="is the rank a factor",
          gives_away="1 hash folder(s)")
def grade_folders(answer: Any) -> str:
    return _grade_folders(answer)
