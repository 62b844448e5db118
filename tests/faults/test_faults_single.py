"""Fault injection on one trainer process: damaged checkpoints, a full disk, a changed config, a killed grading
worker, failing metric sinks.

The reference is an uninterrupted 4-step run saving every 2 steps; every recovery must end with its metrics
(every non-timing key, exactly). Measured figures (docs/reliability.md) are printed with ``-s``.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faultlib import RECIPE, ROOT, checkpoint_names, comparable, fault_time, metrics, trainer_env
from procs import FAST_TINY, run_group, tmpfs

from nemo_disco import checkpoint

pytestmark = pytest.mark.slow

RUN = [*FAST_TINY, "algorithm.steps=4", "checkpoint.save_every=2", "cluster.step_timeout_s=60"]


def _train(run_dir: Path, *overrides: str, fault: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "nemo_disco.cli", "train", "--config", str(RECIPE), f"logging.run_dir={run_dir}"]
    return run_group([*cmd, *RUN, *overrides], cwd=ROOT, env=trainer_env(fault), timeout=600)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, list[dict]]:
    """A finished 4-step run (checkpoints step_2, step_4) and its metrics: the reference of every recovery."""
    run = tmp_path_factory.mktemp("base") / "run"
    done = _train(run)
    assert done.returncode == 0, done.stderr[-3000:]
    assert checkpoint_names(run) == ["step_2", "step_4"]
    return run, comparable(metrics(run))


def _copy(base: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(base, run)
    return run


def _damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":  # a save cut short by a crash of the file server, a quota, a copy that stopped
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped":  # one bit changed: a bad disk, a bad copy
        i = len(data) // 2
        path.write_bytes(data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1 :])
    else:  # missing: deleted by hand or by a cleanup job
        path.unlink()


@pytest.mark.parametrize(
    ("how", "file", "problem"),
    [
        ("truncated", "policy/model.safetensors", "policy/model.safetensors: 166320 bytes, the manifest says 332640"),
        ("flipped", "policy/optimizer.pt", "policy/optimizer.pt: SHA-256 differs from the manifest (bytes changed)"),
        ("missing", "trainer_state.json", "trainer_state.json: missing"),
    ],
)
def test_a_damaged_newest_checkpoint_is_skipped_and_the_run_resumes_from_the_previous(
    base, tmp_path, how, file, problem
):
    base_run, reference = base
    run = _copy(base_run, tmp_path)
    _damage(run / "checkpoints" / "step_4" / file, how)
    start = time.monotonic()
    done = _train(run)
    elapsed = time.monotonic() - start
    assert done.returncode == 0, done.stderr[-3000:]
    warning = f"warning: checkpoint {run}/checkpoints/step_4 skipped: {problem}"
    assert warning in done.stdout, done.stdout[-3000:]
    assert "set aside as step_4.corrupt" in done.stdout
    assert f"resumed from {run}/checkpoints/step_2 (step 2)" in done.stdout
    print(f"\nmeasured: {how} {file}: skipped at the next start; resumed from step_2; run took {elapsed:.1f} s")
    assert comparable(metrics(run)) == reference
    assert checkpoint_names(run) == ["step_2", "step_4", "step_4.corrupt"]
    assert checkpoint.verify(run / "checkpoints" / "step_4") == ([], True)


@pytest.fixture()
def small_checkpoint_fs(tmp_path) -> Path:
    """``run/checkpoints`` on a 1.5 MiB tmpfs: one checkpoint of the tiny run (~1.05 MB) fits, two do not."""
    run = tmp_path / "run"
    with tmpfs(run / "checkpoints", "1536k"):
        yield run


def test_disk_full_during_a_save_stops_with_a_clear_error_and_keeps_the_previous_checkpoint(base, small_checkpoint_fs):
    _, reference = base
    run = small_checkpoint_fs
    # keep_last=1: step_4 is written next to step_2 before step_2 may go, and 2 x 1.05 MB > 1.5 MiB.
    done = _train(run, "checkpoint.keep_last=1")
    assert done.returncode == 1, done.stderr[-3000:]
    line = next(x for x in done.stderr.splitlines() if x.startswith("nemo-disco: rank 0: error: "))
    assert "checkpoint step_4 could not be written" in line and "the file system is full: " in line
    assert f"the newest checkpoint is {run}/checkpoints/step_2" in line
    print(f"\nmeasured: ENOSPC: {line}")
    assert checkpoint_names(run) == ["step_2"]  # no step_4.tmp left behind
    assert checkpoint.verify(run / "checkpoints" / "step_2") == ([], True)
    # Space is freed (here: the file system grows); the same command resumes.
    subprocess.run(["mount", "-o", "remount,size=8m", str(run / "checkpoints")], check=True)
    done = _train(run, "checkpoint.keep_last=1")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {run}/checkpoints/step_2 (step 2)" in done.stdout
    assert comparable(metrics(run)) == reference


def test_resuming_with_a_changed_config_fails_with_a_diff_unless_allowed(base, tmp_path):
    base_run, reference = base
    run = _copy(base_run, tmp_path)
    done = _train(run, "loss.tau=1", "data.seed=7")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(f"nemo-disco train: error: {run}/checkpoints/step_4 was written with another config:")
    assert "data.seed: 42 -> 7; loss.tau: 10.0 -> 1.0 (model, loss, data and layout keys must match" in done.stderr
    assert comparable(metrics(run)) == reference  # nothing touched
    # Allowed: logged, and the run resumes from step_4 to a fifth step with the new tau.
    done = _train(run, "loss.tau=1", "checkpoint.allow_config_change=true", "algorithm.steps=5")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming with changed keys (checkpoint.allow_config_change=true): loss.tau: 10.0 -> 1.0" in done.stdout
    assert f"resumed from {run}/checkpoints/step_4 (step 4)" in done.stdout
    assert comparable(metrics(run))[:4] == reference and [r["step"] for r in metrics(run)] == [1, 2, 3, 4, 5]


def test_a_killed_grading_worker_changes_nothing(base, tmp_path):
    _, reference = base
    run = tmp_path / "run"
    done = _train(run, fault="kill_grader@0:3")
    assert done.returncode == 0, done.stderr[-3000:]
    fault_time(done.stderr)  # the fault fired
    assert "grader worker died (exit -9) while grading item" in done.stderr
    assert "graded again on a fresh worker" in done.stderr
    assert comparable(metrics(run)) == reference


def test_failing_metric_sinks_are_reported_once_and_training_goes_on(base, tmp_path):
    _, reference = base
    run = tmp_path / "run"
    run.mkdir()
    (run / "tensorboard").write_text("not a folder\n")  # TensorBoard cannot create its event folder
    # W&B is not installed in the test environment: its import fails (as no network or no API key would).
    done = _train(run, "logging.tensorboard=true", "logging.wandb=true")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    assert out.count("warning: metrics sink TensorBoard failed (") == 1, out[-3000:]
    import importlib.util

    if importlib.util.find_spec("wandb") is None:
        assert out.count("warning: metrics sink W&B failed (ModuleNotFoundError") == 1, out[-3000:]
    assert comparable(metrics(run)) == reference
