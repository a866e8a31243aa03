"""What the ranks of a TP run check and wait for at start (issue 25): ranks started with different
configs or checkpoints are refused, by name; a peer still compiling is waited for, up to the
compile timeout (and a peer past it named); each rank dumps its compile into its own folder.

The comparison itself is tested in this process; then real TP=2 runs: one that catches the three
refusals on each rank (a compilation config, a checkpoint, an environment switch seen by the
compile cache key), one where the refusal ends the run through the launcher, fast and with no
process left behind, and two where rank 1 starts compiling late."""

from __future__ import annotations

import os
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from minivllm_compile import launch
from minivllm_compile.distributed import rank_check
from minivllm_compile.models import CHECKPOINTS


def test_the_first_differing_factor_is_named_down_to_the_setting():
    same = {"compilation_config": {"mode": "VLLM_COMPILE", "pass_config": {"fuse": False}},
            "model_class": "m.Llama"}
    other = {"compilation_config": {"mode": "VLLM_COMPILE", "pass_config": {"fuse": True}},
             "model_class": "m.Llama"}
    assert rank_check.first_difference([same, dict(same)]) is None
    assert rank_check.first_difference([same, other]) == (
        "compilation_config.pass_config.fuse", [False, True])
    # a factor only one rank has is a difference too, and a third rank that agrees is shown
    factor, values = rank_check.first_difference([same, same, {**same, "extra": 1}])
    assert (factor, values) == ("extra", ["<absent>", "<absent>", 1])
    message = rank_check.mismatch_message("configs", [same, other], *rank_check.first_difference(
        [same, other]))
    assert "'compilation_config.pass_config.fuse' differs (rank 0: False, rank 1: True;" in message
    assert "configs hash by rank: " in message and "Start every rank with the same" in message


def test_one_rank_compares_nothing():
    rank_check.check_same_on_all_ranks("configs", {"anything": object()})  # no group: no error


def _refusals(other_checkpoint: str) -> dict:
    """On each rank: three starts that differ on rank 1 only, each refused on both ranks alike."""
    from minivllm_compile import CompilationConfig, CompilationMode, PassConfig
    from minivllm_compile.distributed import get_tensor_model_parallel_rank
    from minivllm_compile.distributed.rank_check import RankMismatchError
    from minivllm_compile.models import load_model

    rank, out = get_tensor_model_parallel_rank(), {}
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="eager",
                           pass_config=PassConfig(eliminate_noops=rank == 0))
    try:  # refused while the model is built, before any weight is read
        load_model("tiny-llama", compilation_config=cc)
    except RankMismatchError as e:
        out["config"] = (e.factor, e.values, str(e))
    try:  # refused while the shards are taken, before any is kept
        load_model("tiny-llama" if rank == 0 else other_checkpoint)
    except RankMismatchError as e:
        out["checkpoint"] = (e.factor, e.values, str(e))
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="eager")
    lm = load_model("tiny-llama", compilation_config=cc)
    if rank == 1:  # a switch of the compile cache key, set in one rank's environment only
        os.environ["VLLM_USE_BYTECODE_HOOK"] = "0"
    ids = torch.tensor(lm.tokenizer.encode("def main("))
    try:  # refused at the first call, before anything is loaded or compiled
        lm(ids, torch.arange(len(ids)))
    except RankMismatchError as e:
        out["env"] = (e.factor, e.values, str(e))
    out["compiled"] = lm.model.compiled or lm.model.aot_compiled_fn is not None
    return out


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    # a copy of tiny-llama with one weight nudged: same shapes, same config, other numbers
    folder = tmp_path_factory.mktemp("other-llama")
    tensors = load_file(str(CHECKPOINTS / "tiny-llama" / "model.safetensors"))
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1e-3
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text((CHECKPOINTS / "tiny-llama" / "config.json").read_text())
    return launch.run(_refusals, tp=2, args=(str(folder),), timeout=240, distributed_timeout=60)


@pytest.mark.compiles
@pytest.mark.parametrize("case, factor, what, expected", [
    ("config", "compilation_config.pass_config.eliminate_noops", "compilation config",
     [True, False]),
    # the nudged tensor: same dtype and shape, other bytes
    ("checkpoint", "weights.model.norm.weight", "checkpoint", "float32[192]:"),
    ("env", "env.VLLM_USE_BYTECODE_HOOK", "compile cache key", [True, False]),
])
def test_a_difference_is_named_on_every_rank_before_anything_compiles(refusals, case, factor, what,
                                                                       expected):
    for rank in (0, 1):
        named, values, message = refusals[rank][case]
        assert named == factor
        if isinstance(expected, str):
            assert values[0] != values[1] and all(v.startswith(expected) for v in values)
        else:
            assert values == expected
        assert (f"not started with the same {what}: {factor!r} differs (rank 0: {values[0]!r}, "
                f"rank 1: {values[1]!r};") in message
        assert not refusals[rank]["compiled"]


def _started_differently():
    from minivllm_compile import CompilationConfig, CompilationMode
    from minivllm_compile.distributed import get_tensor_model_parallel_rank
    from minivllm_compile.models import load_model

    rank = get_tensor_model_parallel_rank()
    mode = CompilationMode.VLLM_COMPILE if rank == 0 else CompilationMode.NONE
    load_model("tiny-llama", compilation_config=CompilationConfig(mode=mode, backend="eager"))


@pytest.mark.compiles
def test_the_launcher_fails_fast_naming_the_factor_and_leaves_no_rank():
    start = time.monotonic()
    with pytest.raises(launch.LaunchError) as err:
        launch.run(_started_differently, tp=2, timeout=240, distributed_timeout=120)
    # well before the collective timeout: both ranks saw the difference and said so
    assert time.monotonic() - start < 100
    assert "rank 0 exited with code 1: RankMismatchError" in str(err.value)
    assert "'compilation_config.mode' differs (rank 0: 'VLLM_COMPILE', rank 1: 'NONE';" \
        in str(err.value)
    for pid in err.value.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# --- a peer still compiling ----------------------------------------------------------------------

def _slow_compile_on_rank_1(seconds: float, dump: str | None = None):
    """Rank 1 takes `seconds` longer to compile than rank 0 (its compile starts late), which then
    waits at its first all-reduce: longer than the collective timeout, within the compile one.
    `dump`: the debug_dump_path of both ranks."""
    import contextlib

    from minivllm_compile import CompilationConfig, CompilationMode
    from minivllm_compile.compilation import decorators
    from minivllm_compile.distributed import get_tensor_model_parallel_rank
    from minivllm_compile.models import build_model

    if get_tensor_model_parallel_rank() == 1:
        monitor = decorators.monitor_torch_compile

        @contextlib.contextmanager
        def slow(config):
            time.sleep(seconds)
            with monitor(config):
                yield

        decorators.monitor_torch_compile = slow
    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="eager",
                           debug_dump_path=dump)
    lm = build_model("llama", num_layers=1, compilation_config=cc, seed=5)
    ids = torch.arange(1, 9)
    return lm(ids, torch.arange(len(ids)))


@pytest.fixture(scope="module")
def slow_peer(tmp_path_factory):
    dump = tmp_path_factory.mktemp("dump")
    # rank 0 waits 6 s at its first all-reduce, twice the collective timeout
    outputs = launch.run(_slow_compile_on_rank_1, tp=2, args=(6.0, str(dump)), timeout=240,
                         distributed_timeout=3, compile_timeout=120)
    return outputs, dump


@pytest.mark.compiles
def test_the_first_collective_after_a_compile_waits_for_a_slower_peer(slow_peer):
    outputs, _ = slow_peer
    torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=0)


@pytest.mark.compiles
def test_each_rank_dumps_its_compile_into_its_own_folder(slow_peer):
    """vLLM's `rank_{rank}_dp_{dp}` below debug_dump_path: the ranks' graphs differ (each holds
    its own rank's constants), and one folder would keep whichever rank wrote last."""
    _, dump = slow_peer
    assert sorted(p.name for p in dump.iterdir()) == ["rank_0_dp_0", "rank_1_dp_0"]
    graphs = [(dump / f"rank_{r}_dp_0" / "computation_graph_backbone.py").read_text()
              for r in (0, 1)]
    assert all("minivllm.all_reduce" in g for g in graphs)
    # each rank's slice of the vocabulary is baked in: rows [0, 160) on rank 0, [160, 258) on 1
    assert "l_input_ids_ >= 0" in graphs[0] and "l_input_ids_ >= 160" in graphs[1]
    assert all((dump / f"rank_{r}_dp_0" / "transformed_code.py").is_file() for r in (0, 1))


@pytest.mark.compiles
def test_a_peer_compiling_past_the_compile_timeout_is_named():
    with pytest.raises(launch.LaunchError) as err:
        launch.run(_slow_compile_on_rank_1, tp=2, args=(30.0,), timeout=240,
                   distributed_timeout=3, compile_timeout=3)
    assert "rank 0 exited with code 1" in str(err.value)
    assert "did not reach its first collective after compiling within 3 s (compile_timeout)" \
        in str(err.value)
    for pid in err.value.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
