"""Views across several results: one setting's runs aggregated, and two results paired by problem.

:func:`aggregate_runs` gives a :class:`RunsSummary`: per benchmark the mean, sample standard deviation, min and
max of each pass@k (and response length) over several results of one setting (training seeds, checkpoints).
:func:`compare_results` gives a :class:`Comparison`: the paired difference ``A - B`` per benchmark on the problems
both results have, with its standard error and a paired bootstrap interval, and the response lengths paired the
same way.
"""

from __future__ import annotations

import csv
import io
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nemo_disco import stats
from nemo_disco.evaluation.summary import (
    LENGTHS,
    EvalSummary,
    bench_seed,
    bootstrap_draws,
    correct_by_problem,
    k_of,
    length_totals,
    pct,
    percent_cell,
    token_counts,
)
from nemo_disco.stats import DEFAULT_CONFIDENCE, DEFAULT_REPLICATES, pass_at_k

logger = logging.getLogger(__name__)

__all__ = ["Comparison", "ComparisonRow", "RunsSummary", "aggregate_runs", "compare_results"]


def _metric_order(metric: str) -> tuple[int, int]:
    """pass@k by increasing k, then the ``LENGTHS`` keys in their order."""
    return (0, k_of(metric)) if metric.startswith("pass@") else (1, list(LENGTHS).index(metric))


@dataclass
class RunsSummary:
    """One figure over several results of one setting (seeds or checkpoints): mean and spread across runs.

    Attributes:
        labels: one per run.
        runs: the per-run summaries (each with its own standard errors and intervals).
        rows: benchmark (and "average") -> "pass@k" (and the ``LENGTHS`` keys every run has, in tokens) ->
            per-run values, in run order.
    """

    labels: list[str]
    runs: list[EvalSummary]
    rows: dict[str, dict[str, list[float]]]

    def stats(self, benchmark: str, metric: str) -> dict[str, float]:
        """mean, sd (ddof 1; 0 for one run), se of the mean (sd / sqrt(runs)), min, max."""
        values = self.rows[benchmark][metric]
        mean, sd = stats.mean_sd(values)
        return {"mean": mean, "sd": sd, "se": sd / math.sqrt(len(values)), "min": min(values), "max": max(values)}

    def _columns(self, benchmark: str) -> list[str]:
        return sorted(self.rows[benchmark], key=_metric_order)

    def to_markdown(self) -> str:
        """Two tables: mean ± sd [min, max] over runs per benchmark; each run's pass@1 ± its standard error."""
        cols = sorted({c for metrics in self.rows.values() for c in metrics}, key=_metric_order)
        titles = [f"{LENGTHS[c]} (tokens)" if c in LENGTHS else f"{c} (%)" for c in cols]
        lines = [
            f"Across {len(self.labels)} runs ({', '.join(self.labels)}): mean ± sd over runs [min, max], in % "
            "(lengths in tokens).",
            "",
            "| benchmark | " + " | ".join(titles) + " |",
            "|---|" + "---:|" * len(cols),
        ]
        for bench, metrics in self.rows.items():
            cells = []
            for c in cols:
                if c not in metrics:
                    cells.append("-")
                    continue
                s = self.stats(bench, c)
                if c in LENGTHS:
                    d = 1 if s["sd"] >= 0.1 else 3
                    cells.append(f"{s['mean']:.{d}f} ± {s['sd']:.{d}f} [{s['min']:.{d}f}, {s['max']:.{d}f}]")
                else:
                    cells.append(f"{pct(s['mean'])} ± {pct(s['sd'])} [{pct(s['min'])}, {pct(s['max'])}]")
            lines.append(f"| {bench} | " + " | ".join(cells) + " |")
        first = cols[0]
        lines += [
            "",
            f"{first} of each run (%, ± standard error over problems):",
            "",
            "| benchmark | " + " | ".join(self.labels) + " |",
            "|---|" + "---:|" * len(self.labels),
        ]
        for bench in self.rows:
            cells = []
            for run in self.runs:
                if bench == "average":
                    cells.append(percent_cell(run.average[first], run.average_se.get(first), None))
                else:
                    r = run.row(bench)
                    cells.append(percent_cell(r.metrics[first], r.se.get(first), None))
            lines.append(f"| {bench} | " + " | ".join(cells) + " |")
        return "\n".join(lines) + "\n"

    def to_csv(self) -> str:
        """Long CSV: benchmark, metric, runs, mean, sd, se, min, max, then one column per run."""
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        writer.writerow(["benchmark", "metric", "runs", "mean", "sd", "se", "min", "max", *self.labels])
        for bench in self.rows:
            for metric in self._columns(bench):
                s = self.stats(bench, metric)
                values = self.rows[bench][metric]
                writer.writerow([bench, metric, len(values), s["mean"], s["sd"], s["se"], s["min"], s["max"], *values])
        return buf.getvalue()

    def to_dict(self) -> dict[str, Any]:
        """Plain data (runs.json): across-run statistics and every run's own summary."""
        return {
            "labels": self.labels,
            "benchmarks": [
                {"benchmark": b, **{m: {**self.stats(b, m), "values": self.rows[b][m]} for m in self._columns(b)}}
                for b in self.rows
            ],
            "runs": [run.to_dict() for run in self.runs],
        }

    def __str__(self) -> str:
        return self.to_markdown()


def aggregate_runs(summaries: Sequence[EvalSummary], labels: Sequence[str]) -> RunsSummary:
    """Mean and spread of each benchmark's pass@k over several results of one setting.

    Benchmarks are those of the first run that every run has; a metric is kept where every run reports it.
    Runs that evaluated different numbers of problems of a benchmark are compared anyway, with a warning.

    Raises:
        ValueError: no runs, labels of another length, or no benchmark shared by all runs.
    """
    if not summaries or len(summaries) != len(labels):
        raise ValueError(f"aggregate_runs needs one label per run ({len(summaries)} runs, {len(labels)} labels)")
    names = [r.benchmark for r in summaries[0].rows]
    shared = [b for b in names if all(any(r.benchmark == b for r in s.rows) for s in summaries)]
    left_out = sorted({r.benchmark for s in summaries for r in s.rows} - set(shared))
    if left_out:
        logger.warning("benchmarks not in every run are left out: %s", ", ".join(left_out))
    if not shared:
        raise ValueError("the runs share no benchmark")
    rows: dict[str, dict[str, list[float]]] = {}
    for bench in shared:
        per_run = [s.row(bench) for s in summaries]
        if len({r.problems for r in per_run}) > 1:
            logger.warning("%s: runs evaluated %s problems", bench, sorted({r.problems for r in per_run}))
        metrics = set.intersection(*(set(r.metrics) for r in per_run))
        rows[bench] = {m: [r.metrics[m] for r in per_run] for m in sorted(metrics, key=k_of)}
        rows[bench] |= {k: [r.lengths[k] for r in per_run] for k in LENGTHS if all(k in r.lengths for r in per_run)}
    if len(shared) == len(names) and all(len(s.rows) == len(names) for s in summaries):
        metrics = set.intersection(*(set(s.average) for s in summaries))
        rows["average"] = {m: [s.average[m] for s in summaries] for m in sorted(metrics, key=k_of)}
        rows["average"] |= {
            k: [s.average_lengths[k] for s in summaries]
            for k in LENGTHS
            if all(k in s.average_lengths for s in summaries)
        }
    return RunsSummary(list(labels), list(summaries), rows)


@dataclass
class ComparisonRow:
    """``a - b`` on one benchmark for one metric, over the problems both results have."""

    benchmark: str
    metric: str
    problems: int
    a: float
    b: float
    diff: float
    se: float
    ci: tuple[float, float] | None
    a_better: int
    b_better: int
    # "length" / "length_correct" / "length_wrong" -> {"a", "b", "diff", "se"}: mean response tokens of A and B and
    # their difference paired by problem (where both results have token counts and such samples).
    lengths: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass
class Comparison:
    """Paired differences of two results, per benchmark and averaged over benchmarks."""

    label_a: str
    label_b: str
    rows: list[ComparisonRow]
    replicates: int
    seed: int
    confidence: float
    resample_samples: bool = False

    @property
    def length_columns(self) -> list[str]:
        """The ``LENGTHS`` keys some row compares."""
        return [key for key in LENGTHS if any(key in r.lengths for r in self.rows)]

    def to_markdown(self) -> str:
        """Markdown table in percent points; mean response lengths in tokens beside them."""
        lengths = self.length_columns
        titles = "".join(f" {LENGTHS[c]} A / B, A - B ± se (tokens) |" for c in lengths)
        lines = [
            f"A = {self.label_a}, B = {self.label_b}: pass@k in %, difference A - B paired by problem "
            f"(± standard error; {round(100 * self.confidence)}% paired bootstrap interval, "
            f"{bootstrap_draws(self.resample_samples)}; {self.replicates} replicates, seed {self.seed}).",
            "",
            "| benchmark | metric | problems | A | B | A - B | ± se | interval | problems A > B / A < B |" + titles,
            "|---|---|---:|---:|---:|---:|---:|---|---:|" + "---:|" * len(lengths),
        ]
        for r in self.rows:
            interval = f"[{pct(r.ci[0])}, {pct(r.ci[1])}]" if r.ci is not None else "-"
            problems = "" if r.benchmark == "average" else str(r.problems)
            wins = "" if r.benchmark == "average" else f"{r.a_better} / {r.b_better}"
            cells = "".join(f" {_length_pair(r.lengths.get(c))} |" for c in lengths)
            lines.append(
                f"| {r.benchmark} | {r.metric} | {problems} | {pct(r.a)} | {pct(r.b)} | {100 * r.diff:+.2f} | "
                f"{pct(r.se)} | {interval} | {wins} |{cells}"
            )
        return "\n".join(lines) + "\n"

    def to_csv(self) -> str:
        """CSV, values in [0, 1]; lengths in tokens.

        Length columns: ``length_a``, ``length_b``, ``length_diff``, ``length_se``, then ``length_correct_*``, ...
        """
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        lengths = [(c, part) for c in self.length_columns for part in ("a", "b", "diff", "se")]
        writer.writerow(
            ["benchmark", "metric", "problems", "a", "b", "diff", "se", "ci_low", "ci_high", "a_better", "b_better"]
            + [f"{c}_{part}" for c, part in lengths]
        )
        for r in self.rows:
            low, high = r.ci if r.ci is not None else ("", "")
            writer.writerow(
                [r.benchmark, r.metric, r.problems, r.a, r.b, r.diff, r.se, low, high, r.a_better, r.b_better]
                + [r.lengths[c][part] if c in r.lengths else "" for c, part in lengths]
            )
        return buf.getvalue()

    def to_dict(self) -> dict[str, Any]:
        """Plain data (comparison.json)."""
        return {
            "a": self.label_a,
            "b": self.label_b,
            "replicates": self.replicates,
            "seed": self.seed,
            "confidence": self.confidence,
            "bootstrap": bootstrap_draws(self.resample_samples),
            "rows": [
                {**r.__dict__, "ci": list(r.ci) if r.ci is not None else None}  # tuples become JSON lists
                for r in self.rows
            ],
        }

    def __str__(self) -> str:
        return self.to_markdown()


def _length_pair(values: dict[str, float] | None) -> str:
    if values is None:
        return "-"
    d = 1 if values["se"] >= 0.1 else 3
    return f"{values['a']:.{d}f} / {values['b']:.{d}f}, {values['diff']:+.{d}f} ± {values['se']:.{d}f}"


def _paired_lengths(
    a: dict[int, list[tuple[int, bool]]], b: dict[int, list[tuple[int, bool]]], problems: Sequence[int]
) -> dict[str, dict[str, float]]:
    """Mean response lengths of A and B on ``problems`` and their difference paired by problem, per ``LENGTHS`` key."""
    out = {}
    for key in LENGTHS:
        ta, na = zip(*(length_totals(a[p], key) for p in problems), strict=True)
        tb, nb = zip(*(length_totals(b[p], key) for p in problems), strict=True)
        if sum(na) > 0 and sum(nb) > 0:
            diff, se = stats.paired_ratio_difference(ta, na, tb, nb)
            out[key] = {"a": math.fsum(ta) / sum(na), "b": math.fsum(tb) / sum(nb), "diff": diff, "se": se}
    return out


def _average_lengths(per_benchmark: Sequence[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """The benchmarks' length comparisons averaged (standard errors combined as independent), where all have one."""
    out = {}
    for key in LENGTHS:
        if all(key in lengths for lengths in per_benchmark):
            rows = [lengths[key] for lengths in per_benchmark]
            out[key] = {part: math.fsum(r[part] for r in rows) / len(rows) for part in ("a", "b", "diff")}
            out[key]["se"] = stats.combined_se([r["se"] for r in rows])
    return out


def compare_results(
    records_a: Sequence[dict[str, Any]],
    records_b: Sequence[dict[str, Any]],
    *,
    ks: Sequence[int] = (1,),
    labels: tuple[str, str] = ("A", "B"),
    replicates: int = DEFAULT_REPLICATES,
    seed: int = 0,
    confidence: float = DEFAULT_CONFIDENCE,
    resample_samples: bool = False,
) -> Comparison:
    """Paired difference ``pass@k(A) - pass@k(B)`` per benchmark on the problems both results have.

    Beside each row, the mean response lengths (tokens; all, correct and wrong samples) of A and B and their
    difference paired by problem (:func:`nemo_disco.stats.paired_ratio_difference`), where both results have
    ``response_tokens``.

    The standard error is that of the mean per-problem difference (:func:`nemo_disco.stats.paired_difference`);
    the interval is a paired bootstrap that draws the same problems for both results. By default only problems
    are drawn: a paired difference is dominated by the sample noise inside each problem, which the problem
    draw carries already, and redrawing samples as well counts it twice (a nominal 95% interval covered the
    true difference in 99.7% of simulated 500-problem benchmarks; ``docs/evaluation.md``). The average row
    averages the benchmarks' differences (standard errors combined as independent).

    Args:
        records_a: graded records of result A.
        records_b: graded records of result B.
        ks: the k compared (each at most the fewest samples of a problem in either result).
        labels: names of A and B for the tables.
        replicates: bootstrap replicates (0: no interval).
        seed: bootstrap seed.
        confidence: interval level.
        resample_samples: for pass@1, redraw samples within the drawn problems too (conservative).

    Raises:
        ValueError: the results share no benchmark or no problem, a k above the samples, ungraded records.
    """
    ca, cb = correct_by_problem(records_a), correct_by_problem(records_b)
    tokens_a, tokens_b = token_counts(records_a), token_counts(records_b)
    shared = [b for b in ca if b in cb]
    only = sorted(set(ca) ^ set(cb))
    if only:
        logger.warning("benchmarks in only one result are left out: %s", ", ".join(only))
    if not shared:
        raise ValueError(f"the results share no benchmark ({', '.join(ca)} vs {', '.join(cb)})")
    rows: list[ComparisonRow] = []
    reps: dict[str, np.ndarray] = {}
    for bench in shared:
        problems = sorted(set(ca[bench]) & set(cb[bench]))
        if not problems:
            raise ValueError(f"{bench}: the results share no problem index")
        unpaired = len(set(ca[bench]) ^ set(cb[bench]))
        if unpaired:
            logger.warning("%s: %d problems are in only one result and are left out", bench, unpaired)
        na, xa = [len(ca[bench][p]) for p in problems], [sum(ca[bench][p]) for p in problems]
        nb, xb = [len(cb[bench][p]) for p in problems], [sum(cb[bench][p]) for p in problems]
        most = min(min(na), min(nb))
        if max(ks) > most:
            raise ValueError(f"{bench}: k={max(ks)} needs that many samples per problem; the results have {most}")
        if replicates:
            reps[bench] = stats.paired_bootstrap_pass_at_k(
                na,
                xa,
                nb,
                xb,
                ks,
                replicates=replicates,
                seed=bench_seed(seed, bench),
                resample_samples=resample_samples,
            )
        both = bench in tokens_a and bench in tokens_b
        lengths = _paired_lengths(tokens_a[bench], tokens_b[bench], problems) if both else {}
        for i, k in enumerate(ks):
            va = [pass_at_k(n, x, k) for n, x in zip(na, xa, strict=True)]
            vb = [pass_at_k(n, x, k) for n, x in zip(nb, xb, strict=True)]
            diff, se = stats.paired_difference(va, vb)
            ci = None
            if replicates:
                low, high = stats.percentile_interval(reps[bench][i], confidence)
                ci = (float(low), float(high))
            rows.append(
                ComparisonRow(
                    bench,
                    f"pass@{k}",
                    len(problems),
                    math.fsum(va) / len(va),
                    math.fsum(vb) / len(vb),
                    diff,
                    se,
                    ci,
                    sum(a > b for a, b in zip(va, vb, strict=True)),
                    sum(a < b for a, b in zip(va, vb, strict=True)),
                    lengths,
                )
            )
    if len(shared) > 1:
        for i, k in enumerate(ks):
            per = [r for r in rows if r.metric == f"pass@{k}"]
            ci = None
            if replicates:
                low, high = stats.percentile_interval(np.mean([reps[b][i] for b in shared], axis=0), confidence)
                ci = (float(low), float(high))
            rows.append(
                ComparisonRow(
                    "average",
                    f"pass@{k}",
                    sum(r.problems for r in per),
                    math.fsum(r.a for r in per) / len(per),
                    math.fsum(r.b for r in per) / len(per),
                    math.fsum(r.diff for r in per) / len(per),
                    stats.combined_se([r.se for r in per]),
                    ci,
                    sum(r.a_better for r in per),
                    sum(r.b_better for r in per),
                    _average_lengths([r.lengths for r in per]),
                )
            )
    return Comparison(labels[0], labels[1], rows, replicates, seed, confidence, resample_samples)
