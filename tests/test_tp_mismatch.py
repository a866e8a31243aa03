"""Ranks started with different configs or checkpoints are refused at start, by name (issue 25).

The comparison itself is tested in this process; then two real TP=2 runs: one that catches the
three refusals on each rank (a compilation config, a checkpoint, an environment switch seen by the
compile cache key), and one where the refusal ends the run through the launcher, fast and with no
process left behind."""

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
def test_a_different_compilation_config_is_named_on_every_rank(refusals):
    for rank in (0, 1):
        factor, values, message = refusals[rank]["config"]
        assert factor == "compilation_config.pass_config.eliminate_noops"
        assert values == [True, False]
        assert "not started with the same compilation config" in message
        assert "rank 1: False" in message


@pytest.mark.compiles
def test_a_different_checkpoint_names_the_tensor(refusals):
    for rank in (0, 1):
        factor, values, message = refusals[rank]["checkpoint"]
        assert factor == "weights.model.norm.weight"
        assert values[0] != values[1] and all(v.startswith("float32[192]:") for v in values)
        assert "not started with the same checkpoint" in message


@pytest.mark.compiles
def test_a_different_compile_switch_is_named_before_anything_compiles(refusals):
    for rank in (0, 1):
        factor, values, message = refusals[rank]["env"]
        assert factor == "envs.VLLM_USE_BYTECODE_HOOK"
        assert values == [True, False]
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
