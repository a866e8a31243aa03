"""Tensor parallelism in real processes: TP=2 against TP=1 (eager and VLLM_COMPILE), the command
line, and the faults (a rank killed, a rank stuck, a run too long, a busy port, a TP size the model
or the world cannot take). Every run is bounded by a timeout and every test checks that no rank is
left running. Ranks share this machine's cores: the models are small and each run is short."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from minivllm_compile import launch
from minivllm_compile.models import load_model

# every test here compiles, or shares a module fixture that does: whole suite only
pytestmark = pytest.mark.compiles

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def main(", "import os\nimport sys\n\nclass Parser:\n    def __init__(self, argv):\n"]


def _gone(pids: list[int]) -> bool:
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        return False
    return True


@pytest.fixture(scope="module")
def tp2():
    """One TP=2 run (both ranks) comparing each rank's shard model with the whole model loaded in
    the same rank. The function is a closure, so it travels by value, as a notebook cell's does."""
    prompts, new_tokens = PROMPTS, 8

    def compare():
        from minivllm_compile import CompilationConfig, CompilationMode
        from minivllm_compile.distributed import get_tp_group, tensor_parallel_disabled
        from minivllm_compile.models import build_model

        out = {"rank": get_tp_group().rank_in_group, "group": get_tp_group().unique_name}
        text = PROMPTS[1] * 3  # about 200 tokens
        for name, dtype in (("tiny-llama", torch.float32), ("tiny-hybrid", torch.float32),
                            ("tiny-llama", torch.float64)):
            shard = load_model(name, dtype=dtype)
            with tensor_parallel_disabled():
                whole = load_model(name, dtype=dtype)
            ids = torch.tensor(shard.tokenizer.encode(text))
            pos = torch.arange(len(ids))
            out[name, dtype] = (shard(ids, pos), whole(ids, pos))
            if dtype == torch.float32:
                out[name, "text"] = (shard.generate(prompts, new_tokens),
                                     whole.generate(prompts, new_tokens))
        # VLLM_COMPILE: each rank traces and compiles its own graph (the eager backend here)
        cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, backend="eager")
        compiled = build_model("llama", num_layers=1, compilation_config=cc, seed=7)
        with tensor_parallel_disabled():
            whole = build_model("llama", num_layers=1, seed=7)
        ids = torch.tensor(compiled.tokenizer.encode(text))
        pos = torch.arange(len(ids))
        out["compiled"] = (compiled(ids, pos), whole(ids, pos))
        out["compiled", "text"] = (compiled.generate(prompts, new_tokens),
                                   whole.generate(prompts, new_tokens))
        graph = compiled.model.backend.graphs[0].graph
        out["all_reduce_nodes"] = [(str(n.target), n.args[1:], dict(n.kwargs)) for n in graph.nodes
                                   if n.op == "call_function" and "all_reduce" in str(n.target)]
        return out

    return launch.run(compare, tp=2, timeout=400)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-hybrid"])
def test_tp2_logits_and_text_equal_tp1(tp2, name):
    """Both trained models at TP=2, eager: the logits of a 200-token prefill equal TP=1's within
    1e-5 (plus 1e-5 relative: the partial sums of o_proj and down_proj round differently in
    float32 than the whole sums; in float64 the two agree to 1e-10), and greedy text is identical.
    Both ranks compute the same logits (the all-gathered vocabulary)."""
    assert [r["rank"] for r in tp2] == [0, 1]
    for r in tp2:
        shard, whole = r[name, torch.float32]
        assert shard.shape == whole.shape and shard.shape[1] == 258 and shard.shape[0] > 150
        torch.testing.assert_close(shard, whole, atol=1e-5, rtol=1e-5)
        assert r[name, "text"][0] == r[name, "text"][1]
    assert torch.equal(tp2[0][name, torch.float32][0], tp2[1][name, torch.float32][0])
    shard64, whole64 = tp2[0]["tiny-llama", torch.float64]
    assert (shard64 - whole64).abs().max() < 1e-10


def test_tp2_compiles_each_rank_with_the_all_reduce_as_one_node(tp2):
    """Under VLLM_COMPILE each rank traces its shard model once: every all-reduce is one
    `minivllm.all_reduce` node taking the group by name: after the embedding (vocabulary-parallel),
    o_proj and down_proj, so 2L+1 for L=1 layer. Logits and text equal TP=1 eager."""
    for r in tp2:
        nodes = r["all_reduce_nodes"]
        assert len(nodes) == 3
        assert all(n[0].startswith("minivllm.all_reduce") for n in nodes)  # the op, or its .default
        assert all(n[2] == {"group_name": r["group"]} or n[1] == (r["group"],) for n in nodes)
        assert r["group"] == "tp:0"
        compiled, whole = r["compiled"]
        torch.testing.assert_close(compiled, whole, atol=1e-5, rtol=1e-5)
        assert r["compiled", "text"][0] == r["compiled", "text"][1]


def test_the_command_line_prints_the_tp1_text():
    """`python -m minivllm_compile.launch --tp 2` prints rank 0's generations: TP=1's text."""
    args = [sys.executable, "-m", "minivllm_compile.launch", "--tp", "2", "--max-new-tokens", "8"]
    for p in PROMPTS:
        args += ["--prompt", p]
    proc = subprocess.run(args, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = [repr(t) for t in load_model("tiny-llama").generate(PROMPTS, 8)]
    assert proc.stdout.splitlines() == expected


def _record_pid(pid_dir):
    from minivllm_compile.distributed import get_tensor_model_parallel_rank

    Path(pid_dir, str(get_tensor_model_parallel_rank())).write_text(str(os.getpid()))
    return get_tensor_model_parallel_rank()


def _killed_mid_run(pid_dir):
    from minivllm_compile.distributed import tensor_model_parallel_all_reduce

    rank = _record_pid(pid_dir)
    for step in range(2000):
        tensor_model_parallel_all_reduce(torch.ones(4))
        if rank == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.005)


def test_a_rank_killed_mid_run_fails_the_others_at_once(tmp_path):
    """Rank 1 dies (SIGKILL) between two all-reduces: rank 0 fails on its own at its next
    collective (gloo sees the closed connection; no timeout is waited out), and the error names
    rank 1 and how it died."""
    start = time.monotonic()
    with pytest.raises(launch.LaunchError) as e:
        launch.run(_killed_mid_run, tp=2, args=(str(tmp_path),), timeout=200,
                   distributed_timeout=60)
    err = e.value
    assert err.rank == 1 and err.returncodes == [1, -signal.SIGKILL]
    assert str(err).startswith("rank 1 was killed by SIGKILL; rank 0 exited with code 1: ")
    assert time.monotonic() - start < 60  # well inside distributed_timeout: not a timeout
    pids = [int((tmp_path / str(r)).read_text()) for r in range(2)]
    assert pids == err.pids and _gone(pids)


def _stuck(pid_dir):
    from minivllm_compile.distributed import tensor_model_parallel_all_reduce

    rank = _record_pid(pid_dir)
    tensor_model_parallel_all_reduce(torch.ones(4))
    if rank == 1:
        time.sleep(600)  # alive but never reaching the next collective
    tensor_model_parallel_all_reduce(torch.ones(4))


def test_a_stuck_rank_times_the_others_out_and_is_killed(tmp_path):
    """Rank 1 hangs: rank 0's all-reduce gives up after distributed_timeout (2 s here; the default
    is under a minute) and rank 0 exits with the error; rank 1, still running, is killed."""
    start = time.monotonic()
    with pytest.raises(launch.LaunchError) as e:
        launch.run(_stuck, tp=2, args=(str(tmp_path),), timeout=200, distributed_timeout=2)
    err = e.value
    assert err.rank == 0 and err.returncodes == [1, None]
    assert "rank 1 was still running and was killed" in str(err)
    assert "timed out" in err.logs[0].lower() or "timeout" in err.logs[0].lower()
    assert time.monotonic() - start < 60
    assert _gone(err.pids)


def _sleep():
    time.sleep(600)


def test_a_run_past_its_timeout_is_killed():
    start = time.monotonic()
    with pytest.raises(launch.LaunchTimeout, match="did not finish within 5 s") as e:
        launch.run(_sleep, tp=2, timeout=5)
    assert time.monotonic() - start < 30 and _gone(e.value.pids)


def test_a_busy_port_is_refused_before_any_rank_starts(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=f"port {port} on 127.0.0.1 is already in use"):
            launch.run(_sleep, tp=2, port=port, timeout=5)
        assert launch.main(["--tp", "2", "--port", str(port)]) == 1
    assert f"error: port {port} on 127.0.0.1 is already in use" in capsys.readouterr().err


def test_a_tp_size_the_model_cannot_take_is_refused_by_name(tmp_path, capsys):
    """Before any rank starts: too many ranks for the heads, or for the (padded) vocabulary."""
    assert launch.main(["--tp", "4"]) == 1
    err = capsys.readouterr().err
    assert "num_attention_heads=6 is not divisible by the tensor-parallel size 4" in err
    cfg = json.loads((load_model("tiny-llama").checkpoint_dir / "config.json").read_text())
    cfg.update(num_attention_heads=6, num_key_value_heads=6, intermediate_size=96)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert launch.main(["--tp", "3", "--model", str(tmp_path)]) == 1
    assert "vocab_size=258, padded to 320" in capsys.readouterr().err


def test_a_world_that_does_not_match_tp_is_refused():
    """A rank that torchrun started (RANK, WORLD_SIZE set: 2 ranks) for --tp 1 refuses at once,
    naming both numbers, before joining any group (torchrun would start the second rank alike)."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="1")
    proc = subprocess.run([sys.executable, "-m", "minivllm_compile.launch", "--tp", "1"],
                          check=False, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1
    assert "torchrun started WORLD_SIZE=2 ranks but --tp is 1" in proc.stderr
