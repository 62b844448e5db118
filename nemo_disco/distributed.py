"""Process groups and every collective of the package (SPMD: one process per GPU or CPU slot).

No other module imports ``torch.distributed`` (``tests/unit/test_distributed.py`` enforces it). The reason is
a rule that CPU tests cannot see: an NCCL group only takes tensors on its CUDA device, and a host tensor
in an NCCL collective raises at the first multi-GPU step. Every helper here therefore hands the backend a
tensor on the group's communication device (:func:`comm_device`) and gives the result back on the device
the caller's tensor lives on; the in-place ones (:func:`all_reduce`, :func:`broadcast`) write back into the
caller's tensor. Callers pass host or device tensors alike and never think about the backend.

Groups: the default group is NCCL on CUDA machines and gloo on CPU ones; Megatron's model- and data-parallel
groups follow the default backend. Object collectives (:func:`all_gather_object`, :func:`broadcast_object`)
pickle through the group's device, which for NCCL is this process's GPU (selected by :func:`init`).

GPU selection (:func:`cuda_device_index`): a node runs ``LOCAL_WORLD_SIZE`` processes. When each sees every
GPU of the node, process ``LOCAL_RANK`` takes GPU ``LOCAL_RANK``; when the launcher binds one GPU per task
(``srun --gpus-per-task=1``: each process sees exactly one), every process takes GPU 0 of its own view. Any
other count is an error at start-up, not a silent ``LOCAL_RANK % count`` that would stack processes on one
GPU. The trainer (Megatron) and the vLLM engine use the same index (:func:`vllm_device_env`).

Liveness (:func:`store_client`): the watchdog (``nemo_disco/watchdog.py``) exchanges heartbeats and stop notices
through the job's rendezvous key-value store on a connection of its own, so they flow while the collectives are
blocked on a dead or hung rank.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from nemo_disco.ranks import DistEnv, read_env  # noqa: F401  (re-exported: the package reads the layout here)

#: A process group (None: the default group). Other modules annotate with this instead of importing
#: ``torch.distributed``.
Group = Any

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


# ----------------------------------------------------------------------------------------------------------------------
# Devices


def select_cuda_device(local_rank: int, local_world_size: int, device_count: int) -> int:
    """The CUDA device index this process uses (see the module docstring).

    Raises:
        RuntimeError: no GPU is visible, or fewer GPUs than processes on this node (and more than one).
    """
    if device_count < 1:
        raise RuntimeError("no CUDA device is visible to this process (CUDA_VISIBLE_DEVICES?)")
    if device_count >= local_world_size:
        return local_rank
    if device_count == 1:  # one GPU bound to each task
        return 0
    raise RuntimeError(
        f"{local_world_size} processes on this node but {device_count} visible GPUs: each process needs a GPU of "
        f"its own (all GPUs visible to every process, or exactly one per process: srun --gpus-per-task=1); "
        f"check CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r} and the tasks per node"
    )


def cuda_device_index() -> int:
    """This process's CUDA device index (requires CUDA)."""
    info = read_env()
    return select_cuda_device(info.local_rank, info.local_world_size, torch.cuda.device_count())


@contextlib.contextmanager
def vllm_device_env() -> Iterator[None]:
    """While a vLLM engine is built: ``LOCAL_RANK`` names the same GPU the trainer uses.

    vLLM's external launcher puts its worker on ``cuda:$LOCAL_RANK``; with one GPU bound per task that index
    is 0 whatever the task's local rank. Restored afterwards (the rank layout keeps reading the launcher's).
    """
    if not torch.cuda.is_available():
        yield
        return
    before = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(cuda_device_index())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = before


def backend_devices(group: Group = None) -> dict[str, str]:
    """Device type -> backend of ``group`` ("cuda" -> "nccl" for an NCCL group; "cpu" and "cuda" -> "gloo")."""
    config = str(dist.get_backend_config(group))
    if ":" not in config:  # a bare backend name
        return {"cuda": config} if config == "nccl" else {"cpu": config, "cuda": config}
    return dict(part.split(":", 1) for part in config.split(","))


def comm_device_for(backends: dict[str, str], device: torch.device, cuda_index: int | None) -> torch.device:
    """Where a tensor on ``device`` must travel for a group with ``backends`` (pure; see :func:`comm_device`).

    Raises:
        RuntimeError: the group has no backend for the tensor's device nor for CUDA.
    """
    if device.type in backends:
        return device
    if "cuda" in backends and cuda_index is not None:
        return torch.device("cuda", cuda_index)
    if "cpu" in backends:
        return torch.device("cpu")
    raise RuntimeError(f"process group with backends {backends} cannot communicate a tensor on {device}")


def comm_device(group: Group = None, device: torch.device | str = "cpu") -> torch.device:
    """The device a tensor on ``device`` must be on for ``group``'s backend (CUDA for NCCL, as is for gloo)."""
    cuda_index = torch.cuda.current_device() if torch.cuda.is_available() else None
    return comm_device_for(backend_devices(group), torch.device(device), cuda_index)


def _on_comm(t: torch.Tensor, group: Group) -> torch.Tensor:
    """``t`` itself when the backend takes it, else a contiguous copy on the group's device."""
    dev = comm_device(group, t.device)
    return t.contiguous() if dev == t.device else t.to(dev).contiguous()


# ----------------------------------------------------------------------------------------------------------------------
# Process groups


def init(timeout_minutes: int = 30) -> DistEnv:
    """Select this process's GPU and initialise the default group (NCCL on GPU, gloo on CPU).

    A single process without a launcher gets no group (see :func:`init_single_process`). Under srun without
    torchrun, MASTER_ADDR / MASTER_PORT must be exported by the launcher (slurm/train.sbatch does so from the
    first host of the allocation).

    Raises:
        RuntimeError: the GPUs visible on this node do not fit its processes (see :func:`select_cuda_device`).
    """
    info = read_env()
    if torch.cuda.is_available():
        torch.cuda.set_device(cuda_device_index())
    if info.world_size > 1 and not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(
            backend=backend,
            rank=info.rank,
            world_size=info.world_size,
            timeout=datetime.timedelta(minutes=timeout_minutes),
        )
    return info


def init_single_process(timeout_minutes: int = 30) -> None:
    """A one-rank default group for code that needs one (Megatron) when no launcher started a job."""
    if dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(cuda_device_index())
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend, store=dist.HashStore(), rank=0, world_size=1, timeout=datetime.timedelta(minutes=timeout_minutes)
    )


def store_client(timeout_s: float) -> Any | None:
    """A new client connection to the job's rendezvous store (``MASTER_ADDR:MASTER_PORT``); None for one process.

    Under torchrun the store is served by the launcher's agent (it outlives every worker); under srun by rank 0's
    process. Each call opens its own connection, so a thread can use it while another thread is in a collective.

    Args:
        timeout_s: how long one store operation may wait before it raises.
    """
    if not dist.is_initialized() or read_env().world_size == 1:
        return None
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    return dist.TCPStore(
        addr, int(port), is_master=False, wait_for_workers=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


# ----------------------------------------------------------------------------------------------------------------------
# Asynchronous rollouts: a trainer and a generator in one job


def _job_store(info: DistEnv, timeout: datetime.timedelta) -> Any:
    """The job's rendezvous store, as ``init_process_group("env://")`` reaches it.

    Served by torchrun's agent (``TORCHELASTIC_USE_AGENT_STORE``) or, without one (srun, a spawned generator),
    by launch rank 0.
    """
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        info.world_size,
        is_master=info.rank == 0 and not agent,
        timeout=timeout,
        wait_for_workers=False,
    )


def init_roles(trainer_world: int, generator_world: int, timeout_minutes: int = 30) -> tuple[str, DistEnv, Link]:
    """Split the launched job into the trainer (ranks ``0 .. trainer_world - 1``) and the generator (the rest).

    Each role gets a default group of its own (Megatron, the engines and every collective of the package see
    their role only, exactly as in a job of that size); the two meet through the :class:`Link`. The watchdog
    keeps the launched ranks (:func:`read_env`): one ring over both roles.

    Returns:
        The role ("trainer" or "generator"), this process's place in its role, and the link.

    Raises:
        RuntimeError: the launcher started a different number of processes.
    """
    info = read_env()
    if info.world_size != trainer_world + generator_world:
        raise RuntimeError(
            f"the launcher started {info.world_size} process(es) but the recipe expects {trainer_world} for the "
            f"trainer + {generator_world} for the generator (cluster.* with algorithm.async_rollouts=true)"
        )
    if torch.cuda.is_available():
        torch.cuda.set_device(cuda_device_index())
    timeout = datetime.timedelta(minutes=timeout_minutes)
    store = dist.PrefixStore(
        f"nemo_disco/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", _job_store(info, timeout)
    )
    role = "trainer" if info.rank < trainer_world else "generator"
    role_rank = info.rank if role == "trainer" else info.rank - trainer_world
    role_world = trainer_world if role == "trainer" else generator_world
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if torch.cuda.is_available() else "gloo",
            store=dist.PrefixStore(f"{role}/", store),
            rank=role_rank,
            world_size=role_world,
            timeout=timeout,
        )
    env = DistEnv(role_rank, role_world, info.local_rank, info.local_world_size, info.node_rank)
    global _ROLE_ENV, _LINK
    _ROLE_ENV = env
    _LINK = Link(store, role, role_rank, generator_world, timeout)
    return role, env, _LINK


#: This process's place in its role after :func:`init_roles` (None: the job is one role).
_ROLE_ENV: DistEnv | None = None
#: The link :func:`init_roles` made (closed by :func:`shutdown`).
_LINK: Link | None = None


def has_roles() -> bool:
    """Whether :func:`init_roles` split this job into a trainer and a generator."""
    return _ROLE_ENV is not None


def role_env() -> DistEnv:
    """This process's place in the default group: its role's after :func:`init_roles`, else the launched job's."""
    return _ROLE_ENV if _ROLE_ENV is not None else read_env()


class Link:
    """The trainer's rank 0 and the generator's ranks: rollouts go up, weights and orders go down.

    Two groups of their own, outside either role's default group: ``up`` (generator rank 0 -> trainer rank 0,
    objects) and ``down`` (trainer rank 0 -> every generator rank; objects over gloo, weight buffers over NCCL
    between their GPUs on CUDA machines, over gloo on CPU). Each direction keeps its own order, so a generator
    that sends rollouts from a thread of its own can take new weights meanwhile. Other trainer ranks are not
    members (their calls raise).
    """

    def __init__(self, store: Any, role: str, role_rank: int, generator_world: int, timeout: datetime.timedelta):
        """Connect this process's directions (blocks until the other side connects)."""
        self.role = role
        self.down_member = role == "generator" or role_rank == 0
        self.up_member = role_rank == 0
        self._down = self._down_cuda = self._up = None
        if self.down_member:
            down_rank = 0 if role == "trainer" else 1 + role_rank
            down_store = dist.PrefixStore("link/down/", store)
            self._down = dist.ProcessGroupGloo(down_store, down_rank, generator_world + 1, timeout)
            if torch.cuda.is_available():  # NCCL between the GPUs of trainer rank 0 and the generator (untested here)
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timeout
                cuda_store = dist.PrefixStore("link/down-cuda/", store)
                self._down_cuda = dist.ProcessGroupNCCL(cuda_store, down_rank, generator_world + 1, opts)
        if self.up_member:
            up_store = dist.PrefixStore("link/up/", store)
            self._up = dist.ProcessGroupGloo(up_store, 0 if role == "generator" else 1, 2, timeout)

    @property
    def weights_device(self) -> torch.device:
        """Where weight buffers travel down (this process's GPU with NCCL, else the host)."""
        return torch.device("cuda", torch.cuda.current_device()) if self._down_cuda is not None else torch.device("cpu")

    def send_up(self, obj: object) -> None:
        """Generator rank 0: send a picklable object to trainer rank 0 (blocks until it is received)."""
        _broadcast_object_pg(self._require(self._up, "up"), obj, 0)

    def recv_up(self) -> Any:
        """Trainer rank 0: the generator's next object."""
        return _broadcast_object_pg(self._require(self._up, "up"), None, 0)

    def send_down(self, obj: object) -> None:
        """Trainer rank 0: send a picklable object to every generator rank."""
        _broadcast_object_pg(self._require(self._down, "down"), obj, 0)

    def recv_down(self) -> Any:
        """A generator rank: trainer rank 0's next object."""
        return _broadcast_object_pg(self._require(self._down, "down"), None, 0)

    def buffer_down(self, buf: torch.Tensor) -> torch.Tensor:
        """Broadcast a flat buffer on :attr:`weights_device` from trainer rank 0 (in place) and return it."""
        pg = self._down_cuda if self._down_cuda is not None else self._require(self._down, "down")
        if buf.device != self.weights_device:
            raise RuntimeError(
                f"Link.buffer_down: the buffer is on {buf.device}, the link sends on {self.weights_device}"
            )
        pg.broadcast([buf], _root(0)).wait()
        return buf

    def close(self) -> None:
        """Shut down this process's directions (they are not in torch's registry: :func:`shutdown` calls this)."""
        for pg in (self._up, self._down, self._down_cuda):
            if pg is not None:
                pg.shutdown()
        self._down = self._down_cuda = self._up = None
        self.down_member = self.up_member = False

    def _require(self, pg: Any, name: str) -> Any:
        if pg is None:
            raise RuntimeError(f"this process ({self.role}) is not a member of the link's {name} direction")
        return pg


def _root(rank: int) -> Any:
    opts = dist.BroadcastOptions()
    opts.rootRank = rank
    return opts


def _broadcast_object_pg(pg: Any, obj: object, root: int) -> Any:
    """Pickle ``obj`` on ``root`` and hand it to every member of a standalone gloo group (host tensors)."""
    import pickle

    if pg.rank() == root:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    pg.broadcast([size], _root(root)).wait()
    if pg.rank() != root:
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
    pg.broadcast([payload], _root(root)).wait()
    return obj if pg.rank() == root else pickle.loads(payload.numpy().tobytes())


def new_gloo_group(timeout_minutes: int) -> Any:
    """A gloo group over every process of the default group (host-side coordination with its own timeout)."""
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=timeout_minutes))


def shutdown() -> None:
    """Destroy every process group of this process (Megatron's, vLLM's, the link's, the default one), if any.

    Call it once a process is done with its collectives, before the interpreter exits. A gloo group that is still
    alive at exit is torn down during the interpreter's finalisation, and its worker threads can then end the
    process with ``std::terminate`` ("terminate called without an active exception", SIGABRT): a job that
    succeeded would exit -6. NCCL warns about the same omission. Megatron's ``parallel_state`` is reset first
    when it was imported, so it holds no destroyed groups.
    """
    global _LINK, _ROLE_ENV
    if _LINK is not None:
        _LINK.close()
        _LINK = _ROLE_ENV = None
    if not dist.is_initialized():
        return
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    dist.destroy_process_group()


def is_initialized() -> bool:
    """Whether a default process group exists."""
    return dist.is_initialized()


def world_size(group: Group = None) -> int:
    """Processes in ``group`` (1 when not distributed)."""
    return dist.get_world_size(group) if dist.is_initialized() else 1


def rank(group: Group = None) -> int:
    """This process's rank in ``group`` (0 when not distributed)."""
    return dist.get_rank(group) if dist.is_initialized() else 0


def global_rank(group: Group, group_rank: int) -> int:
    """The default-group rank of ``group``'s rank ``group_rank``."""
    return dist.get_global_rank(group, group_rank) if dist.is_initialized() else group_rank


def _single(group: Group) -> bool:
    """No process group: nothing to communicate.

    A one-rank group still runs its collectives (cheap), so single-GPU runs exercise its backend's device rule.
    """
    return not dist.is_initialized()


# ----------------------------------------------------------------------------------------------------------------------
# Collectives (host or device tensors; see the module docstring)


def all_reduce(t: torch.Tensor, op: Literal["sum", "max", "min"] = "sum", group: Group = None) -> torch.Tensor:
    """Reduce ``t`` over ``group`` in place (on every rank) and return it."""
    if _single(group):
        return t
    buf = _on_comm(t, group)
    dist.all_reduce(buf, op=_OPS[op], group=group)
    if buf is not t:
        t.copy_(buf)
    return t


def broadcast(t: torch.Tensor, src: int, group: Group = None) -> torch.Tensor:
    """Overwrite ``t`` with the tensor of global rank ``src`` (in place on every rank of ``group``) and return it."""
    if _single(group):
        return t
    buf = _on_comm(t, group)
    dist.broadcast(buf, src=src, group=group)
    if buf is not t:
        t.copy_(buf)
    return t


def all_gather(t: torch.Tensor, group: Group = None) -> list[torch.Tensor]:
    """Every rank's equal-shaped ``t`` in rank order (tensors on ``t``'s device)."""
    if _single(group):
        return [t]
    buf = _on_comm(t, group)
    parts = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, buf, group=group)
    return [p if p.device == t.device else p.to(t.device) for p in parts]


def all_gather_rows(t: torch.Tensor, group: Group = None) -> torch.Tensor:
    """Concatenate equal-shaped [n, ...] tensors of every rank of ``group`` along dim 0 (rank order)."""
    if _single(group):
        return t
    return torch.cat(all_gather(t, group), dim=0)


def any_rank(flag: bool, group: Group = None) -> bool:
    """Whether ``flag`` is true on any rank of ``group``."""
    return bool(all_reduce(torch.tensor([1.0 if flag else 0.0]), "max", group).item() > 0)


def max_int(value: int, group: Group = None) -> int:
    """The largest ``value`` over the ranks of ``group``."""
    return int(all_reduce(torch.tensor([int(value)], dtype=torch.int64), "max", group).item())


def sum_floats(values: Sequence[float], group: Group = None) -> list[float]:
    """Element-wise sums of ``values`` over the ranks of ``group`` (float64)."""
    t = torch.tensor([float(v) for v in values], dtype=torch.float64)
    return [float(x) for x in all_reduce(t, "sum", group)]


def all_gather_object(obj: object, group: Group = None) -> list:
    """Every rank's picklable ``obj`` in rank order."""
    if _single(group):
        return [obj]
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, obj, group=group)
    return parts


def broadcast_object(obj: object, src: int = 0, group: Group = None) -> object:
    """Send a picklable object from global rank ``src`` to every rank of ``group``."""
    if _single(group):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def barrier(group: Group = None) -> None:
    """Wait for every rank of ``group`` (no-op for one process)."""
    if not _single(group):
        dist.barrier(group=group)
