"""Atomic, verified checkpoints; keep-last-k; resume from the newest good one; the resume config guard.

Layout of ``<run_dir>/checkpoints/step_<N>/``:

- ``policy/``: what ``Policy.save`` writes (weights, optimizer, scheduler position),
- ``trainer_state.json``: step, data-sampler position, RNG states,
- ``config.yaml``: the resolved run config (``nemo-disco convert`` / ``eval`` read it),
- ``metrics.jsonl``: the metrics of steps 1..N,
- ``manifest.json``, written last: every other file with its size and SHA-256.

A checkpoint is written into ``step_<N>.tmp`` and renamed once complete, so a crash at any moment
leaves either the previous checkpoints or the new one, never half of one. Stale ``*.tmp`` folders
are removed on the next save or resume. A save that fails (disk full, a write error) raises
:class:`SaveError` naming the file system's free space; the partial folder is removed and the previous
checkpoints are untouched.

On resume (:func:`resume_candidates`, :func:`verify`) the newest checkpoint is checked against its manifest
(every rank hashes a share of the files). One that fails (a file missing, truncated or with other bytes, no
manifest) is renamed ``step_<N>.corrupt`` with a warning naming what failed, and the previous one is tried.
Checkpoints written before manifests existed (no manifest, no ``manifest`` mark in trainer_state.json) are
accepted unverified, with a warning.

Keep-last-k (:func:`prune`) deletes a checkpoint only when ``keep_last`` newer ones, no newer than the step
just saved, pass a size check against their manifests: it never deletes the only good checkpoint.

The resume guard (:func:`config_changes`): resuming with a model, loss, data or layout key other than the
checkpoint's fails with a one-line diff unless ``checkpoint.allow_config_change`` is set.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import yaml

from nemo_disco import config as config_lib
from nemo_disco import distributed, files, hooks
from nemo_disco.config import RunConfig
from nemo_disco.policy.base import Policy

log = logging.getLogger(__name__)

_STEP_DIR = re.compile(r"^step_(\d+)$")
MANIFEST = "manifest.json"
_CHUNK = 8 << 20

# Keys that must match the checkpoint's to resume (a prefix covers its whole section), by what they define.
GUARDED_KEYS: dict[str, tuple[str, ...]] = {
    "model": ("policy.backend", "policy.model_path", "policy.tiny", "policy.dtype"),
    # (and the reward section's keys other than its fields: the chosen grader's own parameters, :func:`_guarded`)
    "loss": ("loss.", "reward.grader", "reward.positive_threshold"),
    "data": (
        "data.train",
        "data.split",
        "data.prompt_template",
        "data.use_chat_template",
        "data.on_bad_row",
        "data.shuffle",
        "data.seed",
        "data.synthetic_size",
        "algorithm.prompts_per_step",
        "algorithm.rollouts_per_prompt",
        "algorithm.minibatch_prompts",
        "algorithm.seed",
    ),
    "layout": (
        "cluster.nodes",
        "cluster.gpus_per_node",
        "policy.tensor_parallel_size",
        "policy.pipeline_parallel_size",
        "generation.tensor_parallel_size",
    ),
}


class SaveError(RuntimeError):
    """A checkpoint could not be written; the previous checkpoints are intact."""


def checkpoint_root(run_dir: str | Path) -> Path:
    """``<run_dir>/checkpoints``."""
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """Checkpoint folders ``step_<N>`` as (step, path), oldest first (whether they verify is :func:`verify`'s call)."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest checkpoint whose manifest's files are all present with their sizes (no hashing), or None."""
    for _, path in reversed(list_checkpoints(run_dir)):
        if not quick_check(path):
            return path
    return None


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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _files(folder: Path) -> list[str]:
    """Every regular file under ``folder`` but the manifest, as sorted POSIX paths relative to it."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _hash_share(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """Size and SHA-256 of this rank's share of ``names`` (every rank hashes a slice: shared file system)."""
    share = names[distributed.rank() :: distributed.world_size()]
    out = {}
    for name in share:
        path = folder / name
        if not path.is_file():
            raise FileNotFoundError(
                f"rank {distributed.rank()} cannot see {path}, written by another rank: logging.run_dir must be on a "
                "file system that every node of the job sees"
            )
        out[name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    return out


def write_manifest(folder: Path, step: int) -> None:
    """Collective: hash every file of ``folder`` (a share per rank) and write ``manifest.json`` (rank 0), last."""
    names = distributed.broadcast_object(_files(folder) if distributed.rank() == 0 else None)
    entries: dict[str, dict[str, Any]] = {}
    for part in distributed.all_gather_object(_hash_share(folder, names)):
        entries.update(part)
    if distributed.rank() == 0:
        path = folder / MANIFEST
        tmp = folder / (MANIFEST + ".tmp")
        with open(tmp, "w") as fh:
            json.dump({"format": 1, "step": step, "files": dict(sorted(entries.items()))}, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)


def _read_manifest(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(manifest, None) or (None, what is wrong with it)."""
    path = folder / MANIFEST
    if not path.is_file():
        state = folder / "trainer_state.json"
        try:
            legacy = state.is_file() and not json.loads(state.read_text()).get("manifest", False)
        except (OSError, ValueError):
            legacy = False
        return None, ("legacy" if legacy else f"{MANIFEST} missing (the save did not finish)")
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict) or not files:
            raise ValueError("no files listed")
    except (OSError, ValueError, KeyError, TypeError) as err:
        return None, f"{MANIFEST} unreadable ({err})"
    return manifest, None


def quick_check(folder: Path) -> list[str]:
    """Problems found without hashing: manifest missing or unreadable, a listed file missing or of another size.

    A checkpoint written before manifests existed passes.
    """
    manifest, problem = _read_manifest(Path(folder))
    if manifest is None:
        return [] if problem == "legacy" else [problem or "manifest missing"]
    return [p for name, e in manifest["files"].items() if (p := _size_problem(Path(folder), name, e))]


def _size_problem(folder: Path, name: str, entry: dict[str, Any]) -> str | None:
    path = folder / name
    if not path.is_file():
        return f"{name}: missing"
    size = path.stat().st_size
    if size != entry["size"]:
        how = "truncated" if size < entry["size"] else "grown"
        return f"{name}: {size} bytes, the manifest says {entry['size']} ({how})"
    return None


def verify(folder: Path) -> tuple[list[str], bool]:
    """Collective: check every file against the manifest (each rank hashes a share).

    Returns:
        The problems (the same list on every rank; empty if the checkpoint is good) and whether the checkpoint
        has a manifest (False: written before manifests, accepted unverified).
    """
    folder = Path(folder)
    manifest, problem = _read_manifest(folder)
    if manifest is None:
        return ([] if problem == "legacy" else [problem or "manifest missing"]), False
    names = sorted(manifest["files"])
    mine = []
    for name in names[distributed.rank() :: distributed.world_size()]:
        entry = manifest["files"][name]
        bad = _size_problem(folder, name, entry)
        if bad is None and _sha256(folder / name) != entry["sha256"]:
            bad = f"{name}: SHA-256 differs from the manifest (bytes changed)"
        if bad:
            mine.append(bad)
    problems = sorted(p for part in distributed.all_gather_object(mine) for p in part)
    return problems, True


def set_aside(folder: Path) -> Path:
    """Rename a damaged checkpoint ``step_<N>.corrupt`` (``.corrupt.<k>`` if taken) so no resume picks it again."""
    target = folder.with_name(folder.name + ".corrupt")
    k = 1
    while target.exists():
        target = folder.with_name(f"{folder.name}.corrupt.{k}")
        k += 1
    os.replace(folder, target)
    return target


def prune(run_dir: str | Path, keep_last: int, newest_step: int) -> list[Path]:
    """Delete checkpoints older than the ``keep_last`` newest good ones (rank 0; see the module docstring).

    Only checkpoints up to ``newest_step`` count (a newer folder is left from before a resume to an earlier
    step and will be overwritten); a checkpoint is good for this purpose when :func:`quick_check` passes.

    Returns:
        The deleted folders.
    """
    found = [(s, p) for s, p in list_checkpoints(run_dir) if s <= newest_step]
    good = [s for s, p in found if not quick_check(p)]
    if len(good) < keep_last:
        return []
    oldest_kept = good[-keep_last]
    deleted = []
    for s, p in found:
        if s < oldest_kept:
            shutil.rmtree(p, ignore_errors=True)
            deleted.append(p)
    return deleted


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else ""


def _size(folder: Path | None) -> int | None:
    """Bytes of a checkpoint according to its manifest (None without one)."""
    manifest, _ = _read_manifest(folder) if folder is not None else (None, None)
    return sum(int(e["size"]) for e in manifest["files"].values()) if manifest else None


def save(
    run_dir: str | Path,
    step: int,
    policy: Policy,
    trainer_state: dict[str, Any],
    cfg: RunConfig,
    keep_last: int,
) -> Path:
    """Write ``step_<step>`` atomically with its manifest (collective: every rank calls it) and prune old ones.

    Returns:
        The final checkpoint path.

    Raises:
        SaveError: a file could not be written (the message names the error and the free space); the partial
            folder is removed, the previous checkpoints are untouched.
    """
    root = checkpoint_root(run_dir)
    tmp = root / f"step_{step}.tmp"
    final = root / f"step_{step}"
    try:
        if distributed.rank() == 0:
            root.mkdir(parents=True, exist_ok=True)
            _remove_stale(root)
            tmp.mkdir()
        distributed.barrier()
        policy.save(tmp / "policy")
        hooks.point("checkpoint_written", step=step, directory=tmp)
        distributed.barrier()
        if distributed.rank() == 0:
            config_lib.save(cfg, tmp / "config.yaml")
            metrics = Path(run_dir) / "metrics.jsonl"
            if metrics.is_file():
                shutil.copyfile(metrics, tmp / "metrics.jsonl")
            state_file = tmp / "trainer_state.json"
            state_file.write_text(json.dumps({"step": step, **trainer_state, "manifest": True}))
            with open(state_file) as fh:
                os.fsync(fh.fileno())
        distributed.barrier()
        write_manifest(tmp, step)
    except Exception as err:
        if distributed.rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(run_dir)
        raise SaveError(
            f"checkpoint step_{step} could not be written: {type(err).__name__}: {_first_line(err)} "
            f"({files.free_space(root, _size(previous), 'a checkpoint')}); the newest checkpoint is "
            f"{previous if previous is not None else 'none'} (the partial {tmp.name} is never resumed from, and is "
            "removed)"
        ) from err
    if distributed.rank() == 0:
        if final.exists():  # A re-save of the same step (e.g. signal right after a periodic save).
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        for old in prune(run_dir, keep_last, step):
            log.info("checkpoint %s deleted (checkpoint.keep_last=%d)", old, keep_last)
    distributed.barrier()
    return final


def resume_candidates(run_dir: str | Path) -> list[Path]:
    """Checkpoint folders to try for a resume, newest first (stale ``*.tmp`` removed by rank 0)."""
    root = checkpoint_root(run_dir)
    if distributed.rank() == 0 and root.is_dir():
        _remove_stale(root)
    distributed.barrier()
    return [p for _, p in reversed(list_checkpoints(run_dir))]


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _guarded(key: str) -> bool:
    section, _, leaf = key.partition(".")
    if section == "reward" and leaf not in config_lib.RewardConfig.model_fields:
        return True  # the chosen grader's own parameters define the reward, as reward.grader does
    return any(
        key == g or (g.endswith(".") and key.startswith(g)) or key.startswith(g + ".")
        for keys in GUARDED_KEYS.values()
        for g in keys
    )


def config_changes(cfg: RunConfig, saved_config: Path) -> list[str]:
    """Guarded keys (:data:`GUARDED_KEYS`) whose value differs from ``saved_config``: ``"key: old -> new"``.

    Keys the saved config does not have (written by an older version) are not compared.

    Raises:
        ConfigError: ``saved_config`` cannot be read.
    """
    try:
        saved = yaml.safe_load(Path(saved_config).read_text())
    except (OSError, yaml.YAMLError) as err:
        raise config_lib.ConfigError(f"{saved_config}: cannot read the checkpoint's config: {err}") from None
    old = _flatten(saved if isinstance(saved, dict) else {})
    new = _flatten(cfg.model_dump(mode="json"))
    # Configs written before each loss declared its parameters held every loss's keys, null for "the loss's
    # default": such a null is the chosen loss's default now.
    defaults = _loss_defaults(cfg.loss.name) if old.get("loss.name") == cfg.loss.name else {}
    for key, default in defaults.items():
        if old.get(f"loss.{key}", 0) is None:
            old[f"loss.{key}"] = default
    return [f"{k}: {old[k]!r} -> {new[k]!r}" for k in sorted(new) if _guarded(k) and k in old and old[k] != new[k]]


def _loss_defaults(name: str) -> dict[str, Any]:
    """The defaults of the parameters of the loss ``name`` (JSON values); empty when it cannot be found."""
    from nemo_disco import losses

    try:
        model = losses.find_loss(name).hparams
    except (ValueError, ImportError):
        return {}
    return {k: f.default for k, f in model.model_fields.items() if not f.is_required()}


def check_resume_config(cfg: RunConfig, run_dir: str | Path) -> list[str]:
    """The resume guard: compare ``cfg`` with the config of the newest checkpoint in ``run_dir`` that has one.

    Returns:
        The changed guarded keys (empty: nothing to resume, or nothing changed); with
        ``checkpoint.allow_config_change`` the caller logs them.

    Raises:
        ConfigError: a guarded key changed and ``checkpoint.allow_config_change`` is false (one line).
    """
    if not cfg.checkpoint.resume:
        return []
    for _, path in reversed(list_checkpoints(run_dir)):
        if (path / "config.yaml").is_file():
            changes = config_changes(cfg, path / "config.yaml")
            if changes and not cfg.checkpoint.allow_config_change:
                raise config_lib.ConfigError(
                    f"{path} was written with another config: {'; '.join(changes)} (model, loss, data and layout "
                    "keys must match to resume: set checkpoint.allow_config_change=true to resume anyway, or use a "
                    "new logging.run_dir)"
                )
            return changes
    return []


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
