"""nemo_disco.watchdog: phase limits, hang exits with stacks, dead / frozen / failed peers through a real TCPStore.

Processes here run the real :class:`Watchdog` with a real c10d TCPStore (served by this test process) instead of a
process group: the watchdog only talks to the store, so a peer can be killed or stopped at a known moment.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nemo_disco import watchdog

ROOT = Path(__file__).resolve().parents[2]


def test_silence_and_phase_limits():
    # min(60, max(5, step_timeout_s / 4)): 1800 / 4 = 450 -> 60; 40 / 4 = 10; 8 / 4 = 2 -> 5; off -> 60.
    assert [watchdog.silence_limit(t) for t in (1800, 40, 8, 0)] == [60.0, 10.0, 5.0, 60.0]
    # max(floor, 2 x slowest): no phase yet -> the floor; slowest 700 s -> 1400 s > 1800? no -> 1800; 1000 -> 2000.
    assert watchdog.phase_limit(1800, None) == 1800
    assert watchdog.phase_limit(1800, 700) == 1800
    assert watchdog.phase_limit(1800, 1000) == 2000


def test_phase_limits_grow_with_the_slowest_phase_of_their_kind():
    wd = watchdog.Watchdog(0.2)
    with wd.phase("step", "step 1"):
        time.sleep(0.3)
    with wd.phase("checkpoint", "checkpoint step 1"):
        pass
    # The step took >= 0.3 s, so its limit is 2 x that (>= 0.6 s > the 0.2 s floor); checkpoints keep the floor.
    assert wd.limit("step") == pytest.approx(2 * wd.slowest["step"]) and wd.limit("step") >= 0.6
    assert wd.limit("checkpoint") == 0.2
    assert wd.limit("validation") == 0.2
    off = watchdog.Watchdog(0)
    assert not off.active
    with off.phase("step", "step 1"):
        pass
    assert off.slowest == {}


# A peer process: a Watchdog on the test's store, then a scenario.
PEER = textwrap.dedent(
    """
    import datetime, os, signal, sys, time
    from pathlib import Path
    import torch.distributed as dist
    from nemo_disco.watchdog import Watchdog

    rank, world, port, floor, scenario, stacks = sys.argv[1:7]
    rank, world = int(rank), int(world)
    store = dist.TCPStore("127.0.0.1", int(port), is_master=False, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=10))
    store.add("arrived", 1)  # a rendezvous first, as init_process_group makes one
    while store.add("arrived", 0) < world:
        time.sleep(0.05)
    wd = Watchdog(float(floor), rank=rank, world_size=world, stacks_dir=Path(stacks), store=store)
    wd.start()
    print("ready", flush=True)

    def stuck_in_a_step():
        while True:
            time.sleep(0.1)

    if scenario == "hang":
        with wd.phase("step", "step 3"):
            stuck_in_a_step()
    elif scenario == "idle":  # a healthy rank outside any phase (blocked, say, in a collective)
        time.sleep(120)
    elif scenario == "kill":
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)
    elif scenario == "stop":
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGSTOP)
    elif scenario == "fail":
        time.sleep(1.0)
        try:
            raise ValueError("bad row 7 in data.jsonl")
        except ValueError as err:
            wd.on_error(err)
            raise
    elif scenario == "hang_then_fail":  # its collective fails while its own watchdog is already exiting
        try:
            with wd.phase("step", "step 3"):
                while not list(Path(stacks).glob(f"*rank{rank}*")):  # written just before the linger
                    time.sleep(0.01)
                raise RuntimeError("Connection closed by peer")
        except RuntimeError as err:
            wd.on_error(err)
            raise
    elif scenario == "finish":
        time.sleep(1.0)
        wd.stop()
        print("finished", flush=True)
    """
)


@pytest.fixture()
def store():
    import torch.distributed as dist

    master = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    yield master


def _start(port: int, floor: float, scenarios: list[str], stacks: Path) -> list[subprocess.Popen]:
    """One process per scenario (rank = its index), started together; returns once every one is watching."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    world = len(scenarios)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PEER, str(rank), str(world), str(port), str(floor), scenario, str(stacks)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank, scenario in enumerate(scenarios)
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready", p.stderr.read()
    return procs


def _finish(procs: list[subprocess.Popen], timeout: float) -> list[tuple[int, str]]:
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            out.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def test_a_hung_phase_dumps_every_ranks_stacks_and_exits_4(store, tmp_path):
    # Floor 2 s -> silence limit 5 s, heartbeat 0.5 s. Rank 1 is stuck in Python inside "step 3"; rank 0 waits
    # outside any phase (as in a collective), so only the notice can stop it.
    start = time.monotonic()
    busy, hung = _start(store.port, 2.0, ["idle", "hang"], tmp_path)
    (code1, err1), (code0, err0) = _finish([hung, busy], timeout=60)
    elapsed = time.monotonic() - start
    assert (code1, code0) == (watchdog.EXIT_HUNG, watchdog.EXIT_HUNG), err1 + err0
    assert re.search(r"rank 1 \(\S+, pid \d+\): step 3 has run for 2\.\d s, over its limit of 2\.0 s", err1), err1
    assert "stuck_in_a_step" in err1  # the hung rank's stack
    # The waiting rank read the notice and wrote its stacks too.
    assert "stopping: rank 1 reported: step 3 has run" in err0 and "exiting with code 4" in err0
    assert 'File "<string>"' in err0
    assert elapsed < 30, elapsed
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [n.split("-pid")[0] for n in names] == ["step_3-rank0", "step_3-rank1"]
    assert "stuck_in_a_step" in (tmp_path / names[1]).read_text()


def test_an_error_while_the_watchdog_exits_does_not_replace_its_cause(store, tmp_path):
    # Rank 1's phase runs past its limit; while its watchdog thread lingers before exiting 4, its main thread
    # meets the secondary error (a peer closed the connection). The process still ends with the cause: 4, not 1.
    busy, hung = _start(store.port, 2.0, ["idle", "hang_then_fail"], tmp_path)
    (code1, err1), (code0, err0) = _finish([hung, busy], timeout=60)
    assert (code1, code0) == (watchdog.EXIT_HUNG, watchdog.EXIT_HUNG), err1 + err0
    assert "Connection closed by peer" not in err1, err1


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_a_dead_or_frozen_peer_is_named_within_the_silence_limit(store, tmp_path, fault):
    # Floor 8 s -> silence limit max(5, 8 / 4) = 5 s. Rank 1 dies (SIGKILL) or freezes (SIGSTOP) after 1 s.
    watcher, victim = _start(store.port, 8.0, ["idle", fault], tmp_path)
    t0 = time.monotonic()
    try:
        ((code0, err0),) = _finish([watcher], timeout=60)
        detected = time.monotonic() - t0
    finally:
        victim.kill()
        victim.wait()
    assert code0 == watchdog.EXIT_PEER, err0
    m = re.search(rf"rank 1 \(\S+, pid {victim.pid}\) sent no heartbeat for (\d+\.\d) s: it died", err0)
    assert m, err0
    # Silent for more than 5 s (the limit), noticed within one heartbeat (0.5 s) of it, plus scheduling slack.
    assert 5.0 <= float(m.group(1)) < 5.0 + 0.5 + 1.0
    # 1 s until the fault, 5 s of silence, < 1 heartbeat more, the 1.5 s linger before exiting; slack for a busy CPU.
    assert detected < 1.0 + 5.0 + 0.5 + 1.5 + 4.0, detected


def test_a_failed_peer_is_reported_and_a_finished_one_is_not(store, tmp_path):
    watcher, failing, finished = _start(store.port, 8.0, ["idle", "fail", "finish"], tmp_path)
    (code1, err1), (code2, _), (code0, err0) = _finish([failing, finished, watcher], timeout=60)
    assert code1 == 1 and "ValueError: bad row 7 in data.jsonl" in err1, err1  # its own error, re-raised
    assert code2 == 0  # finished normally: its silence afterwards is no fault
    assert code0 == watchdog.EXIT_PEER, err0
    assert re.search(r"stopping: rank 1 reported: rank 1 \(\S+, pid \d+\) failed: ValueError: bad row 7", err0), err0


STORE_SERVER = textwrap.dedent(
    """
    import datetime, time
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    print(store.port, flush=True)
    time.sleep(600)
    """
)


def test_store_gone_is_a_lost_peer_after_the_silence_limit(tmp_path):
    # The store lives in a process of its own (rank 0 under srun); SIGKILL it as a node loss would.
    server = subprocess.Popen([sys.executable, "-c", STORE_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(server.stdout.readline())
        watcher, peer = _start(port, 8.0, ["idle", "idle"], tmp_path)
        time.sleep(1.0)
        server.kill()
        (code0, err0), (code1, _) = _finish([watcher, peer], timeout=60)
    finally:
        server.kill()
        server.wait()
    assert code0 == code1 == watchdog.EXIT_PEER
    assert "the job's store at" in err0 and "unreachable for" in err0, err0


def test_single_process_hang_exits_4_with_stacks(tmp_path):
    code = textwrap.dedent(
        """
        import time
        from pathlib import Path
        from nemo_disco.watchdog import Watchdog
        wd = Watchdog(1.0, stacks_dir=Path(__import__("sys").argv[1]))
        wd.start()
        with wd.phase("checkpoint", "checkpoint step 2"):
            def writing_a_checkpoint():
                time.sleep(60)
            writing_a_checkpoint()
        """
    )
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    elapsed = time.monotonic() - start
    assert done.returncode == watchdog.EXIT_HUNG, done.stderr
    assert "checkpoint step 2 has run for 1." in done.stderr and "writing_a_checkpoint" in done.stderr
    assert elapsed < 15, elapsed  # 1 s limit, 5 s silence -> 0.5 s heartbeat, plus interpreter start-up
    assert len(list(tmp_path.glob("checkpoint_step_2-rank0-pid*.txt"))) == 1


def test_stop_marks_the_rank_finished(store):
    wd = watchdog.Watchdog(8.0, rank=0, world_size=2, store=_client(store.port))
    wd.start()
    wd.stop()
    # A large negative heartbeat count: the peers do not take its silence from now on for a fault.
    assert _client(store.port).add(wd._key("beat/0"), 0) < 0


def _client(port: int):
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False)


def test_signals_are_untouched():
    # The trainer's SIGUSR1 / SIGTERM handlers stay the trainer's: the watchdog installs none.
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    wd = watchdog.Watchdog(5.0)
    wd.start()
    wd.stop()
    assert {s: signal.getsignal(s) for s in before} == before
