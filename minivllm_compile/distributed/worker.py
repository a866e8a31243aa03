"""One rank, as `minivllm_compile.launch` starts it: `main([<job folder>, <rank>, <port>,
<listening socket's fd>])` in a fresh interpreter.

It joins the TP group, runs the job's function, and leaves its result (or its traceback) in the
job folder for the launcher, which reads them after every rank has exited.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
import traceback
from pathlib import Path


def _die_with_parent() -> None:
    """Linux: the kernel kills this rank if the launcher dies (a notebook kernel restarted, a
    SIGKILL), so a rank is never left behind waiting on a collective."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the launcher died before the line above ran
        os._exit(1)


def main(argv: list[str]) -> int:
    job_dir, rank, port, listen_fd = Path(argv[0]), int(argv[1]), int(argv[2]), int(argv[3])
    _die_with_parent()
    job = pickle.loads((job_dir / "job.pkl").read_bytes())
    # the caller's import path, in its order: the function's modules resolve as they did there
    sys.path[:] = [*job["sys_path"], *(p for p in sys.path if p not in job["sys_path"])]
    from minivllm_compile.distributed import by_value, parallel_state

    try:
        fn = by_value.loads(job["fn"])
        parallel_state.init_distributed_environment(
            job["world_size"], rank, f"tcp://127.0.0.1:{port}", backend=job["backend"],
            timeout=job["distributed_timeout"], compile_timeout=job["compile_timeout"],
            master_listen_fd=listen_fd if rank == 0 else None)
        parallel_state.initialize_model_parallel(job["tp"])
        result = fn(*job["args"], **job["kwargs"])
        (job_dir / f"result_{rank}.pkl").write_bytes(pickle.dumps(result))
    except BaseException as e:  # noqa: BLE001  (whatever it is, the launcher must read it)
        (job_dir / f"error_{rank}.txt").write_text(
            f"{type(e).__name__}: {e}\n\n{traceback.format_exc()}")
        traceback.print_exc()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(1)  # not the interpreter's exit: tearing down may wait on a dead peer
    try:  # the result is written: a peer that dies now fails only its own exit code
        torch_distributed_barrier()
        parallel_state.destroy_distributed_environment()
    except Exception:  # noqa: BLE001, S110  (the result is in; the launcher reads each exit code)
        pass
    return 0


def torch_distributed_barrier() -> None:
    """Every rank past its function before any leaves: rank 0 hosts the rendezvous store."""
    import torch.distributed as dist

    dist.barrier()
