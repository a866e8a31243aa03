"""Every rank must run the same model the same way: checked at start, by name.

Ranks of one TP group that were given different configs or checkpoints do not fail by
themselves: they build graphs with different collectives (one waits in an all-reduce the other
never makes, until the timeout) or, worse, all-reduce partial sums of different weights and return
wrong text. vLLM's executor hands every worker the engine's one VllmConfig
(`WorkerProc.make_worker_process(vllm_config=...)`), and 0.34 compares nothing between the ranks
of one engine (its data-parallel handshake compares only the engines of a MoE model, by their
ParallelConfig's hash: "Configuration mismatch detected", v1/engine/utils.py); this project's
ranks each build their own (`launch.run(fn)` runs the caller's code on every rank, and
torchrun starts ranks with their own environments), so they compare what they were given, three
times, each before anything that would go wrong:

- a decorated model's construction: its class and its CompilationConfig (its compile_factors(),
  which name every setting that changes the compiled code, and the CUDA-graph mode);
- loading a checkpoint's shards: its config.json fields and every tensor's digest;
- the first call of a compiled model, before it loads or compiles: the compile cache key's
  factors (cache_keys.aot_cache_key's: the environment switches, the config with the model and
  its first inputs, the compiler's: torch's and Inductor's settings).

Each check gathers a dict of factors from every rank of the TP group (over its gloo group, so
bounded by the group's timeout) and raises RankMismatchError on every rank alike, naming the first
factor that differs and each rank's value. A model built whole (one rank, or under
`tensor_parallel_disabled()`) checks nothing: its callers ask only for a model built sharded.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch.distributed as dist

from minivllm_compile.distributed.parallel_state import get_tp_group, model_parallel_is_initialized

_ABSENT = "<absent>"
_FIX = ("Start every rank with the same model, checkpoint, CompilationConfig and environment: "
        "launch.run passes the same arguments to every rank, so build them from those, not from "
        "the rank number")


class RankMismatchError(ValueError):
    """The ranks of one TP group were started differently. `factor`: the first factor that
    differs (dotted: "compilation_config.pass_config.fuse_norm_quant"); `values`: each rank's
    value of it, by rank."""

    def __init__(self, message: str, factor: str, values: list[Any]):
        super().__init__(message)
        self.factor, self.values = factor, values


def flatten(factors: dict, prefix: str = "") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}: a differing factor is named down to the setting."""
    flat = {}
    for key, value in factors.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def first_difference(gathered: list[dict]) -> tuple[str, list[Any]] | None:
    """The first factor (in the order of rank 0's names, then the others'; check_same_on_all_ranks
    sends them sorted) whose value is not the same on every rank, with each rank's value; None
    when all agree."""
    flat = [flatten(f) for f in gathered]
    names = list(dict.fromkeys(name for f in flat for name in f))
    for name in names:
        values = [f.get(name, _ABSENT) for f in flat]
        if any(v != values[0] for v in values[1:]):
            return name, values
    return None


def _short(value: Any, n: int = 80) -> str:
    text = value if value is _ABSENT else repr(value)
    return text if len(text) <= n else text[:n - 3] + "..."


def mismatch_message(what: str, gathered: list[dict], factor: str, values: list[Any]) -> str:
    by_rank = ", ".join(f"rank {r}: {_short(v)}" for r, v in enumerate(values))
    # (hashed here, not with cache_files.sha: distributed/ sits below compilation/)
    hashes = ", ".join(hashlib.sha256(json.dumps(f, sort_keys=True).encode()).hexdigest()[:10]
                       for f in gathered)
    return (f"the ranks were not started with the same {what}: {factor!r} differs ({by_rank}; "
            f"{what} hash by rank: {hashes}). {_FIX}")


def check_same_on_all_ranks(what: str, factors: dict) -> None:
    """Raise RankMismatchError on every rank unless every rank of the TP group passed equal
    `factors` (plain data: what JSON holds; anything else is compared by its repr). A collective
    of the TP group (whether or not `tensor_parallel_disabled()` is in force): every rank must
    call it at the same point. Without a TP group of two or more it does nothing."""
    if not model_parallel_is_initialized() or not dist.is_initialized():
        return  # one process; or ranks faked in one, with no group to ask
    group = get_tp_group()
    if group.world_size <= 1:
        return
    mine = json.loads(json.dumps(factors, sort_keys=True, default=repr))
    gathered: list[Any] = [None] * group.world_size
    dist.all_gather_object(gathered, mine, group=group.cpu_group)
    diff = first_difference(gathered)
    if diff is not None:
        factor, values = diff
        raise RankMismatchError(mismatch_message(what, gathered, factor, values), factor, values)
