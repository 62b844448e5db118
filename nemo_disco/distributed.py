"""Process-group setup from torchrun or srun environments (SPMD: one process per GPU or CPU slot)."""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    """Where this process stands in the job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int

    @property
    def is_main(self) -> bool:
        """Rank 0 writes logs, metrics and plots."""
        return self.rank == 0


def read_env() -> DistEnv:
    """Rank layout from torchrun (RANK, WORLD_SIZE, LOCAL_RANK, ...) or srun (SLURM_PROCID, SLURM_NTASKS, ...)."""
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local_rank = int(env.get("LOCAL_RANK", 0))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
        node_rank = int(env.get("GROUP_RANK", rank // max(local_world, 1)))
    elif "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        rank, world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
        local_rank = int(env.get("SLURM_LOCALID", 0))
        local_world = int(env.get("SLURM_NTASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "1")).split("(")[0])
        node_rank = int(env.get("SLURM_NODEID", 0))
    else:
        rank, world, local_rank, local_world, node_rank = 0, 1, 0, 1, 0
    return DistEnv(rank, world, local_rank, local_world, node_rank)


def init(timeout_minutes: int = 30) -> DistEnv:
    """Initialise the default process group (NCCL on GPU, gloo on CPU); a no-op for one process.

    Under srun without torchrun, MASTER_ADDR / MASTER_PORT must be exported by the launcher
    (slurm/train.sbatch does so from the first host of the allocation).
    """
    info = read_env()
    if torch.cuda.is_available():
        torch.cuda.set_device(info.local_rank % torch.cuda.device_count())
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


def world_size() -> int:
    """Processes in the default group (1 when not distributed)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    """This process's rank in the default group (0 when not distributed)."""
    return dist.get_rank() if dist.is_initialized() else 0


def all_gather_rows(t: torch.Tensor, group: object | None = None) -> torch.Tensor:
    """Concatenate equal-shaped [n, ...] tensors of every rank of ``group`` along dim 0 (rank order)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts, dim=0)


def broadcast_object(obj: object, src: int = 0) -> object:
    """Send a picklable object from ``src`` to every rank."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """Wait for every rank (no-op for one process)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_gather_object(obj: object, group: object | None = None) -> list:
    """Every rank's picklable ``obj`` of ``group``, in rank order (``[obj]`` when not distributed)."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, obj, group=group)
    return parts
