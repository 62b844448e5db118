"""nemo_disco.rewards.pool: adversarial model output, the worker pool's hard timeout, worker death and replacement."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from nemo_disco.rewards import GRADERS, GraderPool, score_batch

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 2.0


def _boxed(answer: str) -> str:
    return f"Let me compute step by step. The result follows. Therefore the answer is $\\boxed{{{answer}}}$."


@pytest.fixture(scope="module", params=GRADERS)
def pool(request):
    with GraderPool(request.param, timeout_s=TIMEOUT_S, workers=2) as p:
        yield p


# ----------------------------------------------------------------------------------------------------------------------
# Adversarial output, hard timeouts, worker replacement


def test_adversarial_responses_score_zero_in_time_and_run_nothing(pool, tmp_path):
    marker = tmp_path / "pwned"
    code = f"__import__('os').system('touch {marker}')"
    bad = [
        r"\boxed{9^{9^{9^{9}}}}",
        "x" * 100_000,
        "7 " * 50_000 + r"\boxed{8}",
        r"\boxed{" * 200 + "1",
        "}" * 1000 + r"\boxed{1}}}}",
        f"\\boxed{{{code}}}",
        f"The answer is {code}",
        f'\\boxed{{eval("{code}")}}',
    ]
    start = time.monotonic()
    scores, metrics = pool.score(bad, ["2"] * len(bad))
    elapsed = time.monotonic() - start
    assert scores == [0.0] * len(bad)
    # At most one item per worker at a time can hang for timeout_s (+0.5 s kill grace); the rest are fast.
    assert elapsed < TIMEOUT_S + 0.5 + 3.0, elapsed
    assert not marker.exists()
    assert metrics["reward/errors"] == 0
    # The tower times out under math-verify; the deepscaler grader refuses it before parsing.
    assert metrics["reward/timeouts"] == (1 if pool.grader == "math_verify" else 0)


def test_order_preserved_and_workers_reused(pool):
    responses = [_boxed(str(i if i % 3 else i + 1)) for i in range(60)]
    truths = [str(i) for i in range(60)]
    pids = pool.worker_pids
    scores, _ = pool.score(responses, truths)
    assert scores == [0.0 if i % 3 == 0 else 1.0 for i in range(60)]
    assert pool.worker_pids == pids
    assert pool.score([], []) == ([], {"reward/timeouts": 0.0, "reward/errors": 0.0, "reward/restarts": 0.0})
    with pytest.raises(ValueError, match="2 responses but 1"):
        pool.score(["a", "b"], ["1"])


def test_parent_kills_and_replaces_a_stuck_worker():
    # Without the worker's own alarm, only the parent's kill at timeout_s + kill_grace_s stops the tower.
    with GraderPool("math_verify", timeout_s=1.0, workers=1, soft_timeout=False, kill_grace_s=0.2) as pool:
        pool.score(["\\boxed{1}"], ["1"])  # wait for the worker to start
        before = pool.worker_pids
        start = time.monotonic()
        scores, metrics = pool.score([r"\boxed{9^{9^{9^{9}}}}", r"so \boxed{2}", r"\boxed{3}"], ["1", "2", "4"])
        elapsed = time.monotonic() - start
        assert scores == [0.0, 1.0, 0.0]
        assert metrics == {"reward/timeouts": 1.0, "reward/errors": 0.0, "reward/restarts": 1.0}
        assert pool.worker_pids != before
        # 1.2 s until the kill, then a fresh worker starts (~0.6 s) and grades the other two.
        assert 1.2 <= elapsed < 1.2 + 6.0, elapsed


# Grading this takes ~5 s on one core (9^(9^7) has 4.5 million digits): a kill 0.5 s in lands mid-item.
SLOW = r"\boxed{9^{9^{7}}}"


def test_worker_killed_mid_item_is_replaced_and_the_item_graded_again():
    with GraderPool("math_verify", timeout_s=60.0, workers=1, soft_timeout=False) as pool:
        pool.score(["\\boxed{1}"], ["1"])
        (pid,) = pool.worker_pids
        killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))  # e.g. the kernel's OOM killer
        killer.start()
        scores, metrics = pool.score([SLOW, r"\boxed{2}"], ["1", "2"])
        killer.join()
        # The slow item was graded to the end on the fresh worker (0: 9^(9^7) != 1), not scored 0 as an error.
        assert scores == [0.0, 1.0]
        assert metrics == {"reward/timeouts": 0.0, "reward/errors": 0.0, "reward/restarts": 1.0}
        assert pool.worker_pids != [pid]


def test_an_item_whose_worker_dies_twice_counts_as_an_error():
    with GraderPool("math_verify", timeout_s=60.0, workers=1, soft_timeout=False) as pool:
        pool.score(["\\boxed{1}"], ["1"])
        (first,) = pool.worker_pids

        def kill_twice() -> None:
            os.kill(first, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while pool.worker_pids == [first] and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(1.5)  # the fresh worker starts (~0.6 s) and is grading the slow item again
            os.kill(pool.worker_pids[0], signal.SIGKILL)

        killer = threading.Timer(0.5, kill_twice)
        killer.start()
        scores, metrics = pool.score([SLOW, r"\boxed{2}"], ["1", "2"])
        killer.join()
        assert scores == [0.0, 1.0]
        assert metrics == {"reward/timeouts": 0.0, "reward/errors": 1.0, "reward/restarts": 2.0}


def test_interrupted_call_leaves_no_stale_answer():
    inherited = signal.getsignal(signal.SIGINT)
    # A run started in the background without job control (`make test &` in a script) inherits SIGINT ignored;
    # the test then installs Python's own handler, as an interactive run has. Any other handler is a leak.
    assert inherited in (signal.default_int_handler, signal.SIG_IGN), "an earlier test left a SIGINT handler"
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        _interrupt_a_call_and_grade_again()
    finally:
        signal.signal(signal.SIGINT, inherited)


def _interrupt_a_call_and_grade_again() -> None:
    with GraderPool("math_verify", timeout_s=60.0, workers=1) as pool:
        pool.score(["\\boxed{1}"], ["1"])
        # Ctrl-C reaches the main thread (the kernel may hand a process-wide signal to any thread); the long
        # timeout keeps the grading busy however late the timer fires on a loaded machine.
        main = threading.main_thread().ident
        threading.Timer(0.5, signal.pthread_kill, (main, signal.SIGINT)).start()
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            pool.score([r"\boxed{9^{9^{9^{9}}}}"], ["1"])
        assert time.monotonic() - start < 30.0  # interrupted, not timed out
        # The busy worker was replaced: its late verdict cannot be taken for this call's answers.
        assert pool.score([r"\boxed{2}", r"\boxed{3}"], ["2", "2"])[0] == [1.0, 0.0]
        assert pool.restarts == 1


def test_worker_startup_failure_is_reported():
    with GraderPool("math_verify", timeout_s=5.0, workers=1, memory_limit_mb=16) as pool:  # too little memory to import
        with pytest.raises(RuntimeError, match="exited during start-up"):
            pool.score(["\\boxed{1}"], ["1"])


def test_bad_pool_settings():
    with pytest.raises(ValueError, match="unknown grader"):
        GraderPool("exact", timeout_s=5.0, workers=1)
    with pytest.raises(ValueError, match="timeout_s > 0"):
        GraderPool("math_verify", timeout_s=0, workers=1)


def test_score_batch_works_when_main_program_is_read_from_stdin(tmp_path):
    script = (
        "from nemo_disco.rewards import score_batch\n"
        "scores, m = score_batch(['\\\\boxed{2}', '\\\\boxed{9^{9^{9^{9}}}}', 'no'], ['2', '1', '3'],\n"
        "                        timeout_s=1.0, workers=2)\n"
        "print(scores, m['reward/timeouts'])\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-"], input=script, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[1.0, 0.0, 0.0] 1.0"


def test_score_batch_temporary_pool():
    scores, metrics = score_batch([r"\boxed{\frac{1}{2}}", r"\boxed{0.5}"], ["0.5", r"\frac12"], grader="deepscaler",
                                  timeout_s=5.0, workers=2)  # fmt: skip
    assert scores == [1.0, 1.0]
    assert metrics["reward/timeouts"] == 0


def test_workers_survive_the_job_signals_meant_for_the_trainer():
    """Slurm signals every process of a step: USR1 / TERM / INT must not kill a grading worker."""
    import os
    import signal

    from nemo_disco.rewards import GraderPool

    with GraderPool("math_verify", timeout_s=5.0, workers=1) as pool:
        pool.score(["\\boxed{1}"], ["1"])  # workers ready
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
            os.kill(pool.worker_pids[0], sig)
        scores, metrics = pool.score(["\\boxed{2}", "\\boxed{3}"], ["2", "4"])
    assert scores == [1.0, 0.0]
    assert metrics["reward/errors"] == 0 and metrics["reward/restarts"] == 0
