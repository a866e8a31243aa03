"""Run on N tensor-parallel ranks: `python -m minivllm_compile.launch --tp 2`, or `run(fn, tp=2)`.

`run` starts one process per rank (`python -m minivllm_compile.distributed.worker`), each in its
own process group, with its output in a log file. Rank 0 gets the rendezvous socket already bound
(127.0.0.1, a free port unless `port` is given), so no other program can take the port between
choosing it and using it, and nothing listens beyond loopback. Every rank joins the TP group, runs
`fn(*args, **kwargs)`, and returns its result; `run` returns the list, by rank.

It never waits without bound: a rank that fails or dies makes the others fail at their next
collective (gloo sees the closed connection at once; a stuck rank shows after
`distributed_timeout` seconds, or `compile_timeout` where its peers wait for it to compile), and
whatever still runs `distributed_timeout` seconds after the first failure is killed; the whole
run is bounded by `timeout`. Whatever happens, even an interrupt in a notebook, every process it
started is killed on the way out (the whole process group of each rank, so a compile worker of a
rank goes too), and a rank whose launcher dies is killed by the kernel (Linux). The error names
the rank that failed first and how.
"""

from __future__ import annotations

import argparse
import errno
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from minivllm_compile.distributed import by_value
from minivllm_compile.distributed.parallel_state import DEFAULT_COMPILE_TIMEOUT_S, DEFAULT_TIMEOUT_S

# after the first failure, the others get the collective timeout and this much (or that timeout
# again, if shorter) to fail on their own, so that their errors reach their logs
_GRACE_S = 5.0


class LaunchError(RuntimeError):
    """A rank failed or died. `rank`: the one that failed first; `returncodes`: every rank's exit
    status (negative: killed by that signal; None: still running, then killed); `logs`: every
    rank's output; `pids`: the ranks' process ids (all ended by the time this is raised)."""

    def __init__(self, message: str, rank: int, returncodes: list[int | None], logs: list[str],
                 pids: list[int]):
        super().__init__(message)
        self.rank, self.returncodes, self.logs, self.pids = rank, returncodes, logs, pids


class LaunchTimeout(TimeoutError):
    """The run outlived `timeout`; every rank was killed. `logs`, `pids` as in LaunchError."""

    def __init__(self, message: str, logs: list[str], pids: list[int]):
        super().__init__(message)
        self.logs, self.pids = logs, pids


def _bind(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a port in TIME_WAIT is free
    try:
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            busy = OSError(f"port {port} on 127.0.0.1 is already in use (another run, or another "
                           "program): pick a free port, or pass port=0 (the default) for one the "
                           "system picks")
            busy.errno = errno.EADDRINUSE
            raise busy from None
        raise
    return sock


def _how(rc: int | None) -> str:
    if rc is None:
        return "was still running and was killed"
    if rc < 0:
        return f"was killed by {signal.Signals(-rc).name}"
    return f"exited with code {rc}"


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # the rank's session: its own children too
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def run(fn: Callable, tp: int = 2, *, args: tuple = (), kwargs: dict | None = None,
        timeout: float = 600.0, distributed_timeout: float = DEFAULT_TIMEOUT_S,
        compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S, port: int = 0,
        backend: str | None = None, echo: bool = False) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `tp` ranks and return each rank's result, by rank.

    `fn` may be defined in a notebook cell (it is sent by value). `backend`: "gloo" (CPU tensors,
    the default without `tp` GPUs) or "nccl" (rank r on cuda:r). `timeout` bounds the whole run
    and `distributed_timeout` every collective (seconds), but the first after a compiled model's
    first call, which waits up to `compile_timeout` for the peers to finish compiling. `echo`
    prints every rank's output afterwards. Raises LaunchError naming the rank that failed first,
    LaunchTimeout (a TimeoutError), or OSError for a busy `port`."""
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tp must be a positive integer, got {tp!r}")
    if backend is None:
        import torch

        enough_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= tp
        backend = "nccl" if enough_gpus else "gloo"
    job = {"fn": by_value.dumps(fn), "args": tuple(args), "kwargs": dict(kwargs or {}), "tp": tp,
           "world_size": tp, "backend": backend, "distributed_timeout": distributed_timeout,
           "compile_timeout": compile_timeout,
           "sys_path": [p for p in sys.path if p]}
    sock = _bind(port)  # first: a busy port is refused before anything exists
    job_dir = Path(tempfile.mkdtemp(prefix="minivllm_launch_"))
    procs: list[subprocess.Popen] = []
    try:
        (job_dir / "job.pkl").write_bytes(pickle.dumps(job))
        # the ranks import this very package, not one that their working folder or an installed
        # copy would shadow (as `python -m` would: it puts the working folder first)
        root = str(Path(__file__).resolve().parent.parent)
        boot = (f"import sys; sys.path.insert(0, {root!r}); from minivllm_compile.distributed."
                "worker import main; sys.exit(main(sys.argv[1:]))")
        where = [str(job_dir), str(sock.getsockname()[1]), str(sock.fileno())]
        for rank in range(tp):
            with open(job_dir / f"rank_{rank}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-c", boot, where[0], str(rank), *where[1:]],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                    start_new_session=True, pass_fds=(sock.fileno(),) if rank == 0 else ()))
        sock.close()  # rank 0 holds it now
        codes = _wait(procs, timeout, distributed_timeout)
        logs = [(job_dir / f"rank_{r}.log").read_text(errors="replace") for r in range(tp)]
        if echo:
            for r, text in enumerate(logs):
                if text.strip():
                    print(f"--- rank {r} ---\n{text.rstrip()}")
        pids = [p.pid for p in procs]
        if codes is None:
            _kill(procs)
            raise LaunchTimeout(f"the run on {tp} ranks did not finish within {timeout:g} s "
                                "(timeout=); every rank was killed", logs, pids)
        if any(codes):
            _kill(procs)
            raise _failure(codes, logs, job_dir, pids)
        return [pickle.loads((job_dir / f"result_{r}.pkl").read_bytes()) for r in range(tp)]
    finally:
        sock.close()
        _kill(procs)
        shutil.rmtree(job_dir, ignore_errors=True)


def _wait(procs: list[subprocess.Popen], timeout: float, distributed_timeout: float):
    """Exit codes by rank once all have exited (a rank still running when given up on: None), or
    None when the run as a whole outlived `timeout`."""
    start, failed_at = time.monotonic(), {}
    while True:
        codes = [p.poll() for p in procs]
        now = time.monotonic()
        for r, c in enumerate(codes):
            if c not in (None, 0):
                failed_at.setdefault(r, now)
        if all(c is not None for c in codes):
            return codes
        wait = distributed_timeout + min(_GRACE_S, distributed_timeout)
        if failed_at and now - min(failed_at.values()) > wait:
            return codes
        if now - start > timeout:
            return None
        time.sleep(0.05)


def _failure(codes: list[int | None], logs: list[str], job_dir: Path,
             pids: list[int]) -> LaunchError:
    # the first to fail: a rank killed by a signal, else the lowest rank with an error of its own
    # (the others' errors are usually "connection closed by peer" after it)
    failed = [r for r, c in enumerate(codes) if c]
    first = next((r for r in failed if codes[r] is not None and codes[r] < 0), failed[0])
    order = [first, *[r for r in range(len(codes)) if r != first and codes[r] != 0]]
    lines = []
    for r in order:
        err = job_dir / f"error_{r}.txt"
        if err.exists():  # the exception it raised
            what = err.read_text().splitlines()[0]
        elif codes[r] is not None and codes[r] > 0:  # it died before it could say (an import)
            what = _tail(logs[r], 1)
        else:  # killed: nothing of its own to say
            what = ""
        lines.append(f"rank {r} {_how(codes[r])}" + (f": {what}" if what else ""))
    shown = next((r for r in order if logs[r].strip()), first)  # a killed rank may have no output
    detail = _tail(logs[shown]) or "(no output)"
    return LaunchError("; ".join(lines) + f"\n--- rank {shown}'s last output ---\n{detail}",
                       first, codes, logs, pids)


# --- the command line -------------------------------------------------------------------------

def _rank_main(model: str, prompts: list[str], max_new_tokens: int, forward: bool,
               compilation_mode: str, backend: str, device: str | None = None) -> list[str]:
    """What every rank runs for the command line: load the model (its shard), then generate (or one
    forward). Returns the lines to print: every rank computes them, rank 0's are printed."""
    import torch

    from minivllm_compile import CompilationConfig, CompilationMode
    from minivllm_compile.distributed import get_tp_group, model_parallel_is_initialized
    from minivllm_compile.models import load_model

    if model_parallel_is_initialized():
        device = str(get_tp_group().device)
    mode = CompilationMode[compilation_mode]
    cc = None if mode == CompilationMode.NONE else CompilationConfig(mode=mode, backend=backend)
    lm = load_model(model, compilation_config=cc, device=device)
    if not forward:
        return [repr(text) for text in lm.generate(prompts, max_new_tokens)]
    lines = []
    for p in prompts:
        ids = torch.tensor(lm.tokenizer.encode(p), device=lm.device)
        logits = lm(ids, torch.arange(len(ids), device=lm.device))[-1].float()
        top = int(logits.argmax())
        token = lm.tokenizer.decode([top])
        lines.append(f"{p!r} -> next token {token!r} (logit {logits[top]:.3f})")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m minivllm_compile.launch",
        description="Generate (or run one forward) on --tp ranks; print rank 0's text.")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size: the number of ranks")
    ap.add_argument("--model", default="tiny-llama", help="a shipped model or a checkpoint folder")
    ap.add_argument("--prompt", action="append", help="repeat for a batch (default: 'def main(')")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--forward", action="store_true", help="one forward per prompt: its next token")
    ap.add_argument("--compilation-mode", default="NONE", choices=["NONE", "VLLM_COMPILE"])
    ap.add_argument("--backend", default="inductor", choices=["inductor", "eager"],
                    help="the compiler of VLLM_COMPILE's pieces")
    ap.add_argument("--port", type=int, default=0,
                    help="rendezvous port on 127.0.0.1 (0: a free one)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    ap.add_argument("--distributed-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                    help="seconds a rank waits in a collective for a peer that died or hangs")
    ap.add_argument("--compile-timeout", type=float, default=DEFAULT_COMPILE_TIMEOUT_S,
                    help="seconds a rank waits for its peers to finish compiling")
    a = ap.parse_args(argv)
    work = {"model": a.model, "prompts": a.prompt or ["def main("],
            "max_new_tokens": a.max_new_tokens, "forward": a.forward,
            "compilation_mode": a.compilation_mode, "backend": a.backend}
    try:
        if "WORLD_SIZE" in os.environ and "RANK" in os.environ:  # started by torchrun: one rank
            return _external_rank(a, work)
        _check_model(a.model, a.tp)
        lines = _rank_main(**work) if a.tp == 1 else run(
            _rank_main, a.tp, kwargs=work, timeout=a.timeout,
            distributed_timeout=a.distributed_timeout, compile_timeout=a.compile_timeout,
            port=a.port)[0]
    except (LaunchError, OSError, ValueError) as e:  # (a LaunchTimeout is an OSError)
        print(f"error: {e}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


def _check_model(model: str, tp: int) -> None:
    """Before any rank starts: the TP size must split the model (the error names the field)."""
    from minivllm_compile.models import (
        CHECKPOINTS,
        SHIPPED,
        ModelConfig,
        check_tensor_parallel_size,
    )

    path = CHECKPOINTS / model if model in SHIPPED else Path(model)
    if (path / "config.json").is_file():  # else load_model names what is missing
        check_tensor_parallel_size(ModelConfig.from_file(path / "config.json"), tp)


def _external_rank(a: argparse.Namespace, work: dict) -> int:
    """One rank of a torchrun launch (vLLM's "external_launcher"): torchrun set RANK, WORLD_SIZE,
    MASTER_ADDR and MASTER_PORT; its world must be the TP group."""
    world_size, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    if world_size != a.tp:
        raise ValueError(f"torchrun started WORLD_SIZE={world_size} ranks but --tp is {a.tp}: "
                         f"start exactly --tp ranks (torchrun --nproc-per-node {a.tp}), or run "
                         "without torchrun and this launcher starts them")
    _check_model(a.model, a.tp)
    from minivllm_compile.distributed import parallel_state

    parallel_state.init_distributed_environment(world_size, rank, "env://",
                                                timeout=a.distributed_timeout,
                                                compile_timeout=a.compile_timeout)
    parallel_state.initialize_model_parallel(a.tp)
    try:
        lines = _rank_main(**work)
    finally:
        parallel_state.destroy_distributed_environment()
    if rank == 0:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
