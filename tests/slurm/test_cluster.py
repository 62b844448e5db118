"""The test cluster itself: two nodes with their own host names, and a gloo collective across them via srun.

If this fails, the harness (tests/slurm/conftest.py) is broken, not the sbatch scripts.
"""

from __future__ import annotations

import sys

import pytest

pytestmark = pytest.mark.slurm

PROBE = """\
import os, socket, torch, torch.distributed as dist
rank, world = int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"])
dist.init_process_group("gloo", rank=rank, world_size=world)
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
print(f"rank={rank} host={socket.gethostname()} node={os.environ['SLURMD_NODENAME']} sum={t.item():g}", flush=True)
dist.destroy_process_group()
"""

BATCH = """\
#!/bin/bash
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
srun --ntasks-per-node=1 {python} probe.py
"""


def test_two_nodes_distinct_hostnames_and_gloo_all_reduce(slurm_cluster, job_dir):
    (job_dir / "probe.py").write_text(PROBE)
    (job_dir / "probe.sbatch").write_text(BATCH.format(python=sys.executable))
    log = job_dir / "logs" / "probe.out"
    job = slurm_cluster.sbatch(["--nodes=2", f"--output={log}", "probe.sbatch"], cwd=job_dir)
    info = slurm_cluster.wait_job(job, timeout=120, log=log)
    assert info["JobState"] == "COMPLETED", slurm_cluster.tail(log)
    lines = sorted(line for line in log.read_text().splitlines() if line.startswith("rank="))
    # 1 + 2 = 3 on both ranks; each task runs on its own node and `hostname` answers the node's name.
    assert lines == [
        f"rank=0 host={slurm_cluster.nodes[0]} node={slurm_cluster.nodes[0]} sum=3",
        f"rank=1 host={slurm_cluster.nodes[1]} node={slurm_cluster.nodes[1]} sum=3",
    ]
