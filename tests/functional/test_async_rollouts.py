"""Asynchronous rollouts end to end on CPU: the trainer and its generator process (real components throughout).

- ``max_staleness=0`` is the synchronous run exactly (every non-timing metric, validation included);
- ``max_staleness=1`` is reproducible bit for bit across two runs and across a SIGKILL of the whole job and a
  resume (the checkpoint carries the rollouts made ahead);
- under torchrun (2 trainer ranks, transformers DP 2 or Megatron TP 2, + 1 generator rank, gloo) three steps run
  with finite metrics and the staleness logged;
- a generator process that dies is named by the trainer, which exits 5.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faults.faultlib import checkpoint_names, comparable, message, metrics, trainer_env
from procs import FAST_TINY, free_port, run_group

from nemo_disco import cli, watchdog

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-cpu.yaml"
ASYNC = ["algorithm.async_rollouts=true", "cluster.generation_gpus_per_node=1"]
# Validation twice (before step 1, after step 2) so that the generator's validation path is compared too.
VAL = ["data.val=synthetic:arithmetic-heldout", "data.val_every=2", "data.val_max_problems=16", "data.val_samples=2"]
RUN = [*FAST_TINY, "algorithm.steps=4", "checkpoint.save_every=2", "loss.rollout_correction=seq_tis"]
RUN += ["cluster.step_timeout_s=20"]


def _train(run_dir: Path, *overrides: str, fault: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nemo_disco.cli", "train", "--config", str(RECIPE), f"logging.run_dir={run_dir}"]
    return run_group([*cmd, *RUN, *overrides], cwd=ROOT, env=trainer_env(fault), timeout=600)


def test_staleness_0_is_the_synchronous_run_exactly(tmp_path):
    sync = _train(tmp_path / "sync", *VAL)
    assert sync.returncode == 0, sync.stderr[-3000:]
    run = tmp_path / "async"
    done = _train(run, *VAL, *ASYNC, "algorithm.max_staleness=0")
    assert done.returncode == 0, done.stderr[-3000:]
    ours, theirs = metrics(run), metrics(tmp_path / "sync")
    assert [r["step"] for r in ours] == [0, 1, 2, 3, 4]  # validation before step 1, then the 4 steps
    assert comparable(ours) == comparable(theirs)
    assert all(r["rollout/staleness_max"] == 0.0 for r in ours if r["step"] > 0)
    assert all(r["timing/publish"] > 0 for r in ours if 0 < r["step"] < 4)  # weights went down after every step


def test_staleness_1_is_reproducible_and_resumes_bit_for_bit_after_a_sigkill(tmp_path):
    runs = []
    for name in ("a", "b"):
        done = _train(tmp_path / name, *ASYNC)
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(metrics(tmp_path / name))
    assert comparable(runs[0]) == comparable(runs[1])
    staleness = [r["rollout/staleness_mean"] for r in runs[0]]
    assert staleness == [0.0, 1.0, 1.0, 1.0]  # step 1 samples the initial weights; step t those of step t-2
    assert all(math.isfinite(v) for r in runs[0] for v in r.values() if isinstance(v, float))
    # The checkpoint after step 2 holds step 3's rollouts, made with the weights of step 1.
    state = json.loads((tmp_path / "a" / "checkpoints" / "step_2" / "trainer_state.json").read_text())
    assert [(m["step"], m["version"]) for m in state["pending_rollouts"]] == [(3, 1)]

    # SIGKILL of the trainer at step 3 (after checkpoint step_2); the generator sees it go and stops; the same
    # command resumes from step_2 and ends with the uninterrupted run's metrics, bit for bit.
    run = tmp_path / "killed"
    done = _train(run, *ASYNC, fault="kill@0:3")
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    assert checkpoint_names(run) == ["step_2"]
    resumed = _train(run, *ASYNC)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run}/checkpoints/step_2 (step 2)" in resumed.stdout
    assert comparable(metrics(run)) == comparable(runs[0])


@pytest.mark.parametrize(
    "policy",
    [["policy.backend=hf"], ["policy.backend=megatron", "policy.tensor_parallel_size=2"]],
    ids=["hf-dp2", "megatron-tp2"],
)
def test_torchrun_two_trainer_ranks_and_a_generator_rank(tmp_path, policy):
    # Megatron TP 2: both trainer ranks gather the weights for the stream, rank 0 alone sends them.
    run = tmp_path / "run"
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--nproc-per-node", "3", "--master-port", str(free_port()), "-m", "nemo_disco.cli"]
    cmd += ["train", "--config", str(RECIPE), f"logging.run_dir={run}", *RUN, *ASYNC, "cluster.gpus_per_node=2"]
    cmd += ["algorithm.steps=3", *policy]
    done = run_group(cmd, cwd=ROOT, env=trainer_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    records = metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))
    assert [r["rollout/staleness_mean"] for r in records] == [0.0, 1.0, 1.0]
    assert records[0]["train/reward_mean"] >= 0


def test_a_dead_generator_is_named_and_the_trainer_exits_5(tmp_path):
    run = tmp_path / "run"
    t0 = time.time()
    # Killed as it starts step 6's rollouts (made with the weights of step 4, while the trainer trains step 5).
    # Checkpoint step_4 needs step 5's rollouts, made ahead: whether they reached the trainer before the kill is a
    # race, so the run resumes from step_4 or step_2 (both complete and verified).
    done = _train(run, *ASYNC, "algorithm.steps=6", fault="kill_generator@1:6")
    log = done.stdout + done.stderr
    assert done.returncode == watchdog.EXIT_PEER, log[-4000:]
    _, text = message(log, 0)
    assert "rank 1 (" in text and "it died" in text, text
    assert time.time() - t0 < 300
    assert "step_2" in checkpoint_names(run)
    # The run resumes as if nothing happened.
    resumed = _train(run, *ASYNC, "algorithm.steps=6")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5, 6]


def test_async_without_generator_processes_is_a_one_line_error(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "nemo_disco.cli", "train", "--config", str(RECIPE), "algorithm.async_rollouts=true"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert done.returncode == 2
    assert "cluster.generation_gpus_per_node" in done.stderr and "Traceback" not in done.stderr


LATE_NAN = """
import fcntl, os

def late_nan(response, answer, **fields):  # 1.0 for step 1's 32 rollouts, NaN from the 33rd call on
    with open(os.environ["CALLS_FILE"], "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(".")
        f.flush()
        calls = os.path.getsize(os.environ["CALLS_FILE"])
    return 1.0 if calls <= 32 else float("nan")


def fine(response, answer, **fields):
    return 1.0
"""


def test_rewards_that_all_fail_in_the_generator_stop_the_run_in_one_line_at_their_step(tmp_path):
    # Step 2's rollouts (made ahead, while step 1 trains) are all NaN: the checkpoint after step 1 leaves them out,
    # the trainer stops at step 2 with the generator's line (exit 2) and tells the generator to stop (no 60 s wait).
    (tmp_path / "late_rewards.py").write_text(LATE_NAN)
    env = trainer_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    env["CALLS_FILE"] = str(tmp_path / "calls")
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "nemo_disco.cli", "train", "--config", str(RECIPE), f"logging.run_dir={run}"]
    cmd += [*RUN, *ASYNC, "algorithm.max_staleness=1", "checkpoint.save_every=1"]
    t0 = time.time()
    done = run_group([*cmd, "reward.function=late_rewards:late_nan"], cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "nemo-disco train: error: step 2: reward errors 32/32 (0 timeouts): every reward failed, stopping; the "
        "first: reward.function late_rewards:late_nan failed on an item: ValueError: the reward function returned "
        "nan, expected a finite float"
    )
    assert "still up after" not in done.stderr and time.time() - t0 < 60
    assert [r["step"] for r in metrics(run)] == [1] and checkpoint_names(run) == ["step_1"]
    resumed = run_group([*cmd, "reward.function=late_rewards:fine"], cwd=ROOT, env=env, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [r["step"] for r in metrics(run)] == [1, 2, 3, 4]


PROBE = """
import json, os, torch

def record(point, **info):  # the thread count each role trains or samples with, and how its OpenMP waits
    if point in ("old_logprobs", "rollouts"):
        with open(os.environ["PROBE_OUT"], "a") as f:
            f.write(json.dumps([point, torch.get_num_threads(), os.environ.get("OMP_WAIT_POLICY")]) + "\\n")
"""


def test_without_a_launcher_the_trainer_takes_every_core_and_openmp_waits_passively(tmp_path):
    """Each role's torch threads at work, and the spin count its OpenMP runtime reports as it loads."""
    (tmp_path / "probe").mkdir()
    (tmp_path / "probe" / "threads_probe.py").write_text(PROBE)
    env = {k: v for k, v in trainer_env().items() if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "probe"), env["PYTHONPATH"]])
    env["NEMO_DISCO_HOOKS"] += ",threads_probe:record"
    env["PROBE_OUT"] = str(tmp_path / "probe.jsonl")
    env["OMP_DISPLAY_ENV"] = "verbose"  # each process's OpenMP runtime prints its settings on stderr as it loads
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "nemo_disco.cli", "train", "--config", str(RECIPE), f"logging.run_dir={run}"]
    done = run_group([*cmd, *RUN, *ASYNC, "algorithm.steps=2"], cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    cores = cli.usable_cores()
    seen = {tuple(json.loads(line)) for line in (tmp_path / "probe.jsonl").read_text().splitlines()}
    assert seen == {("old_logprobs", cores, "passive"), ("rollouts", max(1, cores // 2), "passive")}, seen
    # Passive: no spinning (libgomp's default spins 300000 times before it sleeps). One runtime per role.
    assert re.findall(r"GOMP_SPINCOUNT = '(\d+)'", done.stderr) == ["0", "0"], done.stderr[-3000:]
    assert f"threads: trainer {cores}, generator {max(1, cores // 2)} each; OMP_WAIT_POLICY=passive" in done.stderr
    assert [r["step"] for r in metrics(run)] == [1, 2]


def test_sigusr1_saves_the_rollouts_made_ahead_stops_both_sides_and_resumes_exactly(tmp_path):
    steps = ["algorithm.steps=24", "checkpoint.save_every=0"]
    reference = _train(tmp_path / "reference", *ASYNC, *steps)
    assert reference.returncode == 0, reference.stderr[-3000:]
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "nemo_disco.cli", "train", "--config", str(RECIPE), f"logging.run_dir={run}"]
    cmd += [*RUN, *ASYNC, *steps]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=trainer_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not ((run / "metrics.jsonl").is_file() and len(metrics(run)) >= 3) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGUSR1)  # as Slurm does: every process of the job, the generator included
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 3, err[-3000:]  # checkpoint saved, requeue me
    (saved,) = checkpoint_names(run)
    stopped_at = int(saved.removeprefix("step_"))
    assert 3 <= stopped_at < 24
    state = json.loads((run / "checkpoints" / saved / "trainer_state.json").read_text())
    assert [m["step"] for m in state["pending_rollouts"]] == [stopped_at + 1]
    resumed = _train(run, *ASYNC, *steps)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert comparable(metrics(run)) == comparable(metrics(tmp_path / "reference"))


def test_a_hung_generator_ends_the_run_with_exit_4_naming_its_phase(tmp_path):
    # The generator (rank 1) hangs as it begins its first rollouts, those of step 1.
    run = tmp_path / "run"
    done = _train(run, *ASYNC, fault="hang@1:1")
    log = done.stdout + done.stderr
    assert done.returncode == watchdog.EXIT_HUNG, log[-4000:]
    # Both wait about as long: the generator's limit on its rollouts or the trainer's on step 1 fires first, and
    # when both fire within the same moment each rank names its own phase. Either way each rank's one line names
    # a phase of step 1: its own or the one the other rank reported.
    lines = {rank: message(log, rank)[1] for rank in (0, 1)}
    own = {0: "step 1 has run for", 1: "generator: rollouts of step 1 has run for"}
    for rank, other in ((0, 1), (1, 0)):
        assert lines[rank].startswith((own[rank], f"stopping: rank {other} reported: {own[other]}")), lines
    assert not all(line.startswith("stopping:") for line in lines.values()), lines
    stacks = {p.name.split("-rank")[1][0]: p.read_text() for p in (run / "stacks").iterdir()}
    assert sorted(stacks) == ["0", "1"] and "hang_forever" in stacks["1"]
