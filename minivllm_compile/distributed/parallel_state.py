"""The process groups (vLLM's distributed/parallel_state.py, cut down to tensor parallelism).

The workflow is vLLM's: `init_distributed_environment` joins this process to the world (gloo on
the CPU, NCCL on CUDA), `initialize_model_parallel` builds the tensor-parallel group, the parallel
layers read `get_tensor_model_parallel_rank()` / `_world_size()` when they are built, and
`destroy_distributed_environment` leaves. A process that never calls them is one rank of one: the
getters answer rank 0 of 1 (vLLM asserts instead), so every single-process model runs unchanged.

The collectives are custom ops, `torch.ops.minivllm.all_reduce(tensor, group_name)` and
`all_gather`, out of place, with a fake that only allocates: Dynamo traces each as one graph node.
The group goes in by its unique name ("tp:0"), a string Dynamo can bake into the graph, where a
`GroupCoordinator` object could not be passed; the op looks the group up in a registry by that name.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from minivllm_compile.ops import direct_register_custom_op

logger = logging.getLogger(__name__)

# vLLM's ParallelConfig.distributed_timeout_seconds leaves torch's default (10 min for NCCL, 30 for
# gloo); here a dead or stuck rank must surface in well under a minute, as an error
DEFAULT_TIMEOUT_S = 45.0
# but a rank that found its pieces in the shared Inductor cache, or compiled faster, reaches its
# first collective while a peer may compile for minutes: that one wait gets this long instead
DEFAULT_COMPILE_TIMEOUT_S = 600.0

_group_name_counter: dict[str, int] = {}
_groups: dict[str, Callable[[], GroupCoordinator | None]] = {}


def _get_unique_name(name: str) -> str:
    """"tp" -> "tp:0", then "tp:1", ...: one name per group created in this process."""
    n = _group_name_counter.get(name, 0)
    _group_name_counter[name] = n + 1
    return f"{name}:{n}"


def _lookup(group_name: str) -> GroupCoordinator:
    ref = _groups.get(group_name)
    group = ref() if ref is not None else None
    if group is None:
        raise ValueError(f"no process group named {group_name!r} in this process (known: "
                         f"{sorted(_groups)}); was init_distributed_environment called here?")
    return group


def all_reduce(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return _lookup(group_name)._all_reduce_out_place(tensor)


def all_reduce_fake(tensor: torch.Tensor, group_name: str) -> torch.Tensor:
    return torch.empty_like(tensor)


def all_gather(tensor: torch.Tensor, dim: int, world_size: int, group_name: str) -> torch.Tensor:
    return _lookup(group_name)._all_gather_out_place(tensor, dim)


def all_gather_fake(tensor: torch.Tensor, dim: int, world_size: int,
                    group_name: str) -> torch.Tensor:
    shape = list(tensor.shape)
    shape[dim] *= world_size
    return tensor.new_empty(shape)


direct_register_custom_op("all_reduce", all_reduce, fake_impl=all_reduce_fake)
direct_register_custom_op("all_gather", all_gather, fake_impl=all_gather_fake)


class GroupCoordinator:
    """A torch ProcessGroup and what a layer needs from it: its rank, size and collectives.

    `device_group` carries the tensors (NCCL on CUDA, gloo on the CPU); `cpu_group` is always gloo,
    for small host-side exchanges. vLLM's device communicators (custom all-reduce, symmetric
    memory, ...) are left out: the collectives call torch.distributed directly, as vLLM's own
    fallback does."""

    def __init__(self, group_ranks: list[list[int]], local_rank: int, backend: str, group_name: str,
                 timeout: datetime.timedelta | None = None,
                 compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S):
        self.unique_name = _get_unique_name(group_name)
        self.compile_timeout = compile_timeout
        _groups[self.unique_name] = weakref.ref(self)
        self.rank, self.local_rank = dist.get_rank(), local_rank
        self.backend, self.timeout = backend, timeout
        self.device_group = self.cpu_group = None
        for ranks in group_ranks:  # every rank creates every group: new_group is collective
            device_group = dist.new_group(ranks, backend=backend, timeout=timeout)
            cpu_group = device_group if backend == "gloo" else dist.new_group(ranks, backend="gloo",
                                                                              timeout=timeout)
            if self.rank in ranks:
                self.ranks, self.world_size = ranks, len(ranks)
                self.rank_in_group = ranks.index(self.rank)
                self.device_group, self.cpu_group = device_group, cpu_group
        self.device = torch.device(f"cuda:{local_rank}" if backend == "nccl" else "cpu")

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """Out of place, through the custom op (a custom op may not both mutate and return). One
        rank: the input itself, and no op in the graph (vLLM's bypass)."""
        if self.world_size == 1:
            return input_
        return torch.ops.minivllm.all_reduce(input_, group_name=self.unique_name)

    def wait_for_compiling_peers(self) -> None:
        """Before the first collective after a compiled model's first call (every rank flagged
        it there, at the same point): wait up to `compile_timeout` for every peer to get here,
        naming the ranks that did not. A peer that died fails this at once."""
        global _peers_may_be_compiling
        if not _peers_may_be_compiling:
            return
        _peers_may_be_compiling = False
        try:
            dist.monitored_barrier(group=self.cpu_group, wait_all_ranks=True,
                                   timeout=datetime.timedelta(seconds=self.compile_timeout))
        except RuntimeError as e:
            raise RuntimeError(f"rank {self.rank}: a peer did not reach its first collective "
                               f"after compiling within {self.compile_timeout:g} s "
                               f"(compile_timeout): {e}") from e

    def _all_reduce_out_place(self, input_: torch.Tensor) -> torch.Tensor:
        self.wait_for_compiling_peers()
        out = input_.clone()
        dist.all_reduce(out, group=self.device_group)
        return out

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return input_
        dim = dim % input_.dim()
        return torch.ops.minivllm.all_gather(input_, dim, self.world_size,
                                             group_name=self.unique_name)

    def _all_gather_out_place(self, input_: torch.Tensor, dim: int) -> torch.Tensor:
        # concat-style into one tensor along dim 0, then moved to `dim` (vLLM's base communicator)
        self.wait_for_compiling_peers()
        size = input_.shape
        out = input_.new_empty((self.world_size * size[0], *size[1:]))
        _all_gather_single(out, input_.contiguous(), group=self.device_group)
        out = out.reshape(self.world_size, *size).movedim(0, dim)
        return out.reshape(*size[:dim], self.world_size * size[dim], *size[dim + 1:])

    def destroy(self) -> None:
        for group in {self.device_group, self.cpu_group} - {None}:
            dist.destroy_process_group(group)
        self.device_group = self.cpu_group = None
        _groups.pop(self.unique_name, None)


# torch 2.13 renamed all_gather_into_tensor (deprecated since); the range supported is 2.11-2.14
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_WORLD: GroupCoordinator | None = None
_TP: GroupCoordinator | None = None
_TP_DISABLED = False
_peers_may_be_compiling = False


def peers_may_be_compiling() -> None:
    """Every rank calls this where a TP model's first compiled call starts (it may load or
    compile): the next collective waits for the peers up to the compile timeout, not the usual
    one."""
    global _peers_may_be_compiling
    _peers_may_be_compiling = True


def get_world_group() -> GroupCoordinator:
    if _WORLD is None:
        raise RuntimeError("the distributed environment is not initialized: call "
                           "init_distributed_environment first (launch.run does)")
    return _WORLD


def get_tp_group() -> GroupCoordinator:
    if _TP is None:
        raise RuntimeError("the tensor-parallel group is not initialized: call "
                           "initialize_model_parallel first (launch.run does)")
    return _TP


def get_tensor_model_parallel_world_size() -> int:
    """The TP size; 1 in a process that never joined a TP group (vLLM asserts there)."""
    return 1 if _TP is None or _TP_DISABLED else _TP.world_size


def get_tensor_model_parallel_rank() -> int:
    return 0 if _TP is None or _TP_DISABLED else _TP.rank_in_group


@contextlib.contextmanager
def tensor_parallel_disabled() -> Iterator[None]:
    """Layers built inside see one rank of one: a whole, unsharded model inside a TP process (for
    a reference to compare against, or seeded weights to shard). vLLM's per-layer `disable_tp`,
    for every layer at once."""
    global _TP_DISABLED
    previous, _TP_DISABLED = _TP_DISABLED, True
    try:
        yield
    finally:
        _TP_DISABLED = previous


def _default_backend() -> str:
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def _tcp_store(method: str, world_size: int, rank: int, timeout: datetime.timedelta,
               master_listen_fd: int | None) -> dist.TCPStore:
    url = urlparse(method)
    if url.hostname is None or url.port is None:
        raise ValueError(f"distributed_init_method {method!r} must be tcp://<host>:<port>")
    try:
        return dist.TCPStore(url.hostname, url.port, world_size, is_master=rank == 0,
                             timeout=timeout,
                             master_listen_fd=master_listen_fd if rank == 0 else None)
    except (dist.DistNetworkError, RuntimeError) as e:
        if "address already in use" in str(e).lower() or "EADDRINUSE" in str(e):
            raise OSError(f"port {url.port} on {url.hostname} is already in use (another run, "
                          "or another program): pick a free port, or let the launcher pick "
                          "one") from None
        raise


def init_distributed_environment(world_size: int = -1, rank: int = -1,
                                 distributed_init_method: str = "env://", local_rank: int = -1,
                                 backend: str | None = None, timeout: float | None = None, *,
                                 compile_timeout: float | None = None,
                                 master_listen_fd: int | None = None) -> None:
    """Join the world: `world_size` processes rendezvous at `distributed_init_method`
    ("tcp://127.0.0.1:<port>", or "env://" under torchrun). `backend`: "gloo" (CPU tensors) or
    "nccl" (CUDA); by default NCCL where torch has CUDA, else gloo. `timeout` (seconds, default
    DEFAULT_TIMEOUT_S) bounds the rendezvous and every collective: a rank whose peer died or hangs
    raises instead of waiting forever. `compile_timeout` (seconds, default
    DEFAULT_COMPILE_TIMEOUT_S) bounds instead the first collective after a compiled model's first
    call, where a peer may still be compiling. `master_listen_fd`: a socket the launcher already
    bound to the port, handed to rank 0's store (so no other program can take the port in
    between)."""
    global _WORLD
    backend = backend or _default_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' (CPU) or 'nccl' (CUDA), got {backend!r}")
    td = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S if timeout is None else timeout)
    if local_rank == -1:
        env = distributed_init_method == "env://"
        local_rank = int(os.environ.get("LOCAL_RANK", rank)) if env else rank
    if not dist.is_initialized():
        host = (os.environ.get("MASTER_ADDR") if distributed_init_method == "env://"
                else urlparse(distributed_init_method).hostname)
        if backend == "gloo" and host in ("127.0.0.1", "localhost"):
            # gloo picks its interface from the host name, which may not be loopback
            os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
        store = None
        if distributed_init_method.startswith("tcp://"):
            store = _tcp_store(distributed_init_method, world_size, rank, td, master_listen_fd)
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend, init_method=None if store else distributed_init_method,
                                store=store, world_size=world_size, rank=rank, timeout=td)
        logger.debug("rank %d of %d joined (%s, %s)", rank, world_size, backend,
                     distributed_init_method)
    if _WORLD is None:
        _WORLD = GroupCoordinator([list(range(dist.get_world_size()))], local_rank, backend,
                                  "world", td, compile_timeout or DEFAULT_COMPILE_TIMEOUT_S)


def _loopback_interface() -> str:
    import socket

    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in ("lo", "lo0") if n in names), names[0] if names else "lo")


def initialize_model_parallel(tensor_model_parallel_size: int = 1,
                              backend: str | None = None) -> None:
    """The TP group. This project has tensor parallelism only, so the world is one TP group and
    its size must be the TP size (vLLM: world = TP x PP x DP x ...)."""
    global _TP
    world = get_world_group()
    if _TP is not None:
        raise RuntimeError("the tensor-parallel group is already initialized")
    if world.world_size != tensor_model_parallel_size:
        raise ValueError(f"the world has {world.world_size} ranks but tensor_model_parallel_size "
                         f"is {tensor_model_parallel_size} (--tp): start exactly --tp ranks, one "
                         "per shard")
    ranks = list(range(world.world_size))
    _TP = GroupCoordinator([ranks], world.local_rank, backend or world.backend, "tp", world.timeout,
                           world.compile_timeout)


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def destroy_model_parallel() -> None:
    global _TP
    if _TP is not None:
        _TP.destroy()
    _TP = None


def destroy_distributed_environment() -> None:
    global _WORLD
    destroy_model_parallel()
    if _WORLD is not None:
        _WORLD.destroy()
    _WORLD = None
    if dist.is_initialized():
        dist.destroy_process_group()
