"""Fault injection through slurm/train.sbatch on the two-node test cluster (srun, 2 nodes x 1 gloo rank).

Faults (tests/faults/inject/faults.py, a hook of nemo_disco.hooks) fire on rank 1, the rank of the second node, at
step 3 of a 4-step run that saves every 2 steps (``cluster.step_timeout_s=15``: phase limit max(15 s, 2 x the
slowest step), silence limit 5 s):

- a hang: both ranks write their stacks and exit 4, the script requeues the job, the requeued job (restart 1)
  resumes from step_2 and ends with the uninterrupted run's metrics; with ``NEMO_DISCO_MAX_REQUEUES=1`` a hang
  that comes back before a new checkpoint is not requeued again (the job fails with exit code 4);
- SIGKILL (a dead rank) and SIGSTOP (a frozen rank: a lost node keeps its sockets open and answers nothing): rank 0
  names rank 1 with its host and exits 5 within the bound; the job fails; resubmitting the same command resumes
  from step_2 to the uninterrupted run's metrics.

Measured figures (docs/reliability.md) are printed with ``-s``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from procs import FAST_TINY, THREADS

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "faults"))
from faultlib import INJECTOR, comparable, fault_time, message, metrics  # noqa: E402

from nemo_disco import watchdog  # noqa: E402

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "slurm" / "train.sbatch"
RECIPE = ROOT / "recipes" / "tiny-cpu.yaml"
TINY = [*FAST_TINY, "algorithm.steps=4", "checkpoint.save_every=2", "cluster.step_timeout_s=15", "cluster.nodes=2"]
SILENCE_S = watchdog.silence_limit(15)
BEAT_S = SILENCE_S / watchdog.BEATS_PER_SILENCE


def _submit(cluster, job_dir: Path, run_dir: Path, **env: str) -> tuple[int, Path]:
    log = job_dir / "logs" / "train-%j.out"
    args = [f"--output={log}", "--nodes=2", str(TRAIN), str(RECIPE), f"logging.run_dir={run_dir}", *TINY]
    job = cluster.sbatch(args, cwd=job_dir, env={**THREADS, **INJECTOR, **env})
    return job, job_dir / "logs" / f"train-{job}.out"


@pytest.fixture(scope="module")
def reference(slurm_cluster, tmp_path_factory) -> list[dict]:
    job_dir = tmp_path_factory.mktemp("faults_reference")
    (job_dir / "logs").mkdir()
    job, log = _submit(slurm_cluster, job_dir, job_dir / "run")
    info = slurm_cluster.wait_job(job, timeout=400, log=log)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), slurm_cluster.tail(log)
    return comparable(metrics(job_dir / "run"))


def test_a_hang_is_requeued_and_the_requeued_job_resumes(slurm_cluster, job_dir, reference):
    run = job_dir / "run"
    once = str(job_dir / "fault-fired")  # the requeued job runs clean
    job, log = _submit(slurm_cluster, job_dir, run, NEMO_DISCO_FAULT="hang@1:3", NEMO_DISCO_FAULT_ONCE=once)
    info = slurm_cluster.wait_job(job, timeout=600, log=log)
    out = log.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), out[-4000:]
    n1, n2 = slurm_cluster.nodes
    # Both ranks, on their own hosts, report the hang and write their stacks.
    for rank, host in ((0, n1), (1, n2)):
        assert re.search(rf"rank {rank} \({host}, pid \d+\): (stopping: rank \d reported: )?step 3 has run", out)
    assert out.count("Python stacks follow") == 2
    detection = min(message(out, r)[0] for r in (0, 1)) - fault_time(out)
    print(f"\nmeasured: srun hang: detected {detection:.1f} s after the fault")
    assert "training processes exited with 4" in out
    assert "hang: requeue 1 of at most 3 without a new checkpoint" in out
    assert f"requeueing job {job} (restart 1)" in out and f"job {job} restart 1:" in out
    assert f"resumed from {run}/checkpoints/step_2 (step 2)" in out
    assert comparable(metrics(run)) == reference


def test_a_hang_that_comes_back_before_a_new_checkpoint_is_not_requeued_past_the_limit(slurm_cluster, job_dir):
    run = job_dir / "run"
    job, log = _submit(slurm_cluster, job_dir, run, NEMO_DISCO_FAULT="hang@1:3", NEMO_DISCO_MAX_REQUEUES="1")
    info = slurm_cluster.wait_job(job, timeout=600, log=log)
    out = log.read_text()
    # Hang at step 3 -> requeue 1; resumed from step_2, hangs again at step 3 with no new checkpoint -> stop.
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", "4:0", "1"), out[-4000:]
    assert "hang: requeue 1 of at most 1 without a new checkpoint" in out
    assert (
        "hang: not requeued: 1 requeue(s) after hangs without a new checkpoint (newest step 2; "
        "NEMO_DISCO_MAX_REQUEUES=1)" in out
    )
    assert (run / f".hang-requeues-{job}").read_text().split() == ["1", "2"]


@pytest.mark.parametrize(
    ("fault", "bound_s"),
    [
        # The survivor's collective fails at once (TCP reset); 3 heartbeats + 1 s show the victim silent.
        ("kill@1:3", 3 * BEAT_S + 1.0 + 3.0),
        # Frozen (as a lost node: no reset, no answer): the silence limit.
        ("stop@1:3", SILENCE_S + BEAT_S + 3.0),
    ],
    ids=["sigkill", "sigstop"],
)
def test_a_dead_or_frozen_rank_on_the_other_node_is_named_and_a_resubmission_resumes(
    slurm_cluster, job_dir, reference, fault, bound_s
):
    run = job_dir / "run"
    job, log = _submit(slurm_cluster, job_dir, run, NEMO_DISCO_FAULT=fault)
    info = slurm_cluster.wait_job(job, timeout=600, log=log)
    out = log.read_text()
    # srun reports the SIGKILLed task (137 = 128 + 9; a frozen one is killed 60 s after the survivor exits).
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "137:0"), out[-4000:]
    n1, n2 = slurm_cluster.nodes
    when, text = message(out, 0)
    assert re.match(rf"rank 1 \({n2}, pid \d+\) sent no heartbeat for \d+\.\d s.*: it died", text), text
    assert "exiting with code 5" in text
    detection = when - fault_time(out)
    print(f"\nmeasured: srun {fault}: rank 0 on {n1} stopped {detection:.1f} s after the fault: {text}")
    assert detection <= bound_s, detection
    assert f"{n2}: task 1: Killed" in out
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2"]
    # The same command again (no fault): resumes from step_2 to the uninterrupted run's metrics.
    job, log = _submit(slurm_cluster, job_dir, run)
    info = slurm_cluster.wait_job(job, timeout=400, log=log)
    out = log.read_text()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), out[-4000:]
    assert f"resumed from {run}/checkpoints/step_2 (step 2)" in out
    assert comparable(metrics(run)) == reference
