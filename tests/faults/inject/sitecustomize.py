"""Fault injection for the trainer processes of the fault tests (imported by Python at start-up via PYTHONPATH).

Does nothing unless ``NEMO_DISCO_FAULT=<kind>@<rank>:<step>`` is set. When ``nemo_disco.algorithm`` is imported,
the fault is installed in the process of global rank ``<rank>`` (``RANK``, as set by torchrun and
slurm/train.sbatch) and fires at training step ``<step>`` (or while checkpoint ``step_<step>`` is saved):

- ``hang``: the rank stops making progress in the rollout phase (a Python-level hang: its peers wait in the
  gather of the rollouts, a collective);
- ``hang_save``: the rank stops making progress while writing the checkpoint;
- ``kill``: SIGKILL in the middle of the step (after the old log-probs, before the updates), as the OOM killer;
- ``stop``: SIGSTOP in the middle of the step: the process freezes, sockets stay open (a lost node, a hung driver);
- ``kill_save``: SIGKILL while ``policy/optimizer.pt`` of the checkpoint is half written;
- ``kill_grader``: a grading worker is SIGKILLed just before an item is sent to it;
- ``kill_generator``: with asynchronous rollouts, the generator's process (``<rank>`` a generator rank) is
  SIGKILLed as it starts the rollouts of step ``<step>``.

With ``NEMO_DISCO_FAULT_ONCE=<file>`` a fault fires only if ``<file>`` does not exist, and creates it (a requeued
or resumed run then runs clean). Every fault prints ``fault: <kind> rank <r> step <n> at <unix time>`` on stderr
first, so a test can measure the time to detection.
"""

from __future__ import annotations

import os

_SPEC = os.environ.get("NEMO_DISCO_FAULT")


def _parse(spec: str) -> tuple[str, int, int]:
    kind, _, where = spec.partition("@")
    rank, _, step = where.partition(":")
    return kind, int(rank), int(step)


def _install(algorithm) -> None:  # noqa: ANN001  (the nemo_disco.algorithm module)
    import signal
    import sys
    import time
    from pathlib import Path

    kind, rank, step = _parse(_SPEC or "")
    if int(os.environ.get("RANK", "0")) != rank:
        return
    once = os.environ.get("NEMO_DISCO_FAULT_ONCE")
    now = {"step": 0, "saving": -1, "fired": False}

    def fire() -> bool:
        if now["fired"]:
            return False
        now["fired"] = True
        if once:
            if Path(once).exists():
                return False
            Path(once).write_text(f"{kind}@{rank}:{step}\n")
        print(f"fault: {kind} rank {rank} step {step} at {time.time():.3f}", file=sys.stderr, flush=True)
        return True

    def hang_forever() -> None:
        while True:
            time.sleep(1.0)

    train_step = algorithm.train_step

    def counting_train_step(tr):  # noqa: ANN001, ANN202
        now["step"] = tr.step + 1
        return train_step(tr)

    algorithm.train_step = counting_train_step

    save_checkpoint = algorithm.save_checkpoint

    def counting_save(tr):  # noqa: ANN001, ANN202
        now["saving"] = tr.step
        try:
            return save_checkpoint(tr)
        finally:
            now["saving"] = -1

    algorithm.save_checkpoint = counting_save

    if kind == "hang":
        rollouter = algorithm.rollouts.Rollouter
        collect = rollouter.collect

        def hanging_collect(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if now["step"] == step and fire():
                hang_forever()
            return collect(self, *args, **kwargs)

        rollouter.collect = hanging_collect
    elif kind == "kill_generator":
        from nemo_disco.rollouts import rollouter as rollouter_module

        step_rollouts = rollouter_module.step_rollouts

        def dying_rollouts(ro, at, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if at == step and fire():
                os.kill(os.getpid(), signal.SIGKILL)
            return step_rollouts(ro, at, *args, **kwargs)

        rollouter_module.step_rollouts = dying_rollouts
    elif kind in ("kill", "stop"):
        gather = algorithm._gather_rows
        sig = signal.SIGKILL if kind == "kill" else signal.SIGSTOP

        def dying_gather(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            if now["step"] == step and fire():
                os.kill(os.getpid(), sig)
            return gather(*args, **kwargs)

        algorithm._gather_rows = dying_gather
    elif kind in ("kill_save", "hang_save"):
        import torch

        torch_save = torch.save

        def failing_save(obj, f, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            if now["saving"] == step and str(f).endswith("optimizer.pt") and fire():
                if kind == "hang_save":
                    hang_forever()
                with open(f, "wb") as fh:  # half a file, then the kill
                    fh.write(b"\0" * 4096)
                    fh.flush()
                    os.fsync(fh.fileno())
                os.kill(os.getpid(), signal.SIGKILL)
            return torch_save(obj, f, *args, **kwargs)

        torch.save = failing_save
    elif kind == "kill_grader":
        from nemo_disco.rewards import pool

        send = pool._Worker.send

        def send_to_a_dead_worker(self, payload):  # noqa: ANN001, ANN202
            if now["step"] == step and fire():
                self.proc.kill()
                self.proc.wait()
            return send(self, payload)

        pool._Worker.send = send_to_a_dead_worker
    else:
        raise ValueError(f"NEMO_DISCO_FAULT={_SPEC!r}: unknown fault {kind!r}")


if _SPEC:
    import importlib.abc
    import importlib.util
    import sys

    class _AfterAlgorithmImport(importlib.abc.MetaPathFinder):
        """Installs the fault right after ``nemo_disco.algorithm`` has been executed."""

        def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
            if name != "nemo_disco.algorithm":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            loader = spec.loader
            exec_module = loader.exec_module

            def exec_then_install(module):  # noqa: ANN001, ANN202
                exec_module(module)
                _install(module)

            loader.exec_module = exec_then_install
            return spec

    sys.meta_path.insert(0, _AfterAlgorithmImport())
