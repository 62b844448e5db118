"""slurm/train.sbatch submitted with the real sbatch to the two-node test cluster.

- the dry run on a real allocation names the allocation's hosts; a layout that disagrees with the recipe fails
  the job with exit code 2 before anything starts;
- the tiny recipe across 2 nodes x 1 process (gloo) completes, and its metrics equal a torchrun run of the same
  recipe, seed and world size on one node (every non-timing key, exactly: same ranks, same data shards, same
  CPU kernels, so no float may differ);
- ``scancel --signal=USR1 --batch`` mid-run makes the trainer checkpoint and exit 3, the script requeue the job,
  and the requeued job (restart 1) resume from that checkpoint and finish with the uninterrupted run's metrics;
- asynchronous rollouts with the generator on a node of its own: the dry run puts the trainer on the first node
  and the generator on the second, a job one node short fails with exit code 2 naming cluster.generation_nodes,
  and the tiny recipe trains on the two nodes with rollouts one step stale.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import FAST_TINY, THREADS, free_port

pytestmark = pytest.mark.slurm

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "slurm" / "train.sbatch"
RECIPE = ROOT / "recipes" / "tiny-cpu.yaml"
# Enough steps that the signal (sent once step 1 is logged) lands mid-run even on a loaded machine, where
# scancel -> batch shell -> srun -> trainer can take longer than a tiny step (~1.5 s).
STEPS = 8
# Small and fast: 8 questions x 4 rollouts per step, 2 updates per step, short warm-up, no validation; a checkpoint
# only at the end (and on a signal).
TINY = [*FAST_TINY, f"algorithm.steps={STEPS}", "checkpoint.save_every=0", "checkpoint.keep_last=3"]
# Asynchronous rollouts on the two nodes: the trainer's one process on the first, the generator's on the second.
ASYNC_STEPS = 4
ASYNC = [
    "cluster.nodes=1",
    "cluster.gpus_per_node=1",
    "algorithm.async_rollouts=true",
    "cluster.generation_nodes=1",
]


def _trainer_missing() -> str | None:
    try:
        importlib.import_module("nemo_disco.algorithm")
    except ImportError as err:
        return f"trainer not available (nemo_disco.algorithm does not import: {err})"
    return None


requires_trainer = pytest.mark.skipif(_trainer_missing() is not None, reason=_trainer_missing() or "")


def _submit(cluster, job_dir: Path, sbatch_args: list[str], args: list[str], **env: str) -> tuple[int, Path]:
    log = job_dir / "logs" / "train-%j.out"
    job = cluster.sbatch([f"--output={log}", *sbatch_args, str(TRAIN), str(RECIPE), *args], cwd=job_dir, env=env)
    return job, job_dir / "logs" / f"train-{job}.out"


def _metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _comparable(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in records]


def test_dry_run_on_the_allocation_lists_its_hosts(slurm_cluster, job_dir):
    job, log = _submit(slurm_cluster, job_dir, ["--nodes=2"], ["cluster.nodes=2"], NEMO_DISCO_DRY_RUN="1")
    info = slurm_cluster.wait_job(job, timeout=60, log=log)
    assert info["JobState"] == "COMPLETED", slurm_cluster.tail(log)
    out = log.read_text()
    n1, n2 = slurm_cluster.nodes
    assert f"rendezvous: MASTER_ADDR={n1} " in out
    assert f"node 0 {n1}: ranks 0-0" in out and f"node 1 {n2}: ranks 1-1" in out
    assert "layout: 2 node(s) x 1 process(es) = world 2 (CPU, gloo)" in out
    assert "dry run: nothing started" in out


def test_layout_mismatch_fails_the_job_before_launch(slurm_cluster, job_dir):
    # 2 nodes allocated, the recipe says cluster.nodes=1.
    job, log = _submit(slurm_cluster, job_dir, ["--nodes=2"], [])
    info = slurm_cluster.wait_job(job, timeout=60, log=log)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), slurm_cluster.tail(log)
    out = log.read_text()
    assert "train.sbatch: error: the job has 2 node(s) (SLURM_NNODES) but the recipe has cluster.nodes=1" in out
    assert "command:" not in out


@pytest.fixture(scope="module")
def two_node_run(slurm_cluster, tmp_path_factory) -> tuple[Path, dict[str, str], str]:
    """The tiny recipe for STEPS steps on 2 nodes x 1 process, uninterrupted: (run_dir, job fields, log text)."""
    reason = _trainer_missing()
    if reason:
        pytest.skip(reason)
    job_dir = tmp_path_factory.mktemp("two_node")
    (job_dir / "logs").mkdir()
    run_dir = job_dir / "run"
    job, log = _submit(
        slurm_cluster, job_dir, ["--nodes=2"], ["cluster.nodes=2", f"logging.run_dir={run_dir}", *TINY], **THREADS
    )
    info = slurm_cluster.wait_job(job, timeout=300, log=log)
    return run_dir, info, log.read_text()


@requires_trainer
def test_two_nodes_complete_and_match_torchrun_on_one_node(two_node_run, tmp_path):
    run_dir, info, out = two_node_run
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), out[-3000:]
    assert "layout: 2 node(s) x 1 process(es) = world 2 (CPU, gloo)" in out
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))

    # The same recipe, seed and world size 2 under torchrun on this machine (one node, two processes).
    port = free_port()
    ref = tmp_path / "torchrun"
    torchrun = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node=2", f"--master-port={port}"]
    cmd = [*torchrun, "-m", "nemo_disco.cli", "train", "--config", str(RECIPE), f"logging.run_dir={ref}", *TINY]
    cmd += ["cluster.gpus_per_node=2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    done = subprocess.run(cmd, cwd=ROOT, env={**env, **THREADS}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert _comparable(records) == _comparable(_metrics(ref))


@requires_trainer
def test_usr1_checkpoints_requeues_and_resumes_to_the_same_metrics(slurm_cluster, two_node_run, job_dir):
    reference_dir, reference_info, _ = two_node_run
    assert reference_info["JobState"] == "COMPLETED"
    run_dir = job_dir / "run"
    job, log = _submit(
        slurm_cluster, job_dir, ["--nodes=2"], ["cluster.nodes=2", f"logging.run_dir={run_dir}", *TINY], **THREADS
    )
    # Signal as soon as the first step is logged: the trainer's handlers are installed and steps remain.
    deadline = time.monotonic() + 240
    while not ((run_dir / "metrics.jsonl").is_file() and _metrics(run_dir)):
        assert time.monotonic() < deadline, slurm_cluster.tail(log)
        assert slurm_cluster.job(job)["JobState"] in {"PENDING", "CONFIGURING", "RUNNING"}, slurm_cluster.tail(log)
        time.sleep(0.2)
    slurm_cluster.run(["scancel", "--signal=USR1", "--batch", str(job)])

    info = slurm_cluster.wait_job(job, timeout=300, log=log)
    out = log.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), out[-3000:]
    # The first run: signal forwarded, trainer exit 3, requeue; the second run is restart 1 (SLURM_RESTART_COUNT).
    assert "SIGUSR1: forwarding to the training processes" in out
    assert "training processes exited with 3 after SIGUSR1" in out
    assert f"requeueing job {job} (restart 1)" in out
    assert f"job {job} restart 1:" in out
    # It stopped mid-run: a checkpoint before the last step, then the final one.
    saved = sorted(int(p.name.split("_")[1]) for p in (run_dir / "checkpoints").glob("step_*"))
    assert len(saved) == 2 and 1 <= saved[0] < STEPS and saved[1] == STEPS, saved
    assert f"resumed from {run_dir}/checkpoints/step_{saved[0]} (step {saved[0]})" in out
    # Resumed, not restarted: every step logged once, and the same numbers as the uninterrupted run.
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert _comparable(records) == _comparable(_metrics(reference_dir))


def test_async_dry_run_puts_the_generator_on_the_second_node(slurm_cluster, job_dir):
    job, log = _submit(slurm_cluster, job_dir, ["--nodes=2"], ASYNC, NEMO_DISCO_DRY_RUN="1")
    info = slurm_cluster.wait_job(job, timeout=60, log=log)
    assert info["JobState"] == "COMPLETED", slurm_cluster.tail(log)
    out = log.read_text()
    n1, n2 = slurm_cluster.nodes
    assert (
        "layout: 2 node(s) x 1 process(es) = world 2 (CPU, gloo): trainer ranks 0-0, generator ranks 1-1 "
        "(async rollouts, max_staleness 1); policy hf TP 1 x PP 1 x DP 1; generator hf TP 1 (1 engine(s))"
    ) in out
    assert f"node 0 {n1}: ranks 0-0 (trainer) (LOCAL_RANK 0-0)" in out
    assert f"node 1 {n2}: ranks 1-1 (generator) (LOCAL_RANK 0-0)" in out
    assert f"rendezvous: MASTER_ADDR={n1} " in out
    assert "command: srun --nodes=2 --ntasks=2 --ntasks-per-node=1 " in out
    assert "dry run: nothing started" in out


def test_async_layout_mismatch_names_generation_nodes(slurm_cluster, job_dir):
    # 1 node allocated; the trainer's node plus the generator's make 2.
    job, log = _submit(slurm_cluster, job_dir, ["--nodes=1"], ASYNC)
    info = slurm_cluster.wait_job(job, timeout=60, log=log)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), slurm_cluster.tail(log)
    out = log.read_text()
    assert (
        "train.sbatch: error: the job has 1 node(s) (SLURM_NNODES) but the recipe needs 2: "
        "cluster.nodes=1 + cluster.generation_nodes=1; submit with --nodes=2"
    ) in out
    assert "command:" not in out


@requires_trainer
def test_async_rollouts_train_across_trainer_and_generator_nodes(slurm_cluster, job_dir):
    run_dir = job_dir / "run"
    tiny = [*FAST_TINY, f"algorithm.steps={ASYNC_STEPS}", "checkpoint.save_every=0"]
    args = [*ASYNC, f"logging.run_dir={run_dir}", *tiny]
    job, log = _submit(slurm_cluster, job_dir, ["--nodes=2"], args, **THREADS)
    info = slurm_cluster.wait_job(job, timeout=300, log=log)
    out = log.read_text()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), out[-3000:]
    assert "trainer ranks 0-0, generator ranks 1-1 (async rollouts, max_staleness 1)" in out
    records = _metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, ASYNC_STEPS + 1)), out[-3000:]
    for record in records:
        bad = {k: v for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, (record["step"], bad)
    # Step 1's rollouts come from the initial weights (nothing trained yet: staleness 0); from step 2 on the
    # generator runs one update behind the trainer (max_staleness 1).
    staleness = [r.get("rollout/staleness_mean") for r in records]
    assert staleness == [0.0] + [1.0] * (ASYNC_STEPS - 1), staleness
