"""Metric sinks (JSONL always, TensorBoard, W&B), progress (bar or plain lines), and the training-curve plots.

Progress is a bar in a terminal and a plain line per step (at most one per 10 s) in a log file or a pipe.

metrics.jsonl is the record of a run (fsync'd every step; resume truncates it to the checkpoint's step). The
other sinks are conveniences: one that fails (not installed, no network, disk full, a write error) is reported
once, switched off for the rest of the run, and training goes on.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

# Panels of `nemo-disco plot` (the paper's fig. 2 view plus the constraint and the rollout mismatch).
PLOT_PANELS: tuple[tuple[str, str], ...] = (
    ("train/reward_mean", "training reward"),
    ("train/entropy", "generation entropy"),
    ("train/kl", "KL(pi_old || pi_theta)"),
    ("train/response_length_mean", "response length (tokens)"),
    ("train/constraint_active", "constraint active (share of updates)"),
    ("mismatch/kl_k3", "generator vs policy KL (k3)"),
    ("val/pass@1", "validation pass@1"),
)
#: Panels only some losses have, and the losses (a run's ``loss.name``) that have them. DisCO's family has the KL
#: constraint; every other loss logs ``train/constraint_active`` as a constant 0, which the plot leaves out.
LOSS_PANELS: dict[str, tuple[str, ...]] = {"train/constraint_active": ("disco", "discob", "drpo")}
#: A panel's ``<key>_se`` (a standard error, as ``val/pass@1_se``) where the run logs one: drawn as error bars.
SE_SUFFIX = "_se"


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics.jsonl (a torn last line from a crash is ignored)."""
    out = []
    path = Path(path)
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def truncate_jsonl(path: str | Path, last_step: int) -> None:
    """Keep only records with ``step <= last_step`` (resume after a crash recomputes the rest)."""
    path = Path(path)
    if not path.is_file():
        return
    kept = [r for r in read_jsonl(path) if r.get("step", 0) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in kept))
    os.replace(tmp, path)


class MetricsLogger:
    """Writes one JSON object per step to ``<run_dir>/metrics.jsonl`` (+ TensorBoard, W&B) on rank 0."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        enabled: bool,
        tensorboard: bool,
        wandb: bool,
        wandb_project: str,
        total_steps: int,
        start_step: int,
        progress: bool,
        run_config: dict[str, Any] | None = None,
        terminal: bool | None = None,
    ) -> None:
        """Open the sinks on rank 0 (``enabled``); ``terminal`` (default: stderr is a TTY) picks bar or lines."""
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        self._bar = None
        self._lines: StepLines | None = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except Exception as err:  # noqa: BLE001  (a sink failing must not stop training)
                self._sink_failed("TensorBoard", err)
        if wandb:
            try:
                import wandb as wandb_lib

                self._wandb = wandb_lib.init(project=wandb_project, dir=str(run_dir), config=run_config, resume="allow")
            except Exception as err:  # noqa: BLE001
                self._sink_failed("W&B", err)
        if progress and (sys.stderr.isatty() if terminal is None else terminal):
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)
        elif progress:  # a Slurm .out file, a pipe: a bar there is one endless line of carriage returns
            self._lines = StepLines(total_steps, start_step)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Append one step's metrics (non-finite values are written as null)."""
        if not self.enabled:
            return
        record = {"step": step, **{k: _finite_or_none(v) for k, v in sorted(metrics.items())}}
        with open(self.path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        if self._tb is not None:
            try:
                for k, v in metrics.items():
                    if isinstance(v, (int, float)) and math.isfinite(v):
                        self._tb.add_scalar(k, v, step)
                self._tb.flush()
            except Exception as err:  # noqa: BLE001
                self._tb = None
                self._sink_failed("TensorBoard", err)
        if self._wandb is not None:
            try:
                self._wandb.log(metrics, step=step)
            except Exception as err:  # noqa: BLE001
                self._wandb = None
                self._sink_failed("W&B", err)
        if self._bar is not None:
            # The bar counts training steps: a record for step 0 (validation before training) does not advance it.
            self._bar.update(max(0, step - self._bar.n))
            self._bar.set_postfix(
                reward=f"{metrics.get('train/reward_mean', float('nan')):.3f}",
                kl=f"{metrics.get('train/kl', float('nan')):.1e}",
            )
        if self._lines is not None:
            line = self._lines.line(step, metrics)
            if line:
                print(line, flush=True)

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message)
        else:
            print(message, flush=True)

    def close(self) -> None:
        """Flush and close every sink."""
        if self._bar is not None:
            self._bar.close()
        for name, sink, finish in (("TensorBoard", self._tb, "close"), ("W&B", self._wandb, "finish")):
            if sink is not None:
                try:
                    getattr(sink, finish)()
                except Exception as err:  # noqa: BLE001
                    self._sink_failed(name, err)
        self._tb = self._wandb = None

    def _sink_failed(self, name: str, err: Exception) -> None:
        """Report a failed sink once (it is off from now on; metrics.jsonl goes on)."""
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        self.write(
            f"warning: metrics sink {name} failed ({type(err).__name__}: {first}); it is off for the rest of the "
            f"run, training goes on and {self.path} keeps every metric"
        )


class StepLines:
    """Progress as plain lines, for output that is not a terminal: one per step, at most one per ``every_s`` seconds.

    The last step and steps with a validation always get theirs. A line reads
    ``step 40/120: reward 0.412, kl 3.1e-05, val pass@1 0.520; 0.52 s/step, 42 s left``.
    """

    def __init__(self, total_steps: int, start_step: int, every_s: float = 10.0) -> None:
        self.total, self.start, self.every_s = total_steps, start_step, every_s
        self.t0 = time.monotonic()
        self.last_print: float | None = None

    def line(self, step: int, metrics: dict[str, float]) -> str | None:
        """The line for ``step``, or None when the previous line is under ``every_s`` old (step 0: None)."""
        now = time.monotonic()
        due = self.last_print is None or now - self.last_print >= self.every_s
        if step <= self.start or not (due or step >= self.total or "val/pass@1" in metrics):
            return None
        self.last_print = now
        parts = [f"reward {metrics.get('train/reward_mean', float('nan')):.3f}"]
        parts.append(f"kl {metrics.get('train/kl', float('nan')):.1e}")
        if "val/pass@1" in metrics:
            parts.append(f"val pass@1 {metrics['val/pass@1']:.3f}")
        per_step = (now - self.t0) / (step - self.start)
        left = max(0, self.total - step) * per_step
        return f"step {step}/{self.total}: {', '.join(parts)}; {per_step:.2f} s/step, {_duration(left)} left"


def _duration(seconds: float) -> str:
    """``42 s``, ``7 min``, ``3.5 h``."""
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _finite_or_none(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class Timer:
    """Accumulates wall time per phase; phases may nest: ``with timer("step"): ... with timer("train"): ...``."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Time the enclosed block under ``name`` (added to earlier blocks of the same name)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """``timing/<phase>`` seconds."""
        return {f"timing/{k}": v for k, v in self.totals.items()}


def plot_runs(run_dirs: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None) -> Path:
    """PNG of the training curves of one or several runs overlaid (one panel per metric, one colour per run).

    A metric a run's loss does not have (:data:`LOSS_PANELS`: GRPO's constraint) draws no line for that run, and
    no panel where no run has it; a metric logged with its standard error (``val/pass@1_se``) has error bars.

    Raises:
        ValueError: a run folder has no metrics.jsonl.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = []
    for d in run_dirs:
        records = read_jsonl(Path(d) / "metrics.jsonl")
        if not records:
            raise ValueError(f"{d}: no metrics.jsonl records to plot")
        runs.append((records, run_loss(d)))
    labels = list(labels) if labels else [Path(d).name for d in run_dirs]
    panels = [(k, t) for k, t in PLOT_PANELS if any(_has_metric(recs, loss, k) for recs, loss in runs)]
    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.4 * rows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        with_se = False
        for i, ((recs, loss), label) in enumerate(zip(runs, labels, strict=True)):
            pts = [(r["step"], r[key], r.get(key + SE_SUFFIX)) for r in recs if r.get(key) is not None]
            if not pts or not _has_metric(recs, loss, key):
                continue
            xs, ys, ses = zip(*pts, strict=True)
            style = {"label": label, "color": f"C{i}", "marker": "." if len(xs) < 50 else None}
            if any(se is not None for se in ses):
                ax.errorbar(xs, ys, yerr=[math.nan if se is None else se for se in ses], capsize=3, **style)
                with_se = True
            else:
                ax.plot(xs, ys, **style)
        ax.set_title(f"{title} (+- 1 s.e.)" if with_se else title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    return save_figure(fig, axes, len(panels), out)


def run_loss(run_dir: str | Path) -> str | None:
    """The loss a run trains with (``loss.name`` of its ``config.yaml``); None where it has no readable one."""
    import yaml

    try:
        cfg = yaml.safe_load((Path(run_dir) / "config.yaml").read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    loss = cfg.get("loss") if isinstance(cfg, dict) else None
    name = loss.get("name") if isinstance(loss, dict) else None
    return name if isinstance(name, str) else None


def _has_metric(records: list[dict[str, Any]], loss: str | None, key: str) -> bool:
    """Whether a run has ``key`` to plot: logged, and a metric of its loss (an unknown loss: any logged one)."""
    if loss is not None and key in LOSS_PANELS and loss not in LOSS_PANELS[key]:
        return False
    return any(r.get(key) is not None for r in records)


def save_figure(fig: Any, axes: Any, used: int, out: str | Path) -> Path:
    """Blank the unused panels of a grid of ``axes``, put the legend on the first, write ``out`` (PNG) and close."""
    import matplotlib.pyplot as plt

    for ax in list(axes.flat)[used:]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
