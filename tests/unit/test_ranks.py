"""The rank layout a launcher gave the process (``nemo_disco.ranks``), and that reading it loads no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from nemo_disco import distributed, ranks

ROOT = Path(__file__).resolve().parents[2]

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE")


@pytest.fixture
def no_launcher(monkeypatch):
    for name in (*LAUNCH_VARS, *SLURM_VARS, "SLURM_NODEID"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_no_launcher_is_one_process(no_launcher):
    assert ranks.read_env() == ranks.DistEnv(0, 1, 0, 1, 0)
    assert ranks.read_env().is_main


def test_torchrun_layout(no_launcher):
    for name, value in zip(LAUNCH_VARS, ("5", "8", "1", "4", "1"), strict=True):
        no_launcher.setenv(name, value)
    env = ranks.read_env()
    assert env == ranks.DistEnv(rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1)
    assert not env.is_main


def test_srun_layout_and_a_one_task_step_is_one_process(no_launcher):
    for name, value in zip(SLURM_VARS, ("3", "4", "1", "", "2(x2)"), strict=True):
        no_launcher.setenv(name, value)
    no_launcher.delenv("SLURM_NTASKS_PER_NODE")
    no_launcher.setenv("SLURM_NODEID", "1")
    assert ranks.read_env() == ranks.DistEnv(rank=3, world_size=4, local_rank=1, local_world_size=2, node_rank=1)
    no_launcher.setenv("SLURM_NTASKS", "1")
    assert ranks.read_env().world_size == 1


def test_distributed_reads_the_same_layout():
    assert distributed.read_env is ranks.read_env and distributed.DistEnv is ranks.DistEnv


def test_the_cli_reads_a_recipe_and_the_layout_without_loading_torch():
    """What ``nemo-disco train`` does before it sets OpenMP's environment (read once, when torch loads)."""
    code = (
        "import sys; from nemo_disco import cli, config, ranks; "
        "config.load('recipes/tiny-cpu.yaml', ['algorithm.async_rollouts=true', "
        "'cluster.generation_gpus_per_node=1']); ranks.read_env(); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
