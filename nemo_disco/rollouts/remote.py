"""Asynchronous rollouts: the trainer's :class:`RemoteRollouts` and the generator's :func:`serve` loop.

The generator runs :func:`serve` in processes of its own (ranks after the trainer's,
:func:`nemo_disco.distributed.init_roles`). Step ``t``'s rollouts are sampled with the weights after step
``t - 1 - algorithm.max_staleness`` (step 0's at the start), so they are made while the trainer works on earlier
steps; each carries the version that made it. Weights travel down the :class:`~nemo_disco.distributed.Link`
after every step in buckets of ``generation.refit_bucket_mb``; the generator applies a whole stream before it
samples again. The rule is fixed, not "whatever is newest", so a run is reproducible bit for bit and
``max_staleness=0`` is the synchronous run exactly.

The message protocol (docs/async.md)::

    down (trainer rank 0 -> every generator rank):
        {"kind": "weights", "version": v, "validate": seed | None, "generate": bool, "start": {...} | None}
            then the weight stream: per bucket {"tensors": [(name, dtype, shape), ...], "nbytes": n} and the
            bucket's bytes; {"tensors": None} ends it
        {"kind": "stop", "code": exit code}
    up (generator rank 0 -> trainer rank 0, from a sender thread, in order):
        {"kind": "rollouts", "step": t, "version": v, "records": [...], "metrics": {...}, "sampler": {...}}
        {"kind": "rollouts", "step": t, "version": v, "failed": line}: too many of step t's rewards failed
            (reward.max_error_share); the generator makes no more, the trainer stops it (code 0) at step t and
            ends the run with the line (exit code 2)
        {"kind": "validation", "step": v, "per_problem": [...], "failures": {"reward/errors": n, ...}}

Checkpoints (async): the rollouts already made for the steps after the checkpoint (at most
``max_staleness`` of them, made by weights older than the checkpoint's) are saved with the sampler's position
after them; on resume the generator starts at the next step with the checkpoint's weights.
"""

from __future__ import annotations

import math
import queue
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from nemo_disco import distributed
from nemo_disco.batch import QuestionRollouts
from nemo_disco.config import RunConfig
from nemo_disco.data import PromptSampler, RunProblems, new_sampler, train_problems, val_problems
from nemo_disco.generation import factory
from nemo_disco.generation.base import buckets
from nemo_disco.policy.base import Policy
from nemo_disco.rollouts import rollouter
from nemo_disco.rollouts.rollouter import staleness_metrics

#: Tensors in a weight bucket start at multiples of this many bytes (any dtype's view is aligned).
_ALIGN = 64

# ----------------------------------------------------------------------------------------------------------------------
# The weight stream


def send_weights(link: distributed.Link | None, weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> None:
    """Stream ``weights`` down the link in buckets of at most ``bucket_bytes`` (trainer rank 0).

    The other trainer ranks pass ``link=None`` and only drain the iterator, which may be collective (Megatron
    gathers tensor- and pipeline-parallel shards).
    """
    if link is None:
        for _ in weights:
            pass
        return
    for bucket in buckets(((name, t.detach()) for name, t in weights), bucket_bytes, align=_ALIGN):
        _send_bucket(link, bucket)
    link.send_down({"tensors": None})


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _send_bucket(link: distributed.Link, bucket: list[tuple[str, torch.Tensor]]) -> None:
    dev = link.weights_device
    total = sum(_aligned(t.numel() * t.element_size()) for _, t in bucket)
    buf = torch.zeros(total, dtype=torch.uint8, device=dev)
    offset = 0
    for _, t in bucket:
        n = t.numel() * t.element_size()
        buf[offset : offset + n].copy_(t.contiguous().view(-1).view(torch.uint8).to(dev))
        offset += _aligned(n)
    link.send_down({"tensors": [(name, str(t.dtype), tuple(t.shape)) for name, t in bucket], "nbytes": total})
    link.buffer_down(buf)


def receive_weights(link: distributed.Link) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one weight stream, bucket by bucket (views into the received buffers): a generator rank.

    Consume it to the end (the stream's messages are in the link's order).
    """
    while True:
        head = link.recv_down()
        if head["tensors"] is None:
            return
        buf = link.buffer_down(torch.empty(head["nbytes"], dtype=torch.uint8, device=link.weights_device))
        offset = 0
        for name, dtype, shape in head["tensors"]:
            dt = getattr(torch, dtype.removeprefix("torch."))
            n = math.prod(shape) * torch.empty((), dtype=dt).element_size()
            yield name, buf[offset : offset + n].view(dt).view(shape)
            offset += _aligned(n)


# ----------------------------------------------------------------------------------------------------------------------
# The trainer's side


class RemoteRollouts:
    """Asynchronous rollouts from the generator's processes (trainer side; see the module docstring).

    Trainer rank 0 talks to the generator; it hands every message on to the other trainer ranks.
    """

    def __init__(
        self,
        cfg: RunConfig,
        link: distributed.Link,
        policy: Policy,
        sampler: PromptSampler,
        model_dir: Path,
        pending: list[dict],
    ) -> None:
        """Set up; :meth:`start` sends the first weights.

        Args:
            cfg: the run.
            link: to the generator (used by trainer rank 0 only).
            policy: whose weights are sent.
            model_dir: the Hugging Face folder the generator builds its engine from.
            sampler: at the generator's position (a resumed run's: after the pending rollouts).
            pending: the checkpoint's rollouts made ahead (``pending_rollouts``; empty for a fresh run).
        """
        self.cfg, self.link, self.policy, self.sampler, self.model_dir = cfg, link, policy, sampler, model_dir
        self.leader = distributed.rank() == 0
        # step -> rollouts received and not yet trained on (a resumed run starts with the checkpoint's)
        self.pending: dict[int, dict] = {
            m["step"]: {**m, "records": [QuestionRollouts.from_dict(r) for r in m["records"]]} for m in pending
        }
        self.validations: dict[int, dict] = {}
        self.sampler_state = sampler.state_dict()  # the generator's position after the newest rollouts received

    def start(self, step: int, validate_seed: int | None) -> None:
        """Send the weights after ``step`` steps with where to start (collective over the trainer)."""
        start = {"model_dir": str(self.model_dir), "next_step": step + 1 + len(self.pending)}
        start["sampler"] = self.sampler_state
        self._send(step, validate_seed, more=True, start=start)

    def _send(self, step: int, validate_seed: int | None, *, more: bool, start: dict | None = None) -> None:
        if self.leader:
            head = {"kind": "weights", "version": step, "validate": validate_seed, "generate": more, "start": start}
            self.link.send_down(head)
        bucket = self.cfg.generation.refit_bucket_mb * 2**20
        send_weights(self.link if self.leader else None, self.policy.export_weights(), bucket)

    def _receive(self, kind: str, step: int) -> dict:
        """Trainer rank 0 reads up-messages until ``kind`` for ``step`` (others are kept for later)."""
        box = self.pending if kind == "rollouts" else self.validations
        while step not in box:
            msg = self.link.recv_up()
            if msg["kind"] == "rollouts":
                self.pending[msg["step"]] = msg
                if "failed" not in msg:
                    self.sampler_state = msg["sampler"]
            else:
                self.validations[msg["step"]] = msg
        return box.pop(step)

    def next(self, step: int) -> tuple[list[QuestionRollouts], dict[str, float]]:
        """Wait for step ``step``'s rollouts (made while earlier steps trained) and share them over the trainer."""
        t0 = time.perf_counter()
        msg = self._receive("rollouts", step) if self.leader else None
        msg = distributed.broadcast_object(msg, src=0)
        if "failed" in msg:  # too many of the step's rewards failed: the generator is told to stop, the run ends
            if self.leader:
                self.link.send_down({"kind": "stop", "code": 0})  # quietly: this error is the run's one line
            raise rollouter.RewardError(msg["failed"])
        wait = time.perf_counter() - t0
        metrics = {**msg["metrics"], "timing/wait_rollouts": wait, **staleness_metrics(step, msg["version"])}
        return msg["records"], metrics

    def weights_changed(self) -> None:
        """Nothing: the weights go out once per step (:meth:`publish`)."""

    def publish(self, step: int, *, validate_seed: int | None, more: bool) -> float:
        """Send the weights after ``step`` (when the generator will sample or validate with them)."""
        if not more and validate_seed is None:
            return 0.0
        t0 = time.perf_counter()
        self._send(step, validate_seed, more=more)
        return time.perf_counter() - t0

    def validate(self, step: int, seed: int) -> tuple[list[float], dict[str, float]]:
        """The generator's validation of the weights after ``step`` (asked for by :meth:`publish`)."""
        msg = self._receive("validation", step) if self.leader else None
        msg = distributed.broadcast_object(msg, src=0)
        return msg["per_problem"], msg["failures"]

    def state_dict(self, step: int) -> dict[str, Any]:
        """The rollouts made for the steps after ``step`` (waits for them) and the sampler's position after them.

        Only trainer rank 0's is complete (it writes the checkpoint's trainer state).
        """
        if self.leader:
            last = min(step + self.cfg.algorithm.max_staleness, self.cfg.algorithm.steps)
            for s in range(step + 1, last + 1):
                self.pending[s] = self._receive("rollouts", s)
                if "failed" in self.pending[s]:  # the run stops at that step; a resume generates it again
                    break
        pending = [
            {**m, "records": [r.to_dict() for r in m["records"]]}
            for _, m in sorted(self.pending.items())
            if "failed" not in m
        ]
        return {"sampler": self.sampler_state, "pending_rollouts": pending}

    def close(self, code: int | None) -> None:
        """Tell the generator to stop with ``code`` (nothing after an error: the watchdog ends it)."""
        if code is not None and self.leader:
            self.link.send_down({"kind": "stop", "code": code})


# ----------------------------------------------------------------------------------------------------------------------
# The generator's side


class _Sender:
    """Sends up-messages in order from a thread of its own, so the generator takes new weights meanwhile."""

    def __init__(self, link: distributed.Link | None) -> None:
        self.link = link
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="nemo-disco-rollout-sender", daemon=True)
        if link is not None:
            self.thread.start()

    def put(self, msg: dict) -> None:
        if self.error is not None:
            raise RuntimeError(f"sending rollouts to the trainer failed: {self.error}") from self.error
        if self.link is not None:
            self.queue.put(msg)

    def _run(self) -> None:
        while True:
            msg = self.queue.get()
            if msg is None:
                return
            try:
                self.link.send_up(msg)
            except BaseException as err:  # reported by the next put, or at the end
                self.error = err
                return

    def flush(self) -> None:
        if self.link is not None:
            self.queue.put(None)
            self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"sending rollouts to the trainer failed: {self.error}") from self.error


def serve(
    cfg: RunConfig, env: distributed.DistEnv, link: distributed.Link, wd: Any, loaded: RunProblems | None = None
) -> int:
    """The generator's processes: sample, grade and send rollouts one step ahead until the trainer says stop.

    ``loaded``: ``data.train`` and ``data.val`` already parsed (None: parsed here).

    Returns:
        The exit code the trainer asked for.
    """
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):  # the trainer decides (it checkpoints, then stops us)
        signal.signal(sig, signal.SIG_IGN)
    head = link.recv_down()
    start = head["start"]
    model_dir = Path(start["model_dir"])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    max_prompt_tokens, prompts_per_step = cfg.generation.max_prompt_tokens, cfg.algorithm.prompts_per_step
    problems, prompt_ids, _, _ = train_problems(
        cfg.data, tokenizer, max_prompt_tokens=max_prompt_tokens, prompts_per_step=prompts_per_step, loaded=loaded
    )
    sampler = new_sampler(cfg.data, len(problems), prompts_per_step)
    sampler.load_state_dict(start["sampler"])
    val = val_problems(cfg.data, tokenizer, max_prompt_tokens=max_prompt_tokens, loaded=loaded)
    ro = rollouter.build_rollouter(
        cfg, env, tokenizer, problems, prompt_ids, sampler, factory.build_run_generator(cfg, model_dir)
    )
    sender = _Sender(link if env.rank == 0 else None)
    a = cfg.algorithm
    next_step = start["next_step"]
    failed = False  # a step's rewards failed (reward.max_error_share): the trainer stops at it, nothing more to make
    try:
        while True:
            if head["kind"] == "stop":
                sender.flush()
                return int(head["code"])
            version = head["version"]
            with wd.phase("step", f"generator: weights of step {version}"):
                ro.generator.update_weights(receive_weights(link))
            if head["validate"] is not None:
                with wd.phase("validation", f"generator: validation after step {version}"):
                    per_problem, failures = ro.validate(*val, cfg.data.val_samples, head["validate"])
                sender.put({"kind": "validation", "step": version, "per_problem": per_problem, "failures": failures})
            while (
                head["generate"] and not failed and next_step <= a.steps and version >= next_step - 1 - a.max_staleness
            ):
                with wd.phase("step", f"generator: rollouts of step {next_step}"):
                    try:
                        records, metrics = rollouter.step_rollouts(ro, next_step)
                    except rollouter.RewardError as err:  # the trainer ends the run with it, in one line
                        sender.put({"kind": "rollouts", "step": next_step, "version": version, "failed": str(err)})
                        failed = True
                        break
                msg = {"kind": "rollouts", "step": next_step, "version": version, "records": records}
                sender.put({**msg, "metrics": metrics, "sampler": sampler.state_dict()})
                next_step += 1
            head = link.recv_down()
    finally:
        ro.close()
