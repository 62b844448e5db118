"""Fault injection under torchrun (2 gloo ranks, the real trainer): hangs, dead, frozen ranks, kills mid-save.

Each fault (tests/faults/inject/faults.py, a hook of nemo_disco.hooks) fires at step 3 (or as checkpoint step_4 is
written) of a 4-step run that saves every 2 steps, with ``cluster.step_timeout_s=15``: phase limits max(15 s,
2 x the slowest), silence limit max(5, 15 / 4) = 5 s, heartbeat 0.5 s. Each test asserts the detection time against
its bound, every rank's exit code, the message naming the cause, that no partial checkpoint became the newest, and
that the next start resumes from step_2 and ends with the metrics of the uninterrupted run (every non-timing key,
exactly).

Measured figures (docs/reliability.md) are printed with ``-s``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from faultlib import (
    RECIPE,
    ROOT,
    checkpoint_names,
    comparable,
    fault_time,
    message,
    metrics,
    torchrun_exit_codes,
    trainer_env,
)
from procs import FAST_TINY, free_port, run_group

from nemo_disco import checkpoint, watchdog

pytestmark = pytest.mark.slow

TORCHRUN = Path(sys.executable).with_name("torchrun")
RUN = [*FAST_TINY, "algorithm.steps=4", "checkpoint.save_every=2", "cluster.gpus_per_node=2"]
RUN += ["cluster.step_timeout_s=15"]
SILENCE_S = watchdog.silence_limit(15)  # 5 s
BEAT_S = SILENCE_S / watchdog.BEATS_PER_SILENCE  # 0.5 s


def _torchrun(run_dir: Path, fault: str | None = None) -> subprocess.CompletedProcess:
    cmd = [str(TORCHRUN), "--nproc-per-node", "2", "--master-port", str(free_port()), "-m", "nemo_disco.cli"]
    cmd += ["train", "--config", str(RECIPE), f"logging.run_dir={run_dir}", *RUN]
    return run_group(cmd, cwd=ROOT, env=trainer_env(fault), timeout=600)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    run = tmp_path_factory.mktemp("reference") / "run"
    done = _torchrun(run)
    assert done.returncode == 0, done.stderr[-3000:]
    return comparable(metrics(run))


def _resumes_to_the_reference(run: Path, reference: list[dict]) -> None:
    done = _torchrun(run)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from {run}/checkpoints/step_2 (step 2)" in done.stdout
    assert comparable(metrics(run)) == reference
    assert checkpoint_names(run) == ["step_2", "step_4"]
    assert checkpoint.verify(run / "checkpoints" / "step_4") == ([], True)


@pytest.mark.parametrize(
    ("fault", "label"), [("hang@1:3", "step 3"), ("hang_save@0:4", "checkpoint step 4")], ids=["step", "save"]
)
def test_a_hang_dumps_every_ranks_stacks_exits_4_and_resumes(tmp_path, reference, fault, label):
    run = tmp_path / "run"
    done = _torchrun(run, fault)
    log = done.stdout + done.stderr
    hung = int(fault.split("@")[1].split(":")[0])
    codes = torchrun_exit_codes(log)
    assert done.returncode == 1 and {r: c for r, (c, _) in codes.items()} == {0: 4, 1: 4}, log[-4000:]
    # Each rank reports the hang, from its own limit or from the first rank's notice (they start the phase
    # together, so either may be first).
    hang = (
        rf"{label} has run for (\d+\.\d) s, over its limit of (\d+\.\d) s \(cluster\.step_timeout_s=15, slowest "
        rf".*\)"
    )
    lines = [message(log, r) for r in (0, 1)]
    for _, text in lines:
        assert re.fullmatch(
            rf"(stopping: rank \d reported: )?{hang}; Python stacks follow \(also in \S+\); "
            r"exiting with code 4",
            text,
        ), text
    first = min(lines)
    limit = float(re.search(hang, first[1]).group(2))
    detection = first[0] - fault_time(log)
    print(f"\nmeasured: {fault}: limit {limit:.1f} s, detected {detection:.1f} s after the fault")
    # The fault fires right after the phase starts: detected at the limit, within a heartbeat plus slack.
    assert limit - 1.0 <= detection <= limit + BEAT_S + 2.0, detection
    # Every rank wrote its stacks: the hung one where it hangs, the other in a collective or reporting the hang.
    stacks = {int(re.search(r"-rank(\d)-", p.name).group(1)): p.read_text() for p in (run / "stacks").iterdir()}
    assert sorted(stacks) == [0, 1]
    assert "hang_forever" in stacks[hung]
    if label == "step 3":
        assert "all_gather_object" in stacks[1 - hung]  # waiting for the hung rank's rollouts
    assert log.count("Python stacks follow") == 2
    # The newest checkpoint is step_2; a hung save left only its .tmp folder.
    assert checkpoint_names(run) == (["step_2", "step_4.tmp"] if label != "step 3" else ["step_2"])
    _resumes_to_the_reference(run, reference)


@pytest.mark.parametrize(
    ("fault", "bound_s"),
    [
        # SIGKILL mid-step: the survivor's collective fails at once; 3 heartbeats + 1 s show the victim silent.
        ("kill@1:3", 3 * BEAT_S + 1.0 + 3.0),
        # SIGKILL mid-save (the writer, rank 0, with half of optimizer.pt written): the same on the survivor.
        ("kill_save@0:4", 3 * BEAT_S + 1.0 + 3.0),
        # SIGSTOP mid-step (a frozen process, a lost node: sockets stay open, nothing fails): the silence limit.
        ("stop@1:3", SILENCE_S + BEAT_S + 3.0),
    ],
    ids=["sigkill-step", "sigkill-save", "sigstop-step"],
)
def test_a_dead_or_frozen_rank_is_named_and_the_run_resumes(tmp_path, reference, fault, bound_s):
    run = tmp_path / "run"
    done = _torchrun(run, fault)
    log = done.stdout + done.stderr
    victim = int(fault.split("@")[1].split(":")[0])
    survivor = 1 - victim
    codes = torchrun_exit_codes(log)
    # The victim: SIGKILL (-9), or killed by torchrun after its 30 s grace once the survivor exited (SIGSTOP).
    assert done.returncode == 1 and codes[survivor][0] == watchdog.EXIT_PEER and codes[victim][0] == -9, log[-4000:]
    when, text = message(log, survivor)
    victim_pid = codes[victim][1]
    m = re.match(rf"rank {victim} \(\S+, pid {victim_pid}\) sent no heartbeat for (\d+\.\d) s.*: it died", text)
    assert m, text
    detection = when - fault_time(log)
    print(f"\nmeasured: {fault}: survivor stopped {detection:.1f} s after the fault (bound {bound_s:.1f} s): {text}")
    assert detection <= bound_s, detection
    if fault.startswith("stop"):
        assert SILENCE_S <= float(m.group(1)) <= SILENCE_S + BEAT_S + 1.0
    # A save killed half-way leaves step_4.tmp, never a step_4: the newest checkpoint stays step_2.
    assert checkpoint_names(run) == (["step_2", "step_4.tmp"] if "save" in fault else ["step_2"])
    _resumes_to_the_reference(run, reference)
