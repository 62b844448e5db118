"""A real two-node Slurm cluster on one machine, for the tests marked ``slurm``.

The session fixture :func:`slurm_cluster` starts Debian's ``slurm-wlm`` (22.05, built with
``MULTIPLE_SLURMD``) in a temporary folder:

- ``munged`` with its own key and socket (nothing under /etc/munge or /run/munge is used);
- ``slurmctld`` listening on 127.0.0.1, a fresh state folder and ``FirstJobId`` taken from the clock
  (so job ids, and ``%j`` log names, do not repeat across sessions);
- two ``slurmd -N <node>``, each under ``unshare --uts`` with its own host name, so ``hostname`` on
  a node and the first host of ``SLURM_JOB_NODELIST`` agree as on a real cluster (torch's rendezvous
  on ``MASTER_ADDR=<first node>`` needs that); each node has its own loopback address
  (127.10.<tag>.<k>), port and spool folder, and an /etc/hosts line the fixture adds and removes.

Node names and addresses carry a per-session tag, so two sessions on one machine do not collide.
Teardown cancels the session's jobs, waits for them to end, then stops exactly the daemons it
started (by pid) and removes exactly the /etc/hosts lines it added.

Where Slurm cannot be had (not root, no apt-get, install fails) the tests are skipped with the
reason, except under ``CI=true``, where the fixture fails instead: CI must really run them.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYTHON = ROOT / ".venv" / "bin" / "python"

SLURM_PACKAGES = ("slurmd", "slurmctld", "slurm-client", "munge")
SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "squeue", "sinfo")
HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARKER = "# nemo-disco test cluster"
TERMINAL_STATES = {
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
    "PREEMPTED",
}

_apt_updated = False


def unavailable(reason: str) -> None:
    """Skip with ``reason``; under CI=true fail instead (CI must run the Slurm tests for real)."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true but the Slurm tests cannot run: {reason}", pytrace=False)
    pytest.skip(reason)


def apt_install(packages: Sequence[str]) -> None:
    """Install Debian packages (``apt-get update`` at most once per session); skip or fail if impossible."""
    global _apt_updated
    if os.geteuid() != 0:
        unavailable(f"{', '.join(packages)} missing and not root, so cannot apt-get install them")
    if shutil.which("apt-get") is None:
        unavailable(f"{', '.join(packages)} missing and no apt-get on this machine")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if not _apt_updated:
        done = subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, text=True)
        if done.returncode:
            unavailable(f"apt-get update failed: {done.stderr.strip()[-300:]}")
        _apt_updated = True
    install = ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]
    done = subprocess.run(install, env=env, capture_output=True, text=True)
    if done.returncode:
        unavailable(f"apt-get install {' '.join(packages)} failed: {done.stderr.strip()[-300:]}")


def ensure_binaries(binaries: Sequence[str], packages: Sequence[str]) -> None:
    """Make sure every binary is on PATH, installing ``packages`` with apt if one is missing."""
    if all(shutil.which(b) for b in binaries):
        return
    apt_install(packages)
    missing = [b for b in binaries if not shutil.which(b)]
    if missing:
        unavailable(f"{', '.join(missing)} still missing after apt-get install {' '.join(packages)}")


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def parse_job(text: str) -> dict[str, str]:
    """``scontrol show job -o`` output -> {field: value} (values never contain spaces we rely on)."""
    return dict(re.findall(r"(\w+)=(\S*)", text))


@dataclass
class SlurmCluster:
    """A running test cluster: its folder, nodes, and the environment that points clients at it."""

    base: Path
    conf: Path
    nodes: tuple[str, ...]
    env: dict[str, str]
    daemons: dict[str, subprocess.Popen] = field(default_factory=dict)
    hosts_lines: list[str] = field(default_factory=list)
    munge_dir: Path | None = None

    # -- clients -----------------------------------------------------------------------------------

    def run(self, args: Sequence[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
        """Run a Slurm client (sbatch, scontrol, ...) against this cluster."""
        env = dict(self.env, **kwargs.pop("env", {}))
        done = subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=60, **kwargs)
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def sbatch(self, args: Sequence[str], cwd: Path, env: dict[str, str] | None = None) -> int:
        """Submit a batch job from ``cwd``; returns its id."""
        done = self.run(["sbatch", "--parsable", *args], cwd=cwd, env=env or {})
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """The job's fields from ``scontrol show job`` (finished jobs stay visible for MinJobAge)."""
        return parse_job(self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout)

    def wait_job(self, job_id: int, timeout: float, log: Path | None = None) -> dict[str, str]:
        """Wait until the job reached a terminal state; returns its fields (``Restarts`` counts its requeues).

        A job that requeues itself goes RUNNING -> PENDING -> RUNNING without a terminal state in between
        (the requeue happens while it runs), so its first terminal state is its last.
        """
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState", "") in TERMINAL_STATES:
                return info
            time.sleep(1.0)
        self.run(["scancel", str(job_id)], check=False)
        raise AssertionError(f"job {job_id} not finished after {timeout:.0f} s: {info}\n{self.tail(log)}")

    def tail(self, log: Path | None = None, lines: int = 40) -> str:
        """The end of a job log (if given) and of every daemon log, for failure messages."""
        parts = []
        for path in ([log] if log else []) + sorted((self.base / "log").glob("*.log")):
            if path.is_file():
                text = path.read_text(errors="replace").splitlines()[-lines:]
                parts.append(f"--- {path}\n" + "\n".join(text))
        return "\n".join(parts)

    # -- lifecycle ---------------------------------------------------------------------------------

    def stop(self) -> None:
        """Cancel this cluster's jobs, stop the daemons this fixture started, remove its /etc/hosts lines."""
        if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
            self.run(["scancel", "--user", "root"], check=False)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                queue = self.run(["squeue", "-h", "-o", "%i"], check=False)
                if queue.returncode or not queue.stdout.strip():
                    break
                time.sleep(1.0)
        # Nodes first, then the controller, then munge (everything else authenticates through it).
        for name in sorted(self.daemons, key=lambda n: (n == "munged", n == "slurmctld")):
            proc = self.daemons[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self.daemons.clear()
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
            self.munge_dir = None
        if self.hosts_lines:
            kept = [line for line in HOSTS_FILE.read_text().splitlines() if line not in self.hosts_lines]
            HOSTS_FILE.write_text("\n".join(kept) + "\n")
            self.hosts_lines.clear()


def _slurm_conf(base: Path, nodes: dict[str, tuple[str, int]], munge_socket: Path, ctld_port: int) -> str:
    node_lines = "\n".join(
        f"NodeName={name} NodeAddr={addr} NodeHostname={name} Port={port} CPUs=2 RealMemory=4000 State=UNKNOWN"
        for name, (addr, port) in nodes.items()
    )
    return f"""\
ClusterName=nemodisco
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s).
AuthInfo=socket={munge_socket},cred_expire=10
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={base}/state
SlurmdSpoolDir={base}/spool/%n
SlurmctldPidFile={base}/run/slurmctld.pid
SlurmdPidFile={base}/run/slurmd-%n.pid
SlurmctldLogFile={base}/log/slurmctld.log
SlurmdLogFile={base}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# linuxproc: no cgroup hierarchy of this (shared) machine is touched.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
# Frequent scheduling passes: a requeued job starts within seconds of becoming eligible (the main
# loop runs every 60 s by default, which made requeue-to-start vary from 25 s to 70 s).
SchedulerParameters=bf_interval=2,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
# No slurmdbd, so no sacct: finished jobs stay in `scontrol show job` for MinJobAge seconds.
MinJobAge=1800
FirstJobId={int(time.time()) % 50_000_000 + 1000}
JobRequeue=1
KillWait=15
InactiveLimit=0
SlurmdTimeout=300
{node_lines}
PartitionName=debug Nodes={",".join(nodes)} Default=YES MaxTime=INFINITE State=UP
"""


def _wait_for(predicate, timeout: float, what: str, cluster: SlurmCluster) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in cluster.daemons.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode} while waiting for {what}\n{cluster.tail()}")
        if predicate():
            return
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}\n{cluster.tail()}")


def start_cluster(base: Path, num_nodes: int = 2) -> SlurmCluster:
    """Start munged, slurmctld and ``num_nodes`` slurmd in ``base``; returns once every node is idle."""
    tag = random.randint(1, 250)
    nodes = {f"t{tag}n{k}": (f"127.10.{tag}.{k}", 0) for k in range(1, num_nodes + 1)}
    nodes = {name: (addr, _free_port(addr)) for name, (addr, _) in nodes.items()}
    for sub in ("state", "spool", "run", "log"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    for name in nodes:
        (base / "spool" / name).mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    conf = base / "slurm.conf"
    env["SLURM_CONF"] = str(conf)
    cluster = SlurmCluster(base=base, conf=conf, nodes=tuple(nodes), env=env)
    try:
        hosts = HOSTS_FILE.read_text()
        added = [f"{addr} {name} {HOSTS_MARKER}" for name, (addr, _) in nodes.items()]
        with HOSTS_FILE.open("a") as f:
            f.write(("" if hosts.endswith("\n") else "\n") + "\n".join(added) + "\n")
        cluster.hosts_lines = added

        # munge: its own key and socket. munged wants every folder above its socket searchable by all, which
        # pytest's private (0700) temporary folders are not: its folder lives directly under /tmp.
        munge_dir = Path(tempfile.mkdtemp(prefix="nemo-disco-munge-"))
        munge_dir.chmod(0o755)
        cluster.munge_dir = munge_dir
        key = munge_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        munge_socket = munge_dir / "munge.socket"
        cluster.daemons["munged"] = subprocess.Popen(
            [
                "munged",
                "--foreground",
                f"--socket={munge_socket}",
                f"--key-file={key}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--log-file={base / 'log' / 'munged.log'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=(base / "log" / "munged.stderr.log").open("w"),
        )
        _wait_for(munge_socket.exists, 20, "the munge socket", cluster)

        ctld_port = _free_port("127.0.0.1")
        conf.write_text(_slurm_conf(base, nodes, munge_socket, ctld_port))
        ctld_log = (base / "log" / "slurmctld.stderr.log").open("w")
        cluster.daemons["slurmctld"] = subprocess.Popen(
            ["slurmctld", "-D", "-c", "-f", str(conf)], env=env, stdout=ctld_log, stderr=subprocess.STDOUT
        )
        _wait_for(lambda: cluster.run(["scontrol", "ping"], check=False).returncode == 0, 30, "slurmctld", cluster)

        for name in nodes:
            # A UTS namespace per node: `hostname` inside a job answers the node's name, as on a real cluster.
            # `unshare` (without --fork) and `sh -c exec` keep one pid, so the pid we hold is slurmd's.
            log = (base / "log" / f"slurmd-{name}.stderr.log").open("w")
            cluster.daemons[f"slurmd-{name}"] = subprocess.Popen(
                ["unshare", "--uts", "sh", "-c", 'hostname "$1" && exec slurmd -D -N "$1" -f "$2"', "sh", name, conf],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

        def all_idle() -> bool:
            done = cluster.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
            states = dict(line.split() for line in done.stdout.splitlines() if line.strip())
            return len(states) == num_nodes and all(s == "idle" for s in states.values())

        _wait_for(all_idle, 90, f"{num_nodes} idle nodes", cluster)
    except BaseException:
        cluster.stop()
        raise
    return cluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A two-node Slurm cluster for the session (see the module docstring)."""
    if os.geteuid() != 0:
        unavailable("the test cluster needs root (SlurmUser=root, unshare --uts, /etc/hosts lines for its nodes)")
    ensure_binaries(SLURM_BINARIES, SLURM_PACKAGES)
    if shutil.which("unshare") is None:
        unavailable("unshare (util-linux) is missing")
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    except RuntimeError as err:
        unavailable(f"the test Slurm cluster did not start: {err}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def shellcheck() -> str:
    """Debian's shellcheck (apt-get installed when missing)."""
    ensure_binaries(["shellcheck"], ["shellcheck"])
    return shutil.which("shellcheck") or "shellcheck"


@pytest.fixture()
def job_dir(tmp_path: Path) -> Path:
    """A submit folder with the ``logs/`` folder the sbatch scripts write into."""
    (tmp_path / "logs").mkdir()
    return tmp_path
