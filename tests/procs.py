"""Helpers for tests that launch trainer processes: the shrunk tiny recipe, ports, process-group runs, and small
file systems that fill up."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest

# recipes/tiny-cpu.yaml shrunk for tests: 8 questions x 4 rollouts per step, 2 updates per step, a short
# warm-up (40 updates, no accuracy target), no validation, no progress bar or TensorBoard. Callers add steps
# and checkpoint settings.
FAST_TINY = [
    "algorithm.prompts_per_step=8",
    "algorithm.minibatch_prompts=4",
    "algorithm.rollouts_per_prompt=4",
    "algorithm.warmup_sft_steps=40",
    "algorithm.warmup_target=null",
    "data.synthetic_size=200",
    "data.val=null",
    "data.val_every=0",
    "logging.progress=false",
    "logging.tensorboard=false",
]
# Same threads in every process of every run: a different count may change float summation order.
THREADS = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for torchrun's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(cmd: Sequence[str], *, timeout: float, **kwargs: object) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True)`` in a session of its own.

    On timeout the whole process group is killed (SIGKILL to torchrun alone leaves its workers running and
    holding the CPU for the rest of the suite), then ``subprocess.TimeoutExpired`` is raised with the output.
    """
    proc = subprocess.Popen(
        list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout, output=out, stderr=err) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def launch_ranks(
    script: Path, args: Sequence[str], world: int, out: Path, timeout: float, env: dict[str, str] | None = None
) -> list[str]:
    """Run ``world`` copies of ``script --worker ARGS`` with torchrun's variables; each rank's output (rank order).

    Rank 0 serves the rendezvous store (no torchrun agent). On timeout every process is killed; any rank that
    did not exit 0 fails the calling test with every rank's log tail.
    """
    root = Path(__file__).resolve().parents[1]
    base = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_USE_AGENT_STORE"}
    base.update({**THREADS, **(env or {})})
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world))
    base.update(LOCAL_WORLD_SIZE=str(world), PYTHONPATH=os.pathsep.join([str(root), base.get("PYTHONPATH", "")]))
    logs = [out / f"rank{r}.log" for r in range(world)]
    procs = []
    for r in range(world):
        with open(logs[r], "w") as log:
            cmd = [sys.executable, str(script), "--worker", *args]
            env_r = {**base, "RANK": str(r), "LOCAL_RANK": str(r), "GROUP_RANK": "0"}
            procs.append(subprocess.Popen(cmd, env=env_r, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    texts = [log.read_text() for log in logs]
    codes = [p.returncode for p in procs]
    assert codes == [0] * world, "\n".join(
        f"--- rank {r} (exit {c}) ---\n{t[-4000:]}" for r, (c, t) in enumerate(zip(codes, texts, strict=True))
    )
    return texts


@contextlib.contextmanager
def tmpfs(mnt: Path, size: str) -> Iterator[Path]:
    """A tmpfs of ``size`` (``8k``, ``1m``) mounted on ``mnt`` (made with its parents) for the block, unmounted
    after: a real file system that fills up. The test is skipped where mounting is not allowed."""
    mnt.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
