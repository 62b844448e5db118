"""MetricsLogger: JSONL records and the progress bar's step count."""

from __future__ import annotations

import json

from nemo_disco.metrics import MetricsLogger


def _logger(tmp_path, total: int, start: int = 0) -> MetricsLogger:
    return MetricsLogger(
        tmp_path,
        enabled=True,
        tensorboard=False,
        wandb=False,
        wandb_project="",
        total_steps=total,
        start_step=start,
        progress=True,
    )


def test_step_zero_validation_record_does_not_advance_the_bar(tmp_path):
    logger = _logger(tmp_path, total=2)
    logger.log(0, {"val/pass@1": 0.25})
    assert logger._bar.n == 0
    logger.log(1, {"train/reward_mean": 0.5})
    logger.log(2, {"train/reward_mean": float("nan")})
    assert logger._bar.n == 2 == logger._bar.total
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    assert records[2]["train/reward_mean"] is None


def test_a_resumed_run_counts_from_its_checkpoint_step(tmp_path):
    logger = _logger(tmp_path, total=10, start=6)
    logger.log(7, {})
    assert logger._bar.n == 7
    logger.close()
