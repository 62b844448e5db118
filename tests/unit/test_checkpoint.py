import json
import re

import pytest
import torch
import yaml

from nemo_disco import checkpoint, config, parts
from nemo_disco.metrics import read_jsonl, truncate_jsonl

ROOT = config.Path(__file__).resolve().parents[2]


class _FilePolicy:
    """A policy whose state is one file (checkpoint mechanics only; the real policies have their own tests)."""

    def __init__(self, value: int, fail: bool = False) -> None:
        self.value, self.fail = value, fail

    def save(self, directory):
        directory.mkdir(parents=True)
        (directory / "w.json").write_text(json.dumps(self.value))
        if self.fail:
            raise RuntimeError("disk full")


def _cfg():
    return config.load(ROOT / "recipes" / "disco.yaml")


def test_atomic_save_keep_last_and_latest(tmp_path):
    cfg = _cfg()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    for step in (1, 2, 3, 4):
        checkpoint.save(tmp_path, step, _FilePolicy(step), {"sampler": {"pos": step}}, cfg, keep_last=2)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [3, 4]
    latest = checkpoint.latest_checkpoint(tmp_path)
    assert latest.name == "step_4"
    assert checkpoint.load_trainer_state(latest) == {"step": 4, "sampler": {"pos": 4}, "manifest": True}
    assert config.load_resolved(latest / "config.yaml") == cfg
    assert (latest / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert checkpoint.find_config(latest / "policy") == latest / "config.yaml"


def test_crash_during_save_leaves_previous_checkpoint(tmp_path):
    cfg = _cfg()
    checkpoint.save(tmp_path, 1, _FilePolicy(1), {}, cfg, keep_last=3)
    with pytest.raises(checkpoint.SaveError, match=r"checkpoint step_2 could not be written: RuntimeError: disk full"):
        checkpoint.save(tmp_path, 2, _FilePolicy(2, fail=True), {}, cfg, keep_last=3)
    assert checkpoint.latest_checkpoint(tmp_path).name == "step_1"
    assert not (tmp_path / "checkpoints" / "step_2.tmp").exists()  # the partial folder is removed at once
    checkpoint.save(tmp_path, 2, _FilePolicy(2), {}, cfg, keep_last=3)
    assert checkpoint.latest_checkpoint(tmp_path).name == "step_2"


def test_a_stale_tmp_folder_is_removed_before_resume(tmp_path):
    checkpoint.save(tmp_path, 1, _FilePolicy(1), {}, _cfg(), keep_last=3)
    stale = tmp_path / "checkpoints" / "step_2.tmp"
    (stale / "policy").mkdir(parents=True)  # a process killed mid-save leaves this
    assert [p.name for p in checkpoint.resume_candidates(tmp_path)] == ["step_1"]
    assert not stale.exists()


def _manifest(folder):
    return json.loads((folder / "manifest.json").read_text())


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    import hashlib

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    ckpt = checkpoint.save(tmp_path, 1, _FilePolicy(7), {"sampler": {}}, _cfg(), keep_last=3)
    files = _manifest(ckpt)["files"]
    on_disk = sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())
    assert sorted([*files, "manifest.json"]) == on_disk
    assert sorted(files) == ["config.yaml", "metrics.jsonl", "policy/w.json", "trainer_state.json"]
    w = (ckpt / "policy" / "w.json").read_bytes()  # b"7"
    assert files["policy/w.json"] == {"size": len(w), "sha256": hashlib.sha256(w).hexdigest()}
    assert checkpoint.load_trainer_state(ckpt)["manifest"] is True
    assert checkpoint.verify(ckpt) == ([], True)


def _damage(ckpt, how):
    target = ckpt / "trainer_state.json"
    data = target.read_bytes()
    if how == "truncated":
        target.write_bytes(data[: len(data) // 2])
    elif how == "flipped":
        i = len(data) // 3
        target.write_bytes(data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :])
    elif how == "missing":
        target.unlink()
    elif how == "no_manifest":
        (ckpt / "manifest.json").unlink()
    return len(data)


@pytest.mark.parametrize(
    ("how", "problem"),
    [
        ("truncated", r"trainer_state.json: (\d+) bytes, the manifest says (\d+) \(truncated\)"),
        ("flipped", r"trainer_state.json: SHA-256 differs from the manifest \(bytes changed\)"),
        ("missing", r"trainer_state.json: missing"),
        ("no_manifest", r"manifest.json missing \(the save did not finish\)"),
    ],
)
def test_verify_names_what_failed(tmp_path, how, problem):
    ckpt = checkpoint.save(tmp_path, 1, _FilePolicy(1), {"sampler": {"pos": 1}}, _cfg(), keep_last=3)
    size = _damage(ckpt, how)
    problems, _ = checkpoint.verify(ckpt)
    assert len(problems) == 1 and re.fullmatch(problem, problems[0]), problems
    if how == "truncated":  # half of the bytes: size // 2 on disk
        assert re.fullmatch(problem, problems[0]).groups() == (str(size // 2), str(size))
    # Without hashing, a flipped byte is invisible (same size); the others are not.
    assert bool(checkpoint.quick_check(ckpt)) is (how != "flipped")
    assert checkpoint.latest_checkpoint(tmp_path) == (ckpt if how == "flipped" else None)


def test_a_checkpoint_from_before_manifests_is_accepted_unverified(tmp_path):
    ckpt = checkpoint.save(tmp_path, 1, _FilePolicy(1), {"sampler": {}}, _cfg(), keep_last=3)
    (ckpt / "manifest.json").unlink()
    state = json.loads((ckpt / "trainer_state.json").read_text())
    del state["manifest"]  # what earlier versions wrote
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    assert checkpoint.verify(ckpt) == ([], False)
    assert checkpoint.quick_check(ckpt) == []


def test_set_aside_never_overwrites(tmp_path):
    for _ in range(2):
        checkpoint.save(tmp_path, 3, _FilePolicy(3), {}, _cfg(), keep_last=3)
        checkpoint.set_aside(tmp_path / "checkpoints" / "step_3")
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["step_3.corrupt", "step_3.corrupt.1"]
    assert checkpoint.list_checkpoints(tmp_path) == []


def test_keep_last_never_deletes_the_only_good_checkpoint(tmp_path):
    cfg = _cfg()
    checkpoint.save(tmp_path, 1, _FilePolicy(1), {}, cfg, keep_last=1)
    step_2 = checkpoint.save(tmp_path, 2, _FilePolicy(2), {}, cfg, keep_last=1)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [2]  # keep_last=1: step_1 went
    checkpoint.save(tmp_path, 3, _FilePolicy(3), {}, cfg, keep_last=3)
    (tmp_path / "checkpoints" / "step_3" / "policy" / "w.json").unlink()  # the newest loses a file
    # keep_last=1 and newest step 3: step_3 fails its size check, so step_2 is the newest good one and stays.
    assert checkpoint.prune(tmp_path, keep_last=1, newest_step=3) == []
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [2, 3]
    assert checkpoint.latest_checkpoint(tmp_path) == step_2


def test_keep_last_ignores_checkpoints_newer_than_the_step_saved(tmp_path):
    # Resumed from step_2 after step_4 was written: saving step_3 with keep_last=1 must not count step_4 (it is
    # from before the resume, and would let step_2 and step_3 be deleted).
    cfg = _cfg()
    for step in (2, 4):
        checkpoint.save(tmp_path, step, _FilePolicy(step), {}, cfg, keep_last=5)
    checkpoint.save(tmp_path, 3, _FilePolicy(3), {}, cfg, keep_last=1)
    assert [s for s, _ in checkpoint.list_checkpoints(tmp_path)] == [3, 4]


@pytest.fixture()
def small_fs(tmp_path):
    """A 1 MiB tmpfs (a real file system that fills up); skipped where mounting is not allowed."""
    from procs import tmpfs

    with tmpfs(tmp_path / "run", "1m") as mnt:
        yield mnt


class _BigPolicy:
    """Writes ``size`` bytes in one file, as a policy's weights are (checkpoint mechanics only)."""

    def __init__(self, size: int) -> None:
        self.size = size

    def save(self, directory):
        directory.mkdir(parents=True)
        with open(directory / "weights.bin", "wb") as fh:
            fh.write(b"\1" * self.size)


def test_disk_full_during_save_is_a_clear_error_and_keeps_the_previous_checkpoint(small_fs):
    cfg = _cfg()
    first = checkpoint.save(small_fs, 1, _BigPolicy(600_000), {}, cfg, keep_last=1)
    # 600 kB more does not fit in what is left of 1 MiB: the kernel answers ENOSPC (errno 28).
    with pytest.raises(checkpoint.SaveError) as err:
        checkpoint.save(small_fs, 2, _BigPolicy(600_000), {}, cfg, keep_last=1)
    msg = str(err.value)
    assert "checkpoint step_2 could not be written: OSError: [Errno 28] No space left on device" in msg
    assert "the file system is full:" in msg and f"the newest checkpoint is {first}" in msg
    assert err.value.__cause__.errno == 28
    assert [p.name for p in (small_fs / "checkpoints").iterdir()] == ["step_1"]  # step_2.tmp removed
    assert checkpoint.verify(first) == ([], True)


def test_resume_guard_diffs_model_loss_data_and_layout_keys(tmp_path):
    cfg = parts.load(ROOT / "recipes" / "disco.yaml")  # composed, as training loads it
    checkpoint.save(tmp_path, 1, _FilePolicy(1), {}, cfg, keep_last=3)
    same_run = parts.load(ROOT / "recipes" / "disco.yaml", ["algorithm.steps=2000", "checkpoint.save_every=5"])
    assert checkpoint.check_resume_config(same_run, tmp_path) == []  # steps, saving: free to change
    changed = ["loss.tau=1", "data.seed=7", "cluster.nodes=2", "policy.dtype=float32"]
    other = parts.load(ROOT / "recipes" / "disco.yaml", changed)
    with pytest.raises(config.ConfigError) as err:
        checkpoint.check_resume_config(other, tmp_path)
    line = str(err.value)
    assert "\n" not in line
    assert (
        "cluster.nodes: 1 -> 2; data.seed: 42 -> 7; loss.tau: 10.0 -> 1.0; policy.dtype: 'bfloat16' -> 'float32'"
        in line
    )
    assert "checkpoint.allow_config_change=true" in line
    allowed = parts.load(ROOT / "recipes" / "disco.yaml", [*changed, "checkpoint.allow_config_change=true"])
    assert len(checkpoint.check_resume_config(allowed, tmp_path)) == 4
    fresh = parts.load(ROOT / "recipes" / "disco.yaml", [*changed, "checkpoint.resume=false"])
    assert checkpoint.check_resume_config(fresh, tmp_path) == []


def test_the_resume_guard_covers_the_graders_own_parameters(tmp_path):
    strict = ["reward.grader=deepscaler", "reward.require_think=true"]
    cfg = parts.load(ROOT / "recipes" / "disco.yaml", strict)
    checkpoint.save(tmp_path, 1, _FilePolicy(1), {}, cfg, keep_last=3)
    assert (
        checkpoint.check_resume_config(
            parts.load(ROOT / "recipes" / "disco.yaml", [*strict, "reward.workers=4"]), tmp_path
        )
        == []
    )  # how it grades, not what: free to change
    lenient = parts.load(ROOT / "recipes" / "disco.yaml", [*strict[:1], "reward.require_think=false"])
    with pytest.raises(config.ConfigError, match=r"reward\.require_think: True -> False \(model, loss"):
        checkpoint.check_resume_config(lenient, tmp_path)


def test_rng_state_round_trip():
    state = checkpoint.rng_state()
    a = torch.rand(3)
    checkpoint.set_rng_state(json.loads(json.dumps(state)))
    assert torch.equal(torch.rand(3), a)


def test_metrics_truncation_on_resume_and_torn_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "x": s}) + "\n" for s in range(5)) + '{"step": 5, "x"')
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2, 3, 4]  # the torn last line is ignored
    truncate_jsonl(path, 2)
    assert [r["step"] for r in read_jsonl(path)] == [0, 1, 2]


def test_a_config_saved_with_every_losss_keys_null_for_defaults_resumes_unchanged(tmp_path):
    # Saved configs used to list every loss's parameters, null standing for the chosen loss's default; the composed
    # config holds the chosen loss's own, resolved. A null is that default: no change, unless the value changed.
    recipe = ROOT / "recipes" / "grpo-er-r1qwen1.5b-1n8g-8k.yaml"
    cfg = parts.load(recipe)
    checkpoint.save(tmp_path, 1, _FilePolicy(1), {}, cfg, keep_last=3)
    saved = tmp_path / "checkpoints" / "step_1" / "config.yaml"
    old = yaml.safe_load(saved.read_text())
    old["loss"].update(entropy_coef=None, tau=None, drpo_lambda=None)  # the recipe leaves entropy_coef out
    saved.write_text(yaml.safe_dump(old))
    assert checkpoint.check_resume_config(cfg, tmp_path) == []
    coef = cfg.loss.model_extra["entropy_coef"]
    with pytest.raises(config.ConfigError, match=rf"loss\.entropy_coef: {coef!r} -> {coef * 2!r}"):
        checkpoint.check_resume_config(parts.load(recipe, [f"loss.entropy_coef={coef * 2}"]), tmp_path)
