"""The grading worker processes: :class:`GraderPool` (hard per-item timeouts, kill and replace), :func:`score_batch`."""

from __future__ import annotations

import json
import logging
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from nemo_disco import hooks
from nemo_disco.rewards.registry import get_grader
from nemo_disco.rewards.scoring import call_reward, grade, load_reward_function

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------------------------
# Worker process


class _SoftTimeout(BaseException):
    """Raised by the worker's SIGALRM handler; a BaseException so that ``except Exception`` in parsers lets it pass."""


def _on_alarm(signum: int, frame: object) -> None:
    raise _SoftTimeout


def _ignore_job_signals() -> None:
    """Slurm signals every process of a job step; grading workers leave SIGUSR1 / SIGTERM / SIGINT to the trainer.

    (Ignored dispositions survive exec, so the worker is covered from its first instruction; the parent
    still stops a stuck worker with SIGKILL, and a worker exits on its own when its stdin closes.)
    """
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)


def worker_main() -> None:
    """Worker loop: one JSON request per stdin line, one JSON result per line on the original stdout."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # stray prints from libraries go to stderr, not into the protocol
    cfg = json.loads(os.environ["NEMO_DISCO_GRADER"])
    limit_mb = cfg["memory_limit_mb"]
    if limit_mb:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (limit_mb << 20, limit_mb << 20))
    logging.basicConfig(level=logging.ERROR)
    user = load_reward_function(cfg["function"]) if cfg.get("function") else None
    if user is None:
        # Imports and the parsers' first-call set-up are paid before "ready", not out of the first item's budget.
        grade("</think> so \\boxed{\\frac{1}{2}}", "0.5", cfg["grader"], cfg["params"])
    signal.signal(signal.SIGALRM, _on_alarm)
    out.write('{"ready": true}\n')
    for line in sys.stdin:
        req = json.loads(line)
        result: dict[str, Any] = {"score": 0.0}
        try:
            signal.setitimer(signal.ITIMER_REAL, cfg["soft_timeout_s"])  # 0 = no soft limit
            try:
                if user is None:
                    result["score"] = grade(req["response"], req["truth"], cfg["grader"], cfg["params"])
                else:
                    args = (req["response"], req["truth"], req.get("problem", ""), req.get("fields") or {})
                    result["score"] = call_reward(user, *args)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _SoftTimeout:
            result["timeout"] = True
        except Exception as err:  # any grading failure is an error that scores 0, the worker carries on
            # Only the type: str() of a sympy object in the message can itself run for minutes.
            result["error"] = type(err).__name__
            if user is not None:  # user code: its traceback is what its author needs (logged once by the pool)
                import traceback

                result["traceback"] = traceback.format_exc(limit=-8)[-4000:]
                first = str(err).strip().splitlines()[0][:300] if str(err).strip() else ""
                result["error"] = f"{type(err).__name__}: {first}" if first else type(err).__name__
        out.write(json.dumps(result) + "\n")


# ----------------------------------------------------------------------------------------------------------------------
# Parent side: the pool


class _Worker:
    """One grading subprocess and its read buffer."""

    def __init__(self, env: dict[str, str]) -> None:
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from nemo_disco.rewards.pool import worker_main; worker_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env=env,
            preexec_fn=_ignore_job_signals,
        )
        assert self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)
        self.buffer = b""
        self.ready = False
        self.started = time.monotonic()
        self.item: int | None = None
        self.deadline = 0.0

    def send(self, payload: bytes) -> bool:
        """Write one request; False if the worker is gone."""
        hooks.point("grader_send", process=self.proc)
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(payload)
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def read_lines(self) -> tuple[list[bytes], bool]:
        """Complete lines available now, and whether the worker closed its output (exited)."""
        eof = False
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                eof = True
                break
            self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return lines, eof

    def stderr_tail(self) -> str:
        self.stderr.seek(0)
        lines = self.stderr.read().decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(no output)"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()  # type: ignore[union-attr]
            except OSError:
                pass
        self.stderr.close()


def _shutdown(workers: list[_Worker]) -> None:
    for w in workers:
        try:
            w.proc.stdin.close()  # type: ignore[union-attr]  (EOF: the worker loop ends)
        except OSError:
            pass
    deadline = time.monotonic() + 2.0
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        w.kill()
    workers.clear()


class GraderPool:
    r"""Persistent grading workers with a hard per-item timeout; reuse one across training steps.

    Starting a worker costs about 0.6 s (process start + ``import math_verify``); workers start in the
    background when the pool is created and are replaced when one is killed.

    Example:
        >>> with GraderPool("math_verify", timeout_s=5.0, workers=2) as pool:
        ...     scores, metrics = pool.score(["so \\boxed{2}"], ["2"])
    """

    def __init__(
        self,
        grader: str = "math_verify",
        *,
        timeout_s: float,
        workers: int,
        params: Mapping[str, Any] | None = None,
        kill_grace_s: float = 0.5,
        memory_limit_mb: int | None = 4096,
        startup_timeout_s: float = 120.0,
        soft_timeout: bool = True,
        function: str | None = None,
    ) -> None:
        """Start the workers.

        Args:
            grader: a registered grader (:data:`~nemo_disco.rewards.registry.GRADERS`; unused with ``function``).
            timeout_s: time budget of one item; the worker stops itself at ``timeout_s``.
            workers: number of worker processes.
            params: the grader's parameters (its model's defaults for those left out; deepscaler's
                ``{"require_think": True}``: a response without ``</think>`` scores 0, the official rule).
            kill_grace_s: the parent kills a worker whose item runs past ``timeout_s + kill_grace_s``.
            memory_limit_mb: address-space limit of each worker (None: unlimited).
            startup_timeout_s: a worker that is not ready after this long is a fatal error.
            soft_timeout: let the worker interrupt itself at ``timeout_s`` (SIGALRM). With False only the
                parent's kill at ``timeout_s + kill_grace_s`` limits an item (each costs a worker restart).
            function: ``reward.function`` ("package.module:function"): the workers call it instead of a grader.

        Raises:
            ValueError: unknown grader or parameter, non-positive sizes, or a ``function`` that does not load (one
                line).
        """
        bound = get_grader(grader).bind(params).model_dump(mode="json")
        if function is not None:
            load_reward_function(function)  # fail here, in one line, not in every worker's start-up
        if timeout_s <= 0 or workers < 1 or kill_grace_s < 0:
            raise ValueError(
                f"GraderPool needs timeout_s > 0, workers >= 1, kill_grace_s >= 0 (got {timeout_s}, "
                f"{workers}, {kill_grace_s})"
            )
        self.grader, self.timeout_s, self.kill_grace_s = grader, float(timeout_s), float(kill_grace_s)
        #: The grader's parameters as the workers get them (every key, defaults filled in).
        self.params = bound
        self.startup_timeout_s = startup_timeout_s
        env = dict(os.environ)
        package_root = str(Path(__file__).resolve().parents[2])  # the folder that holds nemo_disco/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH", "")) if p)
        env["NEMO_DISCO_GRADER"] = json.dumps(
            {
                "grader": grader,
                "soft_timeout_s": self.timeout_s if soft_timeout else 0.0,
                "params": bound,
                "memory_limit_mb": memory_limit_mb,
                "function": function,
            }
        )
        if function is not None:  # the workers import it from the trainer's current folder too
            env["PYTHONPATH"] = os.pathsep.join((env["PYTHONPATH"], os.getcwd()))
        self.function = function
        self._error_logged = self._timeout_logged = False
        #: The first failed item's one-line description in the last :meth:`score` call (None: no item failed).
        self.first_error: str | None = None
        self._env = env
        self._workers: list[_Worker] = [_Worker(env) for _ in range(workers)]
        self._finalizer = weakref.finalize(self, _shutdown, self._workers)
        self.restarts = 0

    def __enter__(self) -> GraderPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every worker (idempotent)."""
        self._finalizer()

    @property
    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (they change when a stuck worker is replaced)."""
        return [w.proc.pid for w in self._workers]

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self._env)
        self._workers[self._workers.index(worker)] = fresh
        self.restarts += 1
        return fresh

    def _failed(self, what: str) -> None:
        """Note one failed item (an error or a timeout): the first of a :meth:`score` call is kept in one line."""
        if self.first_error is None:
            self.first_error = what

    def _timed_out(self) -> None:
        subject = f"reward.function {self.function}" if self.function else f"grader {self.grader}"
        self._failed(f"{subject} ran past reward.timeout_s={self.timeout_s:g} s on an item")
        if self.function is not None and not self._timeout_logged:  # a hanging function is seen at once, not later
            self._timeout_logged = True
            logger.warning(
                "reward.function %s ran past reward.timeout_s=%g s on an item (scored 0, counted in reward/timeouts; "
                "logged once)",
                self.function,
                self.timeout_s,
            )

    def _lost(self, worker: _Worker, item: int, pending: deque, retried: set[int], scores: list[float]) -> int:
        """``worker`` died holding ``item``: replace it and queue the item again once; returns the errors to count."""
        code = worker.proc.poll()
        worker.item = None
        self._replace(worker)
        if item in retried:
            scores[item] = 0.0
            self._failed(f"the grading worker died (exit {code}) on an item twice")
            logger.warning(
                "grader worker died (exit %s) on item %d a second time: scored 0 (reward/errors)", code, item
            )
            return 1
        retried.add(item)
        pending.appendleft(item)
        logger.warning("grader worker died (exit %s) while grading item %d: graded again on a fresh worker", code, item)
        return 0

    def score(
        self,
        responses: Sequence[str],
        ground_truths: Sequence[str | list[str]],
        problems: Sequence[str] | None = None,
        fields: Sequence[dict[str, Any]] | None = None,
    ) -> tuple[list[float], dict[str, float]]:
        """Grade ``responses[i]`` against ``ground_truths[i]``; order is preserved.

        ``problems`` and ``fields`` (the question text and the row's other columns of each item) reach a
        ``reward.function``; the math graders ignore them.

        Returns:
            scores (1.0 / 0.0 each) and metrics ``reward/timeouts``, ``reward/errors``, ``reward/restarts``. A failed
            item (an error, a timeout) scores 0; :attr:`first_error` describes the call's first in one line.

        Raises:
            ValueError: the two sequences differ in length.
            RuntimeError: the pool is closed or a worker cannot start (its last stderr line is quoted).
        """
        if len(responses) != len(ground_truths):
            raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
        if not self._finalizer.alive:
            raise RuntimeError("GraderPool is closed")
        n = len(responses)
        scores = [0.0] * n
        timeouts = errors = 0
        self.first_error = None
        restarts_before = self.restarts
        pending = deque(range(n))
        retried: set[int] = set()
        done = 0
        sel = selectors.DefaultSelector()
        try:
            while done < n:
                now = time.monotonic()
                for w in self._workers:
                    if w.ready and w.item is None and pending:
                        i = pending.popleft()
                        request: dict[str, Any] = {"response": responses[i], "truth": ground_truths[i]}
                        if self.function is not None:
                            request["problem"] = problems[i] if problems is not None else ""
                            request["fields"] = fields[i] if fields is not None else {}
                        payload = json.dumps(request) + "\n"
                        w.item, w.deadline = i, time.monotonic() + self.timeout_s + self.kill_grace_s
                        if not w.send(payload.encode()):  # the worker is gone
                            errors += self._lost(w, i, pending, retried, scores)
                            done += i not in pending
                    elif not w.ready and now - w.started > self.startup_timeout_s:
                        raise RuntimeError(
                            f"grader worker not ready after {self.startup_timeout_s:.0f} s: {w.stderr_tail()}"
                        )
                if done == n:
                    break
                busy = [w.deadline for w in self._workers if w.item is not None]
                wait = max(0.0, min(busy) - time.monotonic()) if busy else 1.0
                for w in self._workers:
                    sel.register(w.fd, selectors.EVENT_READ, w)
                events = sel.select(timeout=wait)
                for key in list(sel.get_map().values()):
                    sel.unregister(key.fileobj)
                for key, _ in events:
                    w = key.data
                    lines, eof = w.read_lines()
                    for line in lines:
                        msg = json.loads(line)
                        if msg.get("ready"):
                            w.ready = True
                            continue
                        i, w.item = w.item, None
                        if i is None:
                            continue
                        scores[i] = float(msg["score"])
                        timeouts += bool(msg.get("timeout"))
                        errors += "error" in msg
                        if msg.get("timeout"):
                            self._timed_out()
                        elif "error" in msg:
                            subject = f"reward.function {self.function}" if self.function else f"grader {self.grader}"
                            self._failed(f"{subject} failed on an item: {msg['error']}")
                        if "traceback" in msg and not self._error_logged:
                            self._error_logged = True
                            logger.warning(
                                "reward.function %s raised on an item (scored 0, counted in reward/errors; logged "
                                "once):\n%s",
                                self.function,
                                msg["traceback"],
                            )
                        done += 1
                    if eof:
                        if not w.ready:
                            code = w.proc.wait()
                            raise RuntimeError(f"grader worker exited during start-up (code {code}): {w.stderr_tail()}")
                        if w.item is not None:  # died mid-item (killed, out of memory, a crash in C code)
                            i = w.item
                            errors += self._lost(w, i, pending, retried, scores)
                            done += i not in pending
                        else:
                            self._replace(w)
                now = time.monotonic()
                for w in list(self._workers):
                    if w.item is not None and now >= w.deadline:
                        timeouts += 1
                        done += 1
                        self._timed_out()
                        self._replace(w)
        finally:
            sel.close()
            # Interrupted (e.g. KeyboardInterrupt): a busy worker's late answer must not be read as the next
            # call's result, so busy workers are replaced.
            for w in list(self._workers):
                if w.item is not None:
                    self._replace(w)
        return scores, {
            "reward/timeouts": float(timeouts),
            "reward/errors": float(errors),
            "reward/restarts": float(self.restarts - restarts_before),
        }


def score_batch(
    responses: Sequence[str],
    ground_truths: Sequence[str | list[str]],
    *,
    grader: str = "math_verify",
    timeout_s: float,
    workers: int,
    params: Mapping[str, Any] | None = None,
) -> tuple[list[float], dict[str, float]]:
    """Grade a batch in a temporary :class:`GraderPool` (hard per-item timeout); order is preserved.

    Returns:
        scores and metrics (``reward/timeouts``, ``reward/errors``, ``reward/restarts``).
    """
    with GraderPool(grader, timeout_s=timeout_s, workers=workers, params=params) as pool:
        return pool.score(responses, ground_truths)
