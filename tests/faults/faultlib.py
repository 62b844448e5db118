"""Helpers of the fault-injection suites: the injector's environment, log parsing, and run comparison."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

from procs import THREADS

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "tiny-cpu.yaml"
INJECT = Path(__file__).resolve().parent / "inject"
#: The environment that installs inject/faults.py as a hook of nemo_disco.hooks (the fault itself: NEMO_DISCO_FAULT).
INJECTOR = {"PYTHONPATH": str(INJECT), "NEMO_DISCO_HOOKS": "faults:hook"}


def trainer_env(fault: str | None = None, once: Path | None = None) -> dict[str, str]:
    """The trainer's environment: same threads everywhere, the fault injector installed as a hook, the fault if any."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NEMO_DISCO_FAULT", "SLURM_"))}
    env.update(THREADS)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(INJECT), env.get("PYTHONPATH", "")) if p)
    env["NEMO_DISCO_HOOKS"] = INJECTOR["NEMO_DISCO_HOOKS"]
    if fault:
        env["NEMO_DISCO_FAULT"] = fault
    if once:
        env["NEMO_DISCO_FAULT_ONCE"] = str(once)
    return env


def metrics(run_dir: Path) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl``."""
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]


def comparable(records: list[dict]) -> list[dict]:
    """Records without wall-clock timings (everything else must be identical between runs)."""
    return [{k: v for k, v in r.items() if not k.startswith("timing/")} for r in records]


def fault_time(log: str) -> float:
    """Unix time at which the injected fault fired (the injector's ``fault: ... at <time>`` line)."""
    m = re.search(r"^fault: \S+ rank \d+ step \d+ at (\d+\.\d+)$", log, re.M)
    assert m, f"no fault line in the log:\n{log[-3000:]}"
    return float(m.group(1))


def message(log: str, rank: int) -> tuple[float, str]:
    """The watchdog's line of ``rank``: (its unix time, its text after the rank's name)."""
    m = re.search(
        rf"^nemo-disco: (\d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d)\.(\d{{3}}) rank {rank} \((\S+), pid \d+\): (.*)$", log, re.M
    )
    assert m, f"no watchdog line of rank {rank} in the log:\n{log[-4000:]}"
    when = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
    return when, m.group(4)


def torchrun_exit_codes(log: str) -> dict[int, tuple[int, int]]:
    """{rank: (exit code, pid)} of the failed workers, from torchrun's failure report."""
    found = re.findall(r"rank\s+: (\d+) \(local_rank: \d+\)\s+exitcode\s+: (-?\d+) \(pid: (\d+)\)", log)
    return {int(r): (int(c), int(p)) for r, c, p in found}


def checkpoint_names(run_dir: Path) -> list[str]:
    """Folder names under ``run_dir/checkpoints``, sorted."""
    root = run_dir / "checkpoints"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []
