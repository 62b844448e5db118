import json

import pytest
import torch

from nemo_disco import checkpoint, config
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
    assert checkpoint.load_trainer_state(latest) == {"step": 4, "sampler": {"pos": 4}}
    assert config.load_resolved(latest / "config.yaml") == cfg
    assert (latest / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert checkpoint.find_config(latest / "policy") == latest / "config.yaml"


def test_crash_during_save_leaves_previous_checkpoint(tmp_path):
    cfg = _cfg()
    checkpoint.save(tmp_path, 1, _FilePolicy(1), {}, cfg, keep_last=3)
    with pytest.raises(RuntimeError):
        checkpoint.save(tmp_path, 2, _FilePolicy(2, fail=True), {}, cfg, keep_last=3)
    assert checkpoint.latest_checkpoint(tmp_path).name == "step_1"  # step_2.tmp is not a checkpoint
    assert (tmp_path / "checkpoints" / "step_2.tmp").exists()
    checkpoint.save(tmp_path, 2, _FilePolicy(2), {}, cfg, keep_last=3)  # next save cleans the stale tmp
    assert not (tmp_path / "checkpoints" / "step_2.tmp").exists()
    assert checkpoint.latest_checkpoint(tmp_path).name == "step_2"


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
