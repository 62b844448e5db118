"""Step watchdog and dead-rank detection: every fault ends the run in a bounded time with a message naming its cause.

One :class:`Watchdog` per training process runs a daemon thread that wakes every ``interval`` seconds and

- **times the phase in progress** (a training step, a validation, a checkpoint save). A phase that runs past
  ``max(cluster.step_timeout_s, 2 x the slowest phase of its kind so far)`` is a hang: the rank prints a line
  naming the phase and its limit, writes the Python stacks of all its threads to stderr and to
  ``<run_dir>/stacks/`` (faulthandler), posts a stop notice and exits with :data:`EXIT_HUNG`; the other ranks
  read the notice, write their stacks too and exit with the same code. ``slurm/train.sbatch`` requeues on it
  (a transient hang costs the current step, not the allocation). A C-level faulthandler timer backs the thread
  up should a hang hold the interpreter lock (it exits with code 1);
- **beats a heartbeat** and watches the next rank's (``rank + 1`` modulo the world): a rank whose heartbeat has
  not moved for :func:`silence_limit` seconds died (SIGKILL, the OOM killer), froze (SIGSTOP, a hung driver) or
  lost its node. The watching rank posts a stop notice naming it (rank, host, pid) and every rank exits with
  :data:`EXIT_PEER`;
- **reads stop notices** posted by any rank, so that every rank stops together, with the same cause, even when
  its main thread is blocked in a collective that will never return.

Heartbeats and notices travel through the job's rendezvous store on a connection of the watchdog's own
(:func:`nemo_disco.distributed.store_client`), not through collectives. When the main thread catches an
exception, :meth:`Watchdog.on_error` first waits a few heartbeats: if a peer died or posted a notice, that is
the cause reported (a collective failing on a dead peer is a symptom); otherwise this rank's own error is
posted for the others and re-raised.

Exit codes: :data:`EXIT_HUNG` (4) a phase ran past its limit; :data:`EXIT_PEER` (5) another rank died, froze,
failed or became unreachable (the log names it). Both exits use ``os._exit``: a process whose peer is gone
cannot leave its collectives cleanly.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nemo_disco import distributed

#: A training step, validation or checkpoint save ran past its limit (stacks in the log); requeue-able.
EXIT_HUNG = 4
#: Another rank died, froze, failed or became unreachable (named in the log).
EXIT_PEER = 5

#: The limit of a phase is this many times the slowest phase of the same kind so far (or the floor).
SLOWEST_FACTOR = 2.0
#: Silence limit when the step watchdog is off (cluster.step_timeout_s=0), and its upper bound otherwise.
MAX_SILENCE_S = 60.0
MIN_SILENCE_S = 5.0
#: Heartbeats per silence limit.
BEATS_PER_SILENCE = 10
#: A rank that posts a notice waits this many heartbeats before it exits, so that its peers read the notice
#: (under srun rank 0 serves the store: once it exits, the store is gone).
LINGER_BEATS = 3


def silence_limit(step_timeout_s: float) -> float:
    """Seconds without a heartbeat after which a rank is declared gone: ``min(60, max(5, step_timeout_s / 4))``.

    60 s when the step watchdog is off (``step_timeout_s == 0``).
    """
    if step_timeout_s <= 0:
        return MAX_SILENCE_S
    return min(MAX_SILENCE_S, max(MIN_SILENCE_S, step_timeout_s / 4))


def phase_limit(floor_s: float, slowest_s: float | None) -> float:
    """The limit of a phase: ``max(floor_s, SLOWEST_FACTOR x slowest_s)`` (the floor alone before any)."""
    return max(floor_s, SLOWEST_FACTOR * slowest_s) if slowest_s is not None else floor_s


class Watchdog:
    """The step watchdog and peer monitor of one training process (see the module docstring).

    Use :meth:`start` once the process group exists, wrap each step / validation / save in :meth:`phase`,
    call :meth:`on_error` from an ``except`` block, and :meth:`stop` when the run ends normally.
    """

    def __init__(
        self,
        step_timeout_s: float,
        *,
        rank: int = 0,
        world_size: int = 1,
        stacks_dir: Path | None = None,
        store: Any | None = None,
        emit: Callable[[str], None] | None = None,
    ) -> None:
        """Set up (nothing runs before :meth:`start`).

        Args:
            step_timeout_s: ``cluster.step_timeout_s`` (the floor of every phase limit; 0 = no phase limits).
            rank: this process's global rank.
            world_size: processes in the job.
            stacks_dir: folder for the stack dumps of a hang (None: stderr only).
            store: the job's key-value store (:func:`nemo_disco.distributed.store_client`); None for one process.
            emit: where messages go (default: a line on stderr).
        """
        self.floor_s = float(step_timeout_s)
        self.rank, self.world_size = rank, world_size
        self.stacks_dir = stacks_dir
        self.store = store if world_size > 1 else None
        self.silence_s = silence_limit(step_timeout_s)
        self.interval_s = self.silence_s / BEATS_PER_SILENCE
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.slowest: dict[str, float] = {}
        self._emit = emit or _write_line
        self._phase: tuple[str, str, float, float] | None = None  # kind, label, start, limit
        self._lock = threading.Lock()
        self._exit_lock = threading.Lock()
        self._store_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._store_failed_at: float | None = None
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self._prefix = f"nemo_disco/{restart}/"
        self._neighbour = (rank + 1) % world_size if world_size > 1 else None
        self._neighbour_beats: int | None = None
        self._neighbour_moved_at = 0.0

    # -- lifecycle ---------------------------------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Whether a thread is needed: phase limits are on or there are peers to watch."""
        return self.floor_s > 0 or self.store is not None

    def start(self) -> None:
        """Register this rank in the store and start the thread."""
        if not self.active or self._thread is not None:
            return
        if self.store is not None:
            self._store_op(lambda s: s.set(self._key(f"who/{self.rank}"), f"{self.host} {self.pid}"))
            self._store_op(lambda s: s.add(self._key(f"beat/{self.rank}"), 1))
        self._neighbour_moved_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="nemo-disco-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """The run ends normally (done or preempted): tell the peers, stop the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval_s + 5)
            self._thread = None
        faulthandler.cancel_dump_traceback_later()
        if self.store is not None:
            # A large negative count marks this rank as finished: its silence from now on is not a fault.
            self._store_op(lambda s: s.add(self._key(f"beat/{self.rank}"), -(1 << 60)))

    # -- phases ------------------------------------------------------------------------------------------------

    def limit(self, kind: str) -> float:
        """The current limit of a phase of ``kind`` (seconds)."""
        return phase_limit(self.floor_s, self.slowest.get(kind))

    @contextlib.contextmanager
    def phase(self, kind: str, label: str) -> Iterator[None]:
        """Time the enclosed block as a phase of ``kind`` ("step", "validation", "checkpoint") named ``label``."""
        if self.floor_s <= 0:
            yield
            return
        limit = self.limit(kind)
        start = time.monotonic()
        with self._lock:
            self._phase = (kind, label, start, limit)
        # Backstop for a hang that holds the interpreter lock (the thread below cannot run then).
        faulthandler.dump_traceback_later(limit + self.silence_s, exit=True)
        ok = False
        try:
            yield
            ok = True
        finally:
            faulthandler.cancel_dump_traceback_later()
            with self._lock:
                self._phase = None
            if ok:
                elapsed = time.monotonic() - start
                self.slowest[kind] = max(self.slowest.get(kind, 0.0), elapsed)

    # -- errors in the main thread -----------------------------------------------------------------------------

    def on_error(self, err: BaseException, *, wait: bool = True) -> None:
        """The main thread caught ``err``: report the root cause (may not return).

        With ``wait``, first waits three heartbeats: if another rank posted a stop notice, or a rank went silent
        (a collective that fails because a peer died is a symptom of that), this rank prints that cause and exits
        with its code. Otherwise ``err`` is this rank's own failure: it is posted for the other ranks and the call
        returns (the caller re-raises it). Without ``wait`` (an error every rank meets at the same point, such as
        a bad config) the thread just stops: each rank ends with its own error and exit code, and a rank that did
        not meet it sees this one go silent.
        """
        if self._exit_lock.locked():  # the thread is exiting with the root cause (a hang, a dead peer)
            self._wait_for_exit()
        if not wait or self.store is None:
            self._stop.set()
            self._claim_exit()
            return
        before = self._all_beats()
        window = 3 * self.interval_s + 1.0
        deadline = time.monotonic() + window
        while time.monotonic() < deadline:
            notice = self._read_notice()
            if notice is not None and notice["rank"] != self.rank:
                self._obey(notice)
            time.sleep(self.interval_s / 2)
        after = self._all_beats()
        silent = [r for r in range(self.world_size) if r != self.rank and _silent(before.get(r), after.get(r))]
        if silent:
            self._declare_silent(silent[0], waited_s=window, after=f"{type(err).__name__} in this rank")
        # This rank ends with its own error: its thread must not report the peers that stop after it.
        self._stop.set()
        self._claim_exit()
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        self._post(EXIT_PEER, f"rank {self.rank} ({self.host}, pid {self.pid}) failed: {type(err).__name__}: {first}")
        if self._store_failed_at is None:
            time.sleep(LINGER_BEATS * self.interval_s)  # the peers read the notice (rank 0 may serve the store)

    # -- the thread --------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            if self.store is not None and self._store_failed_at is None:
                self._store_op(lambda s: s.add(self._key(f"beat/{self.rank}"), 1))
                notice = self._read_notice()
                if notice is not None and notice["rank"] != self.rank:
                    self._obey(notice)
                self._watch_neighbour(now)
            if self._store_failed_at is not None and now - self._store_failed_at > self.silence_s:
                self._stop_now(
                    EXIT_PEER,
                    f"the job's store at {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} has been "
                    f"unreachable for {now - self._store_failed_at:.0f} s: the process serving it (rank 0 under "
                    "srun, the torchrun agent under torchrun) or its node is gone",
                    post=False,
                )
            with self._lock:
                phase = self._phase
            if phase is not None and now - phase[2] > phase[3]:
                self._hang(*phase, now)

    def _watch_neighbour(self, now: float) -> None:
        nb = self._neighbour
        if nb is None:
            return
        beats = self._store_op(lambda s: s.add(self._key(f"beat/{nb}"), 0))
        if beats is None:
            return
        if beats < 0:  # finished normally
            self._neighbour = None
            return
        if beats != self._neighbour_beats:
            self._neighbour_beats, self._neighbour_moved_at = beats, now
        elif now - self._neighbour_moved_at > self.silence_s:
            self._declare_silent(nb, waited_s=now - self._neighbour_moved_at)

    def _hang(self, kind: str, label: str, start: float, limit: float, now: float) -> None:
        slowest = self.slowest.get(kind)
        why = f"cluster.step_timeout_s={self.floor_s:g}" + (
            f", slowest {kind} so far {slowest:.1f} s" if slowest is not None else ""
        )
        self._stop_now(
            EXIT_HUNG, f"{label} has run for {now - start:.1f} s, over its limit of {limit:.1f} s ({why})", stacks=True
        )

    def _declare_silent(self, peer: int, waited_s: float, after: str | None = None) -> None:
        who = self._store_op(lambda s: s.get(self._key(f"who/{peer}")) if s.check([self._key(f"who/{peer}")]) else b"")
        host, _, pid = (who or b"").decode().partition(" ")
        when = f" (the {waited_s:.1f} s after a {after})" if after else ""
        self._stop_now(
            EXIT_PEER,
            f"rank {peer} ({host or 'host unknown'}, pid {pid or '?'}) sent no heartbeat for {waited_s:.1f} s{when}: "
            "it died (killed, out of memory?), froze, or its node was lost",
        )

    def _obey(self, notice: dict[str, Any]) -> None:
        code = int(notice["code"])
        message = f"stopping: rank {notice['rank']} reported: {notice['message']}"
        self._stop_now(code, message, post=False, stacks=code == EXIT_HUNG, label=notice.get("label"))

    def _claim_exit(self) -> None:
        """Become the one thread that ends the process, or wait for the one that already does.

        The watchdog thread exits with ``os._exit`` after lingering; a main thread that returned from
        :meth:`on_error` meanwhile would end the process first with its own, secondary error (exit 1).
        """
        if not self._exit_lock.acquire(blocking=False):
            self._wait_for_exit()

    @staticmethod
    def _wait_for_exit() -> None:
        """Block this thread: the other one is printing the cause and will ``os._exit`` the process."""
        while True:
            time.sleep(60)

    def _stop_now(
        self, code: int, message: str, *, post: bool = True, stacks: bool = False, label: str | None = None
    ) -> None:
        """Print ``message``, optionally post it and dump the stacks, and exit with ``code``."""
        self._claim_exit()
        faulthandler.cancel_dump_traceback_later()
        head = f"nemo-disco: {_now()} rank {self.rank} ({self.host}, pid {self.pid}): {message}"
        if post:
            self._post(code, message)
        dump = self._stack_file(label) if stacks else None
        tail = f"; Python stacks follow{f' (also in {dump})' if dump else ''}" if stacks else ""
        self._emit(f"{head}{tail}; exiting with code {code}")
        if stacks:
            _dump_stacks(dump)
        if self.store is not None and self._store_failed_at is None:
            time.sleep(LINGER_BEATS * self.interval_s)  # the peers read the notice (rank 0 may serve the store)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    # -- the store ---------------------------------------------------------------------------------------------

    def _key(self, name: str) -> str:
        return self._prefix + name

    def _store_op(self, op: Callable[[Any], Any]) -> Any:
        """Run ``op(store)``; on a store error remember when the store was first lost and return None."""
        if self.store is None or self._store_failed_at is not None:
            return None
        try:
            with self._store_lock:
                return op(self.store)
        except Exception:  # noqa: BLE001  (the store's host is gone: judged after silence_s, see _run)
            self._store_failed_at = time.monotonic()
            return None

    def _post(self, code: int, message: str) -> None:
        """Post a stop notice (the first one posted wins: every rank reports the same cause)."""
        with self._lock:
            label = self._phase[1] if self._phase else None
        notice = json.dumps({"code": code, "rank": self.rank, "message": message, "label": label})
        self._store_op(lambda s: s.compare_set(self._key("notice"), "", notice))

    def _read_notice(self) -> dict[str, Any] | None:
        key = self._key("notice")
        raw = self._store_op(lambda s: s.get(key) if s.check([key]) else None)
        return json.loads(raw) if raw else None

    def _all_beats(self) -> dict[int, int]:
        out = {}
        for r in range(self.world_size):
            beats = self._store_op(lambda s, r=r: s.add(self._key(f"beat/{r}"), 0))
            if beats is not None:
                out[r] = beats
        return out

    def _stack_file(self, label: str | None) -> Path | None:
        """``<stacks_dir>/<phase>-rank<r>-pid<p>.txt``: this rank's phase, else the reporting rank's."""
        if self.stacks_dir is None:
            return None
        with self._lock:
            label = self._phase[1] if self._phase else label
        name = f"{(label or 'run').replace(' ', '_')}-rank{self.rank}-pid{self.pid}.txt"
        try:
            self.stacks_dir.mkdir(parents=True, exist_ok=True)
        except OSError:
            return None
        return self.stacks_dir / name


def _write_line(line: str) -> None:
    """Write ``line`` to stderr on a line of its own, in one write.

    Every rank of a node shares the job's log: another rank's stack dump (many small writes) may be half-way
    through a line. One write of up to PIPE_BUF bytes is not split on a pipe, and the leading newline starts
    the message on a fresh line, so ``grep '^nemo-disco:'`` finds every rank's.
    """
    sys.stderr.flush()
    data = f"\n{line}\n".encode(errors="replace")
    try:
        os.write(sys.stderr.fileno(), data)
    except (OSError, ValueError):  # no file descriptor (a captured stream): write through Python
        print(line, file=sys.stderr, flush=True)


def _now() -> str:
    """Local wall time with milliseconds (log lines of different hosts can be lined up)."""
    t = time.time()
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) + f".{int(t * 1000) % 1000:03d}"


def _silent(before: int | None, after: int | None) -> bool:
    """A rank whose heartbeat count did not move (and that did not finish normally)."""
    return before is not None and after is not None and after == before and after >= 0


def _dump_stacks(path: Path | None) -> None:
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    if path is not None:
        try:
            with open(path, "w") as fh:
                faulthandler.dump_traceback(file=fh, all_threads=True)
        except OSError:
            pass


def from_env(step_timeout_s: float, run_dir: Path) -> Watchdog:
    """The watchdog of this process: rank and world from the process group, the job's store, stacks in run_dir."""
    silence = silence_limit(step_timeout_s)
    return Watchdog(
        step_timeout_s,
        # The launched ranks: with async rollouts, the trainer's and the generator's in one ring.
        rank=distributed.read_env().rank,
        world_size=distributed.read_env().world_size if distributed.is_initialized() else 1,
        stacks_dir=Path(run_dir) / "stacks",
        store=distributed.store_client(timeout_s=silence),
    )
