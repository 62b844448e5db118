"""MetricsLogger: JSONL records, the progress bar's step count, and plain step lines outside a terminal."""

from __future__ import annotations

import json

import pytest

from nemo_disco.metrics import MetricsLogger, StepLines


def _logger(
    tmp_path,
    total: int,
    start: int = 0,
    *,
    progress: bool = True,
    tensorboard: bool = False,
    wandb: bool = False,
    terminal: bool = True,
) -> MetricsLogger:
    """The rank-0 logger of a run; tests vary its progress bar and sinks."""
    return MetricsLogger(
        tmp_path,
        enabled=True,
        tensorboard=tensorboard,
        wandb=wandb,
        wandb_project="p",
        total_steps=total,
        start_step=start,
        progress=progress,
        terminal=terminal,
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


def test_outside_a_terminal_progress_is_plain_lines(tmp_path, capsys):
    logger = _logger(tmp_path, total=3, terminal=False)
    assert logger._bar is None
    logger.log(0, {"val/pass@1": 0.25})  # before training: no step line
    logger.log(1, {"train/reward_mean": 0.5, "train/kl": 2e-5})
    logger.log(2, {"train/reward_mean": 0.25})  # under 10 s after the previous line: none
    logger.log(3, {"train/reward_mean": 0.75, "val/pass@1": 0.5})  # the last step: always
    logger.close()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("step 1/3: reward 0.500, kl 2.0e-05; ") and lines[0].endswith(" left")
    assert lines[1].startswith("step 3/3: reward 0.750, kl nan, val pass@1 0.500; ")
    assert lines[1].endswith(", 0 s left")


def test_step_lines_every_n_seconds_and_at_validations(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("nemo_disco.metrics.time.monotonic", lambda: clock[0])
    lines = StepLines(total_steps=100, start_step=40, every_s=10.0)  # a run resumed at step 40
    printed = []
    for step in range(41, 61):
        clock[0] += 3.0  # 3 s per step
        if lines.line(step, {"val/pass@1": 0.5} if step == 50 else {}) is not None:
            printed.append(step)
    # The first step, then every 4th step (12 s >= 10 s), and step 50 for its validation.
    assert printed == [41, 45, 49, 50, 54, 58]
    assert lines.line(61, {}) is None  # t = 160, 6 s after step 58's line
    clock[0] += 6.0  # t = 166: 66 s for 22 steps since the resume, 38 steps to go
    assert lines.line(62, {}) == "step 62/100: reward nan, kl nan; 3.00 s/step, 114 s left"


def _records(tmp_path) -> list[dict]:
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_a_tensorboard_that_cannot_start_is_reported_once_and_jsonl_goes_on(tmp_path, capsys):
    (tmp_path / "tensorboard").write_text("a file where the event folder should be\n")
    logger = _logger(tmp_path, 3, progress=False, tensorboard=True)
    for step in (1, 2, 3):
        logger.log(step, {"train/reward_mean": 0.1 * step})
    logger.close()
    out = capsys.readouterr().out
    assert out.count("warning: metrics sink TensorBoard failed (") == 1
    assert "training goes on" in out
    assert [r["step"] for r in _records(tmp_path)] == [1, 2, 3]


def test_wandb_failing_to_start_is_reported_once(tmp_path, capsys):
    import importlib.util

    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here: its start-up failure is not this one")
    logger = _logger(tmp_path, 2, progress=False, wandb=True)
    logger.log(1, {"train/kl": 1e-5})
    logger.close()
    out = capsys.readouterr().out
    assert out.count("warning: metrics sink W&B failed (ModuleNotFoundError: No module named 'wandb')") == 1
    assert [r["step"] for r in _records(tmp_path)] == [1]


# TensorBoard's writer thread prints its own traceback once when its write fails; the sink is then switched off.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_tensorboard_on_a_full_disk_is_switched_off_mid_run(tmp_path, capsys):
    import subprocess

    events = tmp_path / "tensorboard"
    events.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(events)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        logger = _logger(tmp_path, 400, progress=False, tensorboard=True)
        # ~60 scalars per step: the 64 KiB event file system fills within a few dozen steps.
        metrics = {f"train/m{i}": float(i) for i in range(60)}
        for step in range(1, 401):
            logger.log(step, metrics)
        logger.close()
    finally:
        subprocess.run(["umount", str(events)], check=True)
    out = capsys.readouterr().out
    assert out.count("warning: metrics sink TensorBoard failed (") == 1, out
    assert [r["step"] for r in _records(tmp_path)] == list(range(1, 401))


def _write_run(folder, loss: str, records: list[dict]) -> str:
    """A run folder as training leaves it: metrics.jsonl and the resolved config.yaml (its loss)."""
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (folder / "config.yaml").write_text(f"loss:\n  name: {loss}\n")
    return str(folder)


def _drawn_panels(monkeypatch, run_dirs: list[str], out) -> dict[str, object]:
    """``plot_runs``'s panels by title (the axes, before the figure is written and closed)."""
    from nemo_disco import metrics

    drawn = {}

    def capture(fig, axes, used, out):  # noqa: ANN001, ANN202
        drawn.update({ax.get_title(): ax for ax in list(axes.flat)[:used]})
        return out

    monkeypatch.setattr(metrics, "save_figure", capture)
    metrics.plot_runs(run_dirs, out)
    return drawn


def test_plot_leaves_out_what_a_loss_does_not_have_and_draws_pass_at_1_with_its_standard_error(tmp_path, monkeypatch):
    """GRPO logs train/constraint_active as a constant 0 (it has no constraint): that used to be a flat line at 0,
    and validation pass@1 was a bare line though the logs carry its standard error."""
    steps = [
        {
            "step": s,
            "train/reward_mean": 0.1 * s,
            "train/constraint_active": 0.0,
            "val/pass@1": 0.2,
            "val/pass@1_se": 0.05,
        }
        for s in range(1, 4)
    ]
    grpo = _write_run(tmp_path / "grpo", "grpo", steps)
    drawn = _drawn_panels(monkeypatch, [grpo], tmp_path / "grpo.png")
    assert not any(title.startswith("constraint active") for title in drawn)
    val = drawn["validation pass@1 (+- 1 s.e.)"]
    (bars,) = val.containers  # one errorbar container: the run's points and their +- 0.05
    assert bars.has_yerr
    segments = bars.lines[2][0].get_segments()
    assert [tuple(seg[:, 1].round(6)) for seg in segments] == [(0.15, 0.25)] * 3

    disco = _write_run(tmp_path / "disco", "disco", [{**r, "train/constraint_active": 0.5} for r in steps])
    drawn = _drawn_panels(monkeypatch, [disco, grpo], tmp_path / "both.png")
    panel = drawn["constraint active (share of updates)"]
    assert [line.get_label() for line in panel.get_lines()] == ["disco"]  # GRPO's run draws nothing there
    assert panel.get_lines()[0].get_color() == drawn["training reward"].get_lines()[0].get_color()
    assert drawn["training reward"].get_lines()[1].get_color() != panel.get_lines()[0].get_color()


def test_loss_panels_name_the_losses_with_the_constraint():
    from nemo_disco.losses.base import constrained_coupling
    from nemo_disco.losses.registry import LOSSES
    from nemo_disco.metrics import LOSS_PANELS

    constrained = {name for name, loss in LOSSES.items() if loss.coupling_fn is constrained_coupling}
    assert set(LOSS_PANELS["train/constraint_active"]) == constrained
