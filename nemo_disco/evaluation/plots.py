"""Plots of several results: pass@k against k, and accuracy against mean response length.

Each figure has one panel per benchmark, and one for the average over benchmarks when there are several;
:func:`plot_pass_at_k` draws a line per result with its bootstrap interval as a band,
:func:`plot_length_accuracy` a point per result with standard-error bars both ways. matplotlib is imported
only when a plot is drawn.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from nemo_disco.evaluation.summary import EvalSummary, k_of

__all__ = ["plot_length_accuracy", "plot_pass_at_k"]


def _benchmark_panels(
    what: str, summaries: Sequence[EvalSummary], labels: Sequence[str], benchmarks: Sequence[str] | None
) -> tuple[list[str], Any, Any]:
    """The panels (benchmarks, then the average when there are several), a figure and its axes grid.

    Raises:
        ValueError: no results, labels of another length, or a requested benchmark no result has.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not summaries or len(summaries) != len(labels):
        raise ValueError(f"{what} needs one label per result ({len(summaries)} results, {len(labels)} labels)")
    present = list(dict.fromkeys(r.benchmark for s in summaries for r in s.rows))
    names = list(benchmarks) if benchmarks else present
    missing = [b for b in names if b not in present]
    if missing:
        raise ValueError(f"no result has benchmark(s) {', '.join(missing)} (they have {', '.join(present)})")
    panels = names + (["average"] if len(names) > 1 else [])
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.6 * cols, 3.4 * rows), squeeze=False)
    return panels, fig, axes


def plot_pass_at_k(
    summaries: Sequence[EvalSummary],
    labels: Sequence[str],
    out: str | os.PathLike,
    *,
    benchmarks: Sequence[str] | None = None,
) -> Path:
    """PNG of pass@k against k (log2 axis) for several results: one panel per benchmark and the average.

    Each result is a line with its bootstrap interval as a band (when the summaries have intervals).

    Raises:
        ValueError: no results, labels of another length, or a requested benchmark no result has.
    """
    panels, fig, axes = _benchmark_panels("plot_pass_at_k", summaries, labels, benchmarks)
    for ax, bench in zip(axes.flat, panels, strict=False):
        for s, label in zip(summaries, labels, strict=True):
            if bench == "average":
                metrics, ci = s.average, s.average_ci
            elif any(r.benchmark == bench for r in s.rows):
                r = s.row(bench)
                metrics, ci = r.metrics, r.ci
            else:
                continue
            cols_k = sorted(metrics, key=k_of)
            ks = [k_of(c) for c in cols_k]
            (line,) = ax.plot(ks, [100 * metrics[c] for c in cols_k], marker="o", ms=3, label=label)
            if all(c in ci for c in cols_k):
                low = [100 * ci[c][0] for c in cols_k]
                high = [100 * ci[c][1] for c in cols_k]
                ax.fill_between(ks, low, high, color=line.get_color(), alpha=0.2, linewidth=0)
        ax.set_xscale("log", base=2)
        ax.set_title(bench)
        ax.set_xlabel("k")
        ax.set_ylabel("pass@k (%)")
        ax.grid(alpha=0.3)
    from nemo_disco.metrics import save_figure

    return save_figure(fig, axes, len(panels), out)


def plot_length_accuracy(
    summaries: Sequence[EvalSummary],
    labels: Sequence[str],
    out: str | os.PathLike,
    *,
    benchmarks: Sequence[str] | None = None,
    metric: str = "pass@1",
) -> Path:
    """PNG of accuracy (``metric``) against mean response length for several results: a panel per benchmark.

    Each result is one point per panel (x: mean tokens over all samples, y: ``metric``), with error bars of one
    standard error both ways, and its label; a panel for the average over benchmarks when there are several.

    Raises:
        ValueError: no results, labels of another length, a requested benchmark no result has, or a result without
            response lengths (records lacking ``response_tokens``).
    """
    panels, fig, axes = _benchmark_panels("plot_length_accuracy", summaries, labels, benchmarks)
    for s, label in zip(summaries, labels, strict=True):
        if not any("length" in r.lengths for r in s.rows):
            import matplotlib.pyplot as plt

            plt.close(fig)
            raise ValueError(f"result {label} has no response lengths (its records lack response_tokens)")
    for ax, bench in zip(axes.flat, panels, strict=False):
        for s, label in zip(summaries, labels, strict=True):
            if bench == "average":
                acc, acc_se, length, length_se = s.average, s.average_se, s.average_lengths, s.average_lengths_se
            elif any(r.benchmark == bench for r in s.rows):
                r = s.row(bench)
                acc, acc_se, length, length_se = r.metrics, r.se, r.lengths, r.lengths_se
            else:
                continue
            if metric not in acc or "length" not in length:
                continue
            x, y = length["length"], 100 * acc[metric]
            ax.errorbar(
                x,
                y,
                xerr=length_se["length"],
                yerr=100 * acc_se.get(metric, 0.0),
                marker="o",
                ms=4,
                capsize=2,
                label=label,
            )
            ax.annotate(label, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_title(bench)
        ax.set_xlabel("mean response length (tokens)")
        ax.set_ylabel(f"{metric} (%)")
        ax.grid(alpha=0.3)
    from nemo_disco.metrics import save_figure

    return save_figure(fig, axes, len(panels), out)
