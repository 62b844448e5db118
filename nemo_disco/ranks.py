"""Where this process stands in a launched job (torchrun or srun), read from the environment without torch.

The CLI decides how a run on one machine shares its cores before torch, and with it the OpenMP runtime, loads
(OpenMP reads ``OMP_NUM_THREADS`` and ``OMP_WAIT_POLICY`` once, when the library loads): that decision needs the
rank layout, so the layout lives here and not in ``distributed.py``, which imports torch. ``distributed``
re-exports both names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


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


def launched() -> bool:
    """Whether a launcher started this process: torchrun (RANK and WORLD_SIZE, even for one process) or srun tasks.

    A single srun task counts as no launcher: nothing else of the job is waiting for it.
    """
    return ("RANK" in os.environ and "WORLD_SIZE" in os.environ) or read_env().world_size > 1
