"""Atomic checkpoints, keep-last-k, and resume from the newest complete one.

Layout of ``<run_dir>/checkpoints/step_<N>/``:

- ``policy/``: what ``Policy.save`` writes (weights, optimizer, scheduler position),
- ``trainer_state.json``: step, data-sampler position, RNG states,
- ``config.yaml``: the resolved run config (``nemo-disco convert`` / ``eval`` read it),
- ``metrics.jsonl``: the metrics of steps 1..N.

A checkpoint is written into ``step_<N>.tmp`` and renamed once complete, so a crash at any moment
leaves either the previous checkpoints or the new one, never half of one. Stale ``*.tmp`` folders
are removed on the next save or resume.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from nemo_disco import config as config_lib
from nemo_disco import distributed
from nemo_disco.config import RunConfig
from nemo_disco.policy.base import Policy

_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoint_root(run_dir: str | Path) -> Path:
    """``<run_dir>/checkpoints``."""
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, path), oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir() and (p / "trainer_state.json").is_file():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def _remove_stale(root: Path) -> None:
    for p in root.glob("*.tmp"):
        shutil.rmtree(p, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict[str, Any]:
    """Torch CPU (and CUDA) RNG states, JSON-serialisable."""
    state = {"torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Inverse of :func:`rng_state`."""
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def save(
    run_dir: str | Path,
    step: int,
    policy: Policy,
    trainer_state: dict[str, Any],
    cfg: RunConfig,
    keep_last: int,
) -> Path:
    """Write ``step_<step>`` atomically (collective: every rank calls it) and prune old checkpoints.

    Returns:
        The final checkpoint path.
    """
    root = checkpoint_root(run_dir)
    tmp = root / f"step_{step}.tmp"
    final = root / f"step_{step}"
    if distributed.rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        _remove_stale(root)
        tmp.mkdir()
    distributed.barrier()
    policy.save(tmp / "policy")
    distributed.barrier()
    if distributed.rank() == 0:
        config_lib.save(cfg, tmp / "config.yaml")
        metrics = Path(run_dir) / "metrics.jsonl"
        if metrics.is_file():
            shutil.copyfile(metrics, tmp / "metrics.jsonl")
        state_file = tmp / "trainer_state.json"
        state_file.write_text(json.dumps({"step": step, **trainer_state}))
        with open(state_file) as fh:
            os.fsync(fh.fileno())
        if final.exists():  # A re-save of the same step (e.g. signal right after a periodic save).
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for _, old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
    distributed.barrier()
    return final


def load_trainer_state(checkpoint: Path) -> dict[str, Any]:
    """``trainer_state.json`` of a checkpoint."""
    return json.loads((Path(checkpoint) / "trainer_state.json").read_text())


def find_config(path: str | Path) -> Path:
    """The ``config.yaml`` saved with a checkpoint (``path`` is a step dir or a dir inside one)."""
    path = Path(path)
    for candidate in (path / "config.yaml", path.parent / "config.yaml"):
        if candidate.is_file():
            return candidate
    raise config_lib.ConfigError(f"no config.yaml in {path} or its parent: is it a checkpoint step_N folder?")
