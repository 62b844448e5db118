"""Fault injection for the trainer and generator processes of the fault tests: a hook of :mod:`nemo_disco.hooks`.

Installed with ``NEMO_DISCO_HOOKS=faults:hook`` and this folder on ``PYTHONPATH`` (:func:`faultlib.trainer_env`).
``NEMO_DISCO_FAULT=<kind>@<rank>:<step>`` chooses the fault: it acts in the process of global rank ``<rank>``
(``RANK``, as set by torchrun and slurm/train.sbatch) at training step ``<step>`` (or at checkpoint ``step_<step>``):

- ``hang``: the rank stops making progress as its rollouts begin (a Python-level hang: its peers wait in the
  gather of the rollouts, a collective);
- ``hang_save``: the rank stops making progress once it has written its part of the checkpoint;
- ``kill``: SIGKILL in the middle of the step (after the old log-probs, before the updates), as the OOM killer;
- ``stop``: SIGSTOP at the same point: the process freezes, sockets stay open (a lost node, a hung driver);
- ``kill_save``: SIGKILL with ``policy/optimizer.pt`` of the checkpoint half written;
- ``kill_grader``: a grading worker is SIGKILLed just before an answer of the step is sent to it;
- ``kill_generator``: with asynchronous rollouts, the generator's process (``<rank>`` a generator rank) is
  SIGKILLed as it starts the rollouts of step ``<step>``.

With ``NEMO_DISCO_FAULT_ONCE=<file>`` a fault fires only if ``<file>`` does not exist, and creates it (a requeued
or resumed run then runs clean). Every fault prints ``fault: <kind> rank <r> step <n> at <unix time>`` on stderr
first, so a test can measure the time to detection.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

KINDS = ("hang", "hang_save", "kill", "stop", "kill_save", "kill_grader", "kill_generator")


def _parse(spec: str) -> tuple[str, int, int]:
    kind, _, where = spec.partition("@")
    rank, _, step = where.partition(":")
    if kind not in KINDS:
        raise ValueError(f"NEMO_DISCO_FAULT={spec!r}: unknown fault {kind!r}")
    return kind, int(rank), int(step)


_state = {"fired": False, "rollouts": 0}  # rollouts: the step whose rollouts this process makes now


def _fire(kind: str, rank: int, step: int) -> bool:
    if _state["fired"]:
        return False
    _state["fired"] = True
    once = os.environ.get("NEMO_DISCO_FAULT_ONCE")
    if once:
        if Path(once).exists():
            return False
        Path(once).write_text(f"{kind}@{rank}:{step}\n")
    print(f"fault: {kind} rank {rank} step {step} at {time.time():.3f}", file=sys.stderr, flush=True)
    return True


def _hang_forever() -> None:
    while True:
        time.sleep(1.0)


def hook(point: str, **info: Any) -> None:
    """Fire the fault of ``NEMO_DISCO_FAULT`` where and when it is due (a no-op without it)."""
    spec = os.environ.get("NEMO_DISCO_FAULT")
    if not spec:
        return
    kind, rank, step = _parse(spec)
    if int(os.environ.get("RANK", "0")) != rank:
        return
    if point == "rollouts":
        _state["rollouts"] = info["step"]
    due = {
        "hang": point == "rollouts" and info["step"] == step,
        "kill_generator": point == "rollouts" and info["step"] == step,
        "kill": point == "old_logprobs" and info["step"] == step,
        "stop": point == "old_logprobs" and info["step"] == step,
        "hang_save": point == "checkpoint_written" and info["step"] == step,
        "kill_save": point == "checkpoint_written" and info["step"] == step,
        "kill_grader": point == "grader_send" and _state["rollouts"] == step,
    }[kind]
    if not due or not _fire(kind, rank, step):
        return
    if kind in ("hang", "hang_save"):
        _hang_forever()
    elif kind == "kill_grader":
        info["process"].kill()
        info["process"].wait()
    elif kind == "kill_save":
        for optimizer in Path(info["directory"]).rglob("optimizer.pt"):  # half of the file, then the kill
            with open(optimizer, "r+b") as fh:
                fh.truncate(optimizer.stat().st_size // 2)
                fh.flush()
                os.fsync(fh.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        os.kill(os.getpid(), signal.SIGSTOP if kind == "stop" else signal.SIGKILL)
