r"""pass@k evaluation on math benchmarks: generate, grade, tabulate with uncertainty, compare runs.

A result is a list of records, one per (problem, sample)::

    {"benchmark": "aime", "problem_index": 3, "sample_index": 0, "response": "...", "score": 1.0, ...}

written one per line to ``responses.jsonl`` (extra fields: ``answer``, ``finish_reason``,
``response_tokens``). A sample is correct when its score is above 0.5 (graders give 1.0 / 0.0). A results
folder is a folder holding ``responses.jsonl`` (what ``nemo-disco eval --out`` writes).

pass@k uses the unbiased estimator of Chen et al. 2021 (eq. 1, :func:`nemo_disco.stats.pass_at_k`); a
benchmark's pass@k is its mean over problems. pass@1 is then the mean over problems of the share of correct
samples, as in the paper's tab. 2 (16 samples, temperature 0.6, top-p 0.95). Reported k are 1, 2, 4, ... up
to the number of samples, and that number itself; the average row is the unweighted mean over benchmarks.

Uncertainty (:mod:`nemo_disco.stats`): every pass@k comes with its standard error over problems and a
percentile bootstrap interval (problems resampled, and for pass@1 the samples within them; fixed seed);
the average's standard error combines the benchmarks' as independent, its interval averages their
replicates. Three views on top of one table:

- :func:`aggregate_runs`: several results of one setting (training seeds, checkpoints): per benchmark the
  mean, sample standard deviation, min and max over runs;
- :func:`compare_results`: two results on the same problems: the paired difference per benchmark with its
  standard error and a paired bootstrap interval ("A beats B on AIME by x points, 95% CI [lo, hi]");
- :func:`plot_pass_at_k`: pass@k against k for several results, one panel per benchmark;
- :func:`plot_length_accuracy`: pass@1 against mean response length, one point per result.

Mean response length (tokens, from the records' ``response_tokens``) is reported beside pass@k, over all, the
correct and the wrong samples of each benchmark; its standard error is clustered by problem as pass@k's is
(:func:`nemo_disco.stats.ratio_mean_se`), and :func:`compare_results` pairs it by problem.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np

from nemo_disco import stats
from nemo_disco.data import (
    BENCHMARKS,
    DEFAULT_TEMPLATE,
    encode_prompts,
    load_problems,
    quiet_hub_logs,
    resolve_benchmark,
)
from nemo_disco.generation.factory import build_generator, stop_token_ids
from nemo_disco.models import check_model
from nemo_disco.stats import DEFAULT_CONFIDENCE, DEFAULT_REPLICATES, pass_at_k

logger = logging.getLogger(__name__)

RESPONSES_FILE = "responses.jsonl"

__all__ = [
    "RESPONSES_FILE",
    "BenchmarkResult",
    "Comparison",
    "EvalSummary",
    "RunsSummary",
    "aggregate_runs",
    "compare_results",
    "evaluate_model",
    "grade_responses_file",
    "ks_for",
    "load_results",
    "pass_at_k",
    "plot_length_accuracy",
    "plot_pass_at_k",
    "summarize",
    "write_results",
]


def ks_for(samples: int) -> list[int]:
    """The k reported for ``samples`` samples per problem: powers of two below it, and it."""
    ks, k = [], 1
    while k < samples:
        ks.append(k)
        k *= 2
    return ks + [samples]


def _k_of(metric: str) -> int:
    return int(metric.split("@")[1])


def _metric_order(metric: str) -> tuple[int, int]:
    """pass@k by increasing k, then the ``LENGTHS`` keys in their order."""
    return (0, _k_of(metric)) if metric.startswith("pass@") else (1, list(LENGTHS).index(metric))


def _pct(v: float) -> str:
    return f"{100 * v:.2f}"


def _bench_seed(seed: int, bench: str) -> np.random.Generator:
    """A benchmark's bootstrap stream: from (seed, name), so a table's intervals do not depend on its other rows."""
    name = int.from_bytes(hashlib.sha256(bench.encode()).digest()[:8], "little")
    return np.random.default_rng([seed, name])


@dataclass
class BenchmarkResult:
    """One row of the table; ``metrics`` maps "pass@k" to a value in [0, 1].

    Attributes:
        benchmark: benchmark name (or file stem).
        problems: number of problems.
        samples: the fewest samples of a problem (pass@k is reported up to it).
        metrics: "pass@k" -> mean over problems.
        se: "pass@k" -> standard error over problems.
        ci: "pass@k" -> (low, high) bootstrap interval (empty when the bootstrap is off).
        counts: problem index -> (samples, correct samples).
        lengths: "length", "length_correct", "length_wrong" -> mean response length in tokens over all, the
            correct and the wrong samples (absent where the records have no ``response_tokens`` or no such sample).
        lengths_se: the same keys -> standard error clustered by problem (:func:`nemo_disco.stats.ratio_mean_se`).
    """

    benchmark: str
    problems: int
    samples: int
    metrics: dict[str, float] = field(default_factory=dict)
    se: dict[str, float] = field(default_factory=dict)
    ci: dict[str, tuple[float, float]] = field(default_factory=dict)
    counts: dict[int, tuple[int, int]] = field(default_factory=dict, repr=False)
    lengths: dict[str, float] = field(default_factory=dict)
    lengths_se: dict[str, float] = field(default_factory=dict)


# Mean response length (tokens) over all, the correct and the wrong samples; column titles in the Markdown tables.
LENGTHS = {"length": "length", "length_correct": "correct length", "length_wrong": "wrong length"}


def _resampled(samples: bool) -> str:
    return "problems resampled, and for pass@1 the samples within them" if samples else "problems resampled"


def _cell(value: float, se: float | None, ci: tuple[float, float] | None) -> str:
    text = _pct(value)
    if se is not None:
        text += f" ± {_pct(se)}"
    if ci is not None:
        text += f" [{_pct(ci[0])}, {_pct(ci[1])}]"
    return text


def _tokens(value: float, se: float) -> str:
    """``value ± se`` in tokens: one decimal, three where the standard error is below 0.1 (short responses)."""
    d = 1 if se >= 0.1 else 3
    return f"{value:.{d}f} ± {se:.{d}f}"


def _length_cell(lengths: dict[str, float], se: dict[str, float], key: str) -> str:
    return _tokens(lengths[key], se[key]) if key in lengths else "-"


def _flat_lengths(lengths: dict[str, float], se: dict[str, float]) -> dict[str, float]:
    """``length``, ``length_se``, ``length_correct``, ... keys (tokens), those present."""
    out: dict[str, float] = {}
    for key in LENGTHS:
        if key in lengths:
            out[key], out[f"{key}_se"] = lengths[key], se[key]
    return out


def _flat(metrics: dict[str, float], se: dict[str, float], ci: dict[str, tuple[float, float]]) -> dict[str, Any]:
    """``pass@k``, ``pass@k_se``, ``pass@k_ci`` ([low, high]) keys, by increasing k."""
    out: dict[str, Any] = {}
    for key in sorted(metrics, key=_k_of):
        out[key] = metrics[key]
        if key in se:
            out[f"{key}_se"] = se[key]
        if key in ci:
            out[f"{key}_ci"] = [float(ci[key][0]), float(ci[key][1])]
    return out


@dataclass
class EvalSummary:
    """Per-benchmark pass@k with their uncertainty, and the unweighted average over benchmarks.

    Attributes:
        rows: one per benchmark.
        average: "pass@k" -> mean over benchmarks (k reported by every benchmark).
        average_se: standard error of the average (benchmarks independent).
        average_ci: bootstrap interval of the average.
        average_lengths: mean response lengths (``LENGTHS`` keys) averaged over benchmarks (where every one has it).
        average_lengths_se: their standard errors (benchmarks independent).
        replicates: bootstrap replicates (0: no intervals).
        seed: bootstrap seed.
        confidence: interval level.
        resample_samples: the bootstrap redraws samples within problems too (else problems only).
    """

    rows: list[BenchmarkResult]
    average: dict[str, float]
    average_se: dict[str, float] = field(default_factory=dict)
    average_ci: dict[str, tuple[float, float]] = field(default_factory=dict)
    average_lengths: dict[str, float] = field(default_factory=dict)
    average_lengths_se: dict[str, float] = field(default_factory=dict)
    replicates: int = DEFAULT_REPLICATES
    seed: int = 0
    confidence: float = DEFAULT_CONFIDENCE
    resample_samples: bool = True

    @property
    def columns(self) -> list[str]:
        """Every "pass@k" column, by increasing k."""
        keys = {key for r in self.rows for key in r.metrics}
        return sorted(keys, key=_k_of)

    @property
    def length_columns(self) -> list[str]:
        """The ``LENGTHS`` keys some benchmark reports."""
        return [key for key in LENGTHS if any(key in r.lengths for r in self.rows)]

    def row(self, benchmark: str) -> BenchmarkResult:
        """The row of ``benchmark``.

        Raises:
            KeyError: no such benchmark.
        """
        for r in self.rows:
            if r.benchmark == benchmark:
                return r
        raise KeyError(f"no benchmark {benchmark!r} in this result ({', '.join(r.benchmark for r in self.rows)})")

    def to_dict(self) -> dict[str, Any]:
        """Plain data (the summary.json layout): values in [0, 1]; ``_se`` and ``_ci`` keys beside each pass@k."""
        return {
            "benchmarks": [
                {
                    "benchmark": r.benchmark,
                    "problems": r.problems,
                    "samples": r.samples,
                    **_flat(r.metrics, r.se, r.ci),
                    **_flat_lengths(r.lengths, r.lengths_se),
                }
                for r in self.rows
            ],
            "average": {
                **_flat(self.average, self.average_se, self.average_ci),
                **_flat_lengths(self.average_lengths, self.average_lengths_se),
            },
            "uncertainty": {
                "se": "standard error over problems (average: benchmarks combined as independent)",
                "length": "mean response length in tokens over all / correct / wrong samples; se clustered by problem",
                "ci": "percentile bootstrap interval, " + _resampled(self.resample_samples),
                "replicates": self.replicates,
                "seed": self.seed,
                "confidence": self.confidence,
            },
        }

    def to_csv(self) -> str:
        """CSV: one row per benchmark and an "average" row; pass@k and length columns.

        ``pass@k``, ``pass@k_se``, ``pass@k_ci_low/high``, then ``length``, ``length_se``, ``length_correct``, ...
        (tokens; columns only where some benchmark has them).
        """
        buf = io.StringIO()
        writer = csv.writer(buf, lineterminator="\n")
        header = ["benchmark", "problems", "samples"]
        for c in self.columns:
            header += [c, f"{c}_se", f"{c}_ci_low", f"{c}_ci_high"]
        for c in self.length_columns:
            header += [c, f"{c}_se"]
        writer.writerow(header)

        def values(metrics: dict, se: dict, ci: dict, lengths: dict, lengths_se: dict) -> list:
            out: list = []
            for c in self.columns:
                low, high = ci.get(c, ("", ""))
                out += [metrics.get(c, ""), se.get(c, ""), low, high]
            for c in self.length_columns:
                out += [lengths.get(c, ""), lengths_se.get(c, "")]
            return out

        for r in self.rows:
            writer.writerow(
                [r.benchmark, r.problems, r.samples, *values(r.metrics, r.se, r.ci, r.lengths, r.lengths_se)]
            )
        average = values(self.average, self.average_se, self.average_ci, self.average_lengths, self.average_lengths_se)
        writer.writerow(["average", "", "", *average])
        return buf.getvalue()

    def to_markdown(self) -> str:
        """Markdown table in percent (as the paper's tab. 2): ``mean ± se [95% interval]`` per cell."""
        cols = self.columns

        def cell(metrics: dict, se: dict, ci: dict, c: str) -> str:
            return _cell(metrics[c], se.get(c), ci.get(c)) if c in metrics else "-"

        lengths = self.length_columns
        titles = [f"{c} (%)" for c in cols] + [f"{LENGTHS[c]} (tokens)" for c in lengths]
        lines = [
            "| benchmark | problems | samples | " + " | ".join(titles) + " |",
            "|---|---:|---:|" + "---:|" * len(titles),
        ]
        for r in self.rows:
            cells = " | ".join(
                [cell(r.metrics, r.se, r.ci, c) for c in cols]
                + [_length_cell(r.lengths, r.lengths_se, c) for c in lengths]
            )
            lines.append(f"| {r.benchmark} | {r.problems} | {r.samples} | {cells} |")
        cells = " | ".join(
            [cell(self.average, self.average_se, self.average_ci, c) for c in cols]
            + [_length_cell(self.average_lengths, self.average_lengths_se, c) for c in lengths]
        )
        lines.append(f"| average | | | {cells} |")
        note = "± standard error over problems"
        if lengths:
            note += " (lengths: mean tokens of the samples, standard error clustered by problem)"
        if self.replicates:
            note += (
                f"; [ ] {round(100 * self.confidence)}% bootstrap interval ({_resampled(self.resample_samples)}; "
                f"{self.replicates} replicates, seed {self.seed})"
            )
        return "\n".join(lines) + f"\n\n{note}.\n"

    def __str__(self) -> str:
        return self.to_markdown()


def _correct(records: Sequence[dict[str, Any]]) -> dict[str, dict[int, list[bool]]]:
    """Map benchmark -> problem index -> correctness of each sample (benchmarks in order of first appearance)."""
    if not records:
        raise ValueError("no records to summarise")
    correct: dict[str, dict[int, list[bool]]] = {}
    seen: set[tuple[str, int, int]] = set()
    for r in records:
        key = (r["benchmark"], int(r["problem_index"]), int(r["sample_index"]))
        if key in seen:
            raise ValueError(f"record for benchmark {key[0]!r} problem {key[1]} sample {key[2]} appears twice")
        seen.add(key)
        if r.get("score") is None:
            raise ValueError(f"record for benchmark {key[0]!r} problem {key[1]} sample {key[2]} has no score")
        correct.setdefault(key[0], {}).setdefault(key[1], []).append(float(r["score"]) > 0.5)
    return correct


def _token_counts(records: Sequence[dict[str, Any]]) -> dict[str, dict[int, list[tuple[int, bool]]]]:
    """Map benchmark -> problem index -> (response tokens, correct) of each sample.

    Only benchmarks whose every record has an integer ``response_tokens`` (older or imported results may lack it).
    """
    out: dict[str, dict[int, list[tuple[int, bool]]]] = {}
    lacking: set[str] = set()
    for r in records:
        tokens = r.get("response_tokens")
        if not isinstance(tokens, int) or isinstance(tokens, bool):
            lacking.add(r["benchmark"])
            continue
        out.setdefault(r["benchmark"], {}).setdefault(int(r["problem_index"]), []).append(
            (tokens, float(r["score"]) > 0.5)
        )
    return {bench: problems for bench, problems in out.items() if bench not in lacking}


def _length_totals(samples: Sequence[tuple[int, bool]], which: str) -> tuple[float, float]:
    """(sum of tokens, count) of one problem's samples: all of them, or the correct or the wrong ones."""
    chosen = [t for t, ok in samples if which == "length" or ok == (which == "length_correct")]
    return float(sum(chosen)), float(len(chosen))


def _lengths_of(problems: dict[int, list[tuple[int, bool]]], order: Sequence[int]) -> dict[str, tuple[float, float]]:
    """``LENGTHS`` key -> (mean tokens, standard error clustered by problem), the keys that have a sample."""
    out = {}
    for key in LENGTHS:
        totals, counts = zip(*(_length_totals(problems[p], key) for p in order), strict=True)
        if sum(counts) > 0:
            out[key] = stats.ratio_mean_se(totals, counts)
    return out


def summarize(
    records: Sequence[dict[str, Any]],
    *,
    replicates: int = DEFAULT_REPLICATES,
    seed: int = 0,
    confidence: float = DEFAULT_CONFIDENCE,
    resample_samples: bool = True,
) -> EvalSummary:
    """pass@k per benchmark with standard errors and bootstrap intervals, and the average over benchmarks.

    Args:
        records: dicts with ``benchmark``, ``problem_index``, ``sample_index`` and a numeric ``score``.
        replicates: bootstrap replicates (0: standard errors only).
        seed: bootstrap seed (each benchmark draws from its own stream derived from it and its name).
        confidence: interval level.
        resample_samples: redraw samples within the drawn problems too (False: problems only).

    Raises:
        ValueError: a record without a score, a repeated (benchmark, problem, sample), no records.
    """
    rows, reps = [], {}
    tokens = _token_counts(records)
    for bench, problems in _correct(records).items():
        order = sorted(problems)
        n = [len(problems[p]) for p in order]
        c = [sum(problems[p]) for p in order]
        samples = min(n)
        if samples != max(n):
            logger.warning(
                "%s: problems have %d to %d samples; pass@k is reported up to k=%d", bench, samples, max(n), samples
            )
        counts = dict(zip(order, zip(n, c, strict=True), strict=True))
        row = BenchmarkResult(bench, len(order), samples, counts=counts)
        ks = ks_for(samples)
        for k in ks:
            values = [pass_at_k(a, b, k) for a, b in zip(n, c, strict=True)]
            row.metrics[f"pass@{k}"], row.se[f"pass@{k}"] = stats.mean_se(values)
        if replicates:
            reps[bench] = stats.bootstrap_pass_at_k(
                n, c, ks, replicates=replicates, seed=_bench_seed(seed, bench), resample_samples=resample_samples
            )
            for k, interval in zip(ks, stats.percentile_interval(reps[bench], confidence), strict=True):
                row.ci[f"pass@{k}"] = (float(interval[0]), float(interval[1]))
        if bench in tokens:
            for key, (mean, se) in _lengths_of(tokens[bench], order).items():
                row.lengths[key], row.lengths_se[key] = mean, se
        rows.append(row)
    summary = EvalSummary(
        rows, {}, replicates=replicates, seed=seed, confidence=confidence, resample_samples=resample_samples
    )
    for key in LENGTHS:
        if all(key in r.lengths for r in rows):
            summary.average_lengths[key] = math.fsum(r.lengths[key] for r in rows) / len(rows)
            summary.average_lengths_se[key] = stats.combined_se([r.lengths_se[key] for r in rows])
    shared = sorted(set.intersection(*(set(r.metrics) for r in rows)), key=_k_of)
    for col in shared:
        summary.average[col] = math.fsum(r.metrics[col] for r in rows) / len(rows)
        summary.average_se[col] = stats.combined_se([r.se[col] for r in rows])
        if replicates:
            per_bench = [reps[r.benchmark][ks_for(r.samples).index(_k_of(col))] for r in rows]
            low, high = stats.percentile_interval(np.mean(per_bench, axis=0), confidence)
            summary.average_ci[col] = (float(low), float(high))
    return summary


def write_results(
    records: Sequence[dict[str, Any]],
    out_dir: str | os.PathLike,
    *,
    replicates: int = DEFAULT_REPLICATES,
    seed: int = 0,
    confidence: float = DEFAULT_CONFIDENCE,
    resample_samples: bool = True,
) -> EvalSummary:
    """Write ``responses.jsonl`` (one record per line) and ``summary.{md,csv,json}`` into ``out_dir``.

    The keyword arguments are :func:`summarize`'s.
    """
    summary = summarize(
        records, replicates=replicates, seed=seed, confidence=confidence, resample_samples=resample_samples
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    order = {b.benchmark: i for i, b in enumerate(summary.rows)}
    ordered = sorted(records, key=lambda r: (order[r["benchmark"]], int(r["problem_index"]), int(r["sample_index"])))
    _write_text(out / RESPONSES_FILE, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in ordered))
    _write_tables(summary, out, "summary")
    return summary


def _write_text(path: Path, text: str) -> None:
    """Write a file atomically: a temporary file beside it, flushed, renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _write_tables(table: Any, out: Path, stem: str) -> Path:
    """``<stem>.{md,csv,json}`` of a table object (``to_markdown``, ``to_csv``, ``to_dict``); the Markdown path."""
    out.mkdir(parents=True, exist_ok=True)
    _write_text(out / f"{stem}.md", table.to_markdown())
    _write_text(out / f"{stem}.csv", table.to_csv())
    _write_text(out / f"{stem}.json", json.dumps(table.to_dict(), indent=1) + "\n")
    return out / f"{stem}.md"


# ----------------------------------------------------------------------------------------------------------------------
# Several runs of one setting


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
                    cells.append(f"{_pct(s['mean'])} ± {_pct(s['sd'])} [{_pct(s['min'])}, {_pct(s['max'])}]")
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
                    cells.append(_cell(run.average[first], run.average_se.get(first), None))
                else:
                    r = run.row(bench)
                    cells.append(_cell(r.metrics[first], r.se.get(first), None))
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
        rows[bench] = {m: [r.metrics[m] for r in per_run] for m in sorted(metrics, key=_k_of)}
        rows[bench] |= {k: [r.lengths[k] for r in per_run] for k in LENGTHS if all(k in r.lengths for r in per_run)}
    if len(shared) == len(names) and all(len(s.rows) == len(names) for s in summaries):
        metrics = set.intersection(*(set(s.average) for s in summaries))
        rows["average"] = {m: [s.average[m] for s in summaries] for m in sorted(metrics, key=_k_of)}
        rows["average"] |= {
            k: [s.average_lengths[k] for s in summaries]
            for k in LENGTHS
            if all(k in s.average_lengths for s in summaries)
        }
    return RunsSummary(list(labels), list(summaries), rows)


def write_runs(runs: RunsSummary, out_dir: str | os.PathLike) -> Path:
    """Write ``runs.{md,csv,json}`` into ``out_dir``; returns the Markdown path."""
    return _write_tables(runs, Path(out_dir), "runs")


# ----------------------------------------------------------------------------------------------------------------------
# Two results, paired by problem


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
            f"{_resampled(self.resample_samples)}; {self.replicates} replicates, seed {self.seed}).",
            "",
            "| benchmark | metric | problems | A | B | A - B | ± se | interval | problems A > B / A < B |" + titles,
            "|---|---|---:|---:|---:|---:|---:|---|---:|" + "---:|" * len(lengths),
        ]
        for r in self.rows:
            interval = f"[{_pct(r.ci[0])}, {_pct(r.ci[1])}]" if r.ci is not None else "-"
            problems = "" if r.benchmark == "average" else str(r.problems)
            wins = "" if r.benchmark == "average" else f"{r.a_better} / {r.b_better}"
            cells = "".join(f" {_length_pair(r.lengths.get(c))} |" for c in lengths)
            lines.append(
                f"| {r.benchmark} | {r.metric} | {problems} | {_pct(r.a)} | {_pct(r.b)} | {100 * r.diff:+.2f} | "
                f"{_pct(r.se)} | {interval} | {wins} |{cells}"
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
            "bootstrap": _resampled(self.resample_samples),
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
        ta, na = zip(*(_length_totals(a[p], key) for p in problems), strict=True)
        tb, nb = zip(*(_length_totals(b[p], key) for p in problems), strict=True)
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
    ca, cb = _correct(records_a), _correct(records_b)
    tokens_a, tokens_b = _token_counts(records_a), _token_counts(records_b)
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
                seed=_bench_seed(seed, bench),
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


def write_comparison(comparison: Comparison, out_dir: str | os.PathLike) -> Path:
    """Write ``comparison.{md,csv,json}`` into ``out_dir``; returns the Markdown path."""
    return _write_tables(comparison, Path(out_dir), "comparison")


# ----------------------------------------------------------------------------------------------------------------------
# pass@k against k


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
            cols_k = sorted(metrics, key=_k_of)
            ks = [_k_of(c) for c in cols_k]
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


# ----------------------------------------------------------------------------------------------------------------------
# Re-grading a responses file


def _read_records(path: Path) -> tuple[list[dict[str, Any]], list[int]]:
    """Records and their line numbers; a bad line raises ``FILE:LINE: what``."""
    if not path.is_file():
        raise FileNotFoundError(f"responses file not found: {path}")
    records, lines = [], []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: invalid JSON: {err.msg}") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            for key, kind in (("benchmark", str), ("problem_index", int), ("sample_index", int), ("response", str)):
                if not isinstance(rec.get(key), kind) or isinstance(rec.get(key), bool):
                    raise ValueError(f"{path}:{lineno}: field {key!r} missing or not of type {kind.__name__}")
            score = rec.get("score")
            if score is not None and (isinstance(score, bool) or not isinstance(score, (int, float))):
                raise ValueError(f"{path}:{lineno}: field 'score' is not a number")
            records.append(rec)
            lines.append(lineno)
    if not records:
        raise ValueError(f"{path}: no records")
    return records, lines


def result_file(path: str | os.PathLike) -> Path:
    """The ``responses.jsonl`` of a results folder, or ``path`` itself when it is a file.

    Raises:
        FileNotFoundError: neither a file nor a folder holding responses.jsonl.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / RESPONSES_FILE).is_file():
            raise FileNotFoundError(f"results folder {path} has no {RESPONSES_FILE}")
        return path / RESPONSES_FILE
    if not path.is_file():
        raise FileNotFoundError(f"results not found: {path} (a folder holding {RESPONSES_FILE}, or such a file)")
    return path


def result_label(path: str | os.PathLike) -> str:
    """A short name for a result: its folder's name (the parent folder's for a responses file)."""
    path = Path(path).resolve()
    return path.parent.name if path.is_file() else path.name


def load_results(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The graded records of a results folder or responses file.

    Raises:
        FileNotFoundError: no such results.
        ValueError: a bad line, or a record without a score (``FILE:LINE: ...``).
    """
    file = result_file(path)
    records, lines = _read_records(file)
    for r, line in zip(records, lines, strict=True):
        if r.get("score") is None:
            raise ValueError(f"{file}:{line}: record has no score; grade it first: nemo-disco eval --responses {file}")
    return records


def _benchmark_problems(name_or_path: str) -> list[Any]:
    """A benchmark's problems: a shipped name, a file, or a synthetic task (the CPU demo's held-out split)."""
    text = str(name_or_path)
    problems, _ = load_problems(text if text.startswith("synthetic:") else resolve_benchmark(text))
    return problems


def _benchmark_key(name_or_path: str) -> str:
    """The name records use for a benchmark: the name itself, or a file's stem."""
    return name_or_path if name_or_path in BENCHMARKS else Path(name_or_path).stem


def grade_responses_file(
    path: str | os.PathLike,
    benchmarks: Sequence[str] | None = None,
    grader: str = "math_verify",
    *,
    out_dir: str | os.PathLike | None = None,
    regrade: bool = False,
    timeout_s: float = 5.0,
    workers: int = 2,
    replicates: int = DEFAULT_REPLICATES,
    seed: int = 0,
    resample_samples: bool = True,
) -> EvalSummary:
    """Tabulate a ``responses.jsonl``; records without a score (all of them with ``regrade``) are graded.

    Gold answers come from the benchmark files (``benchmarks`` names or paths; a record's ``benchmark``
    is the name, or the file's stem), so another grader's verdict can be compared on the same responses.

    Args:
        path: the JSONL file (see the module docstring).
        benchmarks: benchmarks to tabulate (None: every benchmark in the file).
        grader: "math_verify" or "deepscaler".
        out_dir: if given, write the graded records and tables there (:func:`write_results`).
        regrade: grade every record, replacing stored scores.
        timeout_s: per-item grading limit.
        workers: grading processes.
        replicates: bootstrap replicates of the intervals (0: none).
        seed: bootstrap seed.
        resample_samples: the bootstrap redraws samples within problems too (False: problems only).

    Raises:
        ValueError: a bad line (``FILE:LINE: what``), a problem index the benchmark lacks, nothing to tabulate.
        FileNotFoundError: the file or a needed benchmark file is missing.
    """
    path = result_file(path)
    records, lines = _read_records(path)
    sources = {_benchmark_key(b): b for b in benchmarks} if benchmarks is not None else None
    if sources is not None:
        keep = [i for i, r in enumerate(records) if r["benchmark"] in sources]
        if len(keep) < len(records):
            logger.info("%s: %d records of other benchmarks left out", path, len(records) - len(keep))
        rank = {key: n for n, key in enumerate(sources)}
        keep.sort(key=lambda i: rank[records[i]["benchmark"]])  # tables list benchmarks in the order given
        records, lines = [dict(records[i]) for i in keep], [lines[i] for i in keep]
        if not records:
            raise ValueError(f"{path}: no records of benchmarks {', '.join(sources)}")
    else:
        records = [dict(r) for r in records]
    todo = [i for i, r in enumerate(records) if regrade or r.get("score") is None]
    if todo:
        answers: dict[str, dict[int, Any]] = {}
        truths = []
        for i in todo:
            bench = records[i]["benchmark"]
            if bench not in answers:
                source = sources[bench] if sources is not None else bench
                problems = _benchmark_problems(source)
                answers[bench] = {p.index: p.answer for p in problems}
            idx = records[i]["problem_index"]
            if idx not in answers[bench]:
                raise ValueError(
                    f"{path}:{lines[i]}: problem_index {idx} is not in benchmark {bench!r} "
                    f"({len(answers[bench])} problems)"
                )
            truths.append(answers[bench][idx])
        from nemo_disco.rewards import GraderPool

        with GraderPool(grader, timeout_s=timeout_s, workers=workers) as pool:
            scores, metrics = pool.score([records[i]["response"] for i in todo], truths)
        if metrics["reward/timeouts"] or metrics["reward/errors"]:
            logger.warning(
                "grading: %d timeouts, %d errors (scored 0)", metrics["reward/timeouts"], metrics["reward/errors"]
            )
        for i, s in zip(todo, scores, strict=True):
            records[i]["score"] = s
    kwargs = {"replicates": replicates, "seed": seed, "resample_samples": resample_samples}
    return write_results(records, out_dir, **kwargs) if out_dir is not None else summarize(records, **kwargs)


# ----------------------------------------------------------------------------------------------------------------------
# Generating and grading


EVAL_PARTIAL = "partial"
EVAL_SETTINGS = "settings.json"
DEFAULT_CHUNK_PROBLEMS = 32
#: how long a process that has finished its share waits for the others (a barrier) before giving up.
_WAIT_MINUTES = 24 * 60


def chunk_seed(seed: int, benchmark: str, chunk: int) -> int:
    """The sampling seed of one chunk of a benchmark: from (seed, benchmark, chunk index) only.

    A chunk's responses therefore do not depend on which process generates it, in which order, or whether
    the evaluation was interrupted before it: a resumed or data-parallel evaluation equals a plain one.
    """
    digest = hashlib.sha256(f"{seed}/{benchmark}/{chunk}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2**31)


@dataclass(frozen=True)
class _Chunk:
    benchmark: str
    index: int
    problems: list[Any]
    prompt_ids: list[list[int]]

    @property
    def key(self) -> tuple[str, int]:
        return (self.benchmark, self.index)


def _chunks(sets: Sequence[tuple[str, list[Any], list[list[int]]]], size: int) -> list[_Chunk]:
    """Every benchmark's kept problems cut into chunks of ``size`` (the last one shorter), benchmark by benchmark."""
    return [
        _Chunk(bench, k, problems[start : start + size], ids[start : start + size])
        for bench, problems, ids in sets
        for k, start in enumerate(range(0, len(problems), size))
    ]


def _read_partial(folder: Path) -> list[dict[str, Any]]:
    """Records appended so far by every process (a line cut short by a kill is skipped)."""
    records = []
    for f in sorted(folder.glob("part-*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                records.append(record)
    return records


def _complete(records: Sequence[dict[str, Any]], chunks: Sequence[_Chunk], samples: int) -> dict[tuple, list[dict]]:
    """The chunks all of whose ``samples`` records per problem are written: chunk key -> its records."""
    where = {(c.benchmark, p.index): c.key for c in chunks for p in c.problems}
    unique: dict[tuple[str, int, int], dict[str, Any]] = {}
    for r in records:
        key = (r.get("benchmark"), r.get("problem_index"), r.get("sample_index"))
        if (key[0], key[1]) in where and isinstance(key[2], int) and 0 <= key[2] < samples:
            unique[key] = r
    by_chunk: dict[tuple, list[dict]] = {}
    for (bench, problem, _), r in unique.items():
        by_chunk.setdefault(where[(bench, problem)], []).append(r)
    sizes = {c.key: len(c.problems) * samples for c in chunks}
    return {k: rs for k, rs in by_chunk.items() if len(rs) == sizes[k]}


def _append_records(path: Path, records: Sequence[dict[str, Any]]) -> None:
    """Append records as JSON lines in one write, flushed to disk (a kill loses at most the chunk being written).

    A line left unfinished by a kill is closed first, so the records after it start on a line of their own.
    """
    cut = False
    if path.is_file() and path.stat().st_size:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            cut = f.read(1) != b"\n"
    with path.open("a", encoding="utf-8") as f:
        f.write("\n" * cut + "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
        f.flush()
        os.fsync(f.fileno())


def _prepare_out(out: Path, settings: dict[str, Any], overwrite: bool) -> None:
    """Rank 0: check ``out`` can be written, refuse to replace a finished result, and open (or reopen) ``partial/``.

    Raises:
        OutputError: ``out`` cannot be written; it holds a finished result and not ``overwrite``; it holds an
            interrupted evaluation with other settings and not ``overwrite``. One line each.
    """
    from nemo_disco.files import OutputError, check_writable

    check_writable(out, "--out folder")
    partial = out / EVAL_PARTIAL
    if overwrite:
        shutil.rmtree(partial, ignore_errors=True)
    elif (out / RESPONSES_FILE).is_file():
        raise OutputError(
            f"{out} already holds an evaluation ({RESPONSES_FILE}): pass --overwrite to replace it, or choose "
            "another --out"
        )
    saved = partial / EVAL_SETTINGS
    if saved.is_file():
        old = json.loads(saved.read_text())
        changed = [k for k in sorted(set(old) | set(settings)) if old.get(k) != settings.get(k)]
        if changed:
            k = changed[0]
            raise OutputError(
                f"{out} holds an interrupted evaluation with {k}={old.get(k)!r} (this command: {settings.get(k)!r}): "
                "rerun it with the same settings to continue it, or pass --overwrite to start over"
            )
        return
    partial.mkdir(parents=True, exist_ok=True)
    tmp = saved.with_suffix(".tmp")
    tmp.write_text(json.dumps(settings, indent=1) + "\n")
    os.replace(tmp, saved)


def _eval_group(world: int) -> Any:
    """A gloo group over every process for the evaluation's own coordination (long timeout: shares differ)."""
    from nemo_disco import distributed

    if world == 1:
        return None
    distributed.init(timeout_minutes=_WAIT_MINUTES)
    return distributed.new_gloo_group(_WAIT_MINUTES)


def evaluate_model(
    model_dir: str | os.PathLike,
    benchmarks: Sequence[str],
    *,
    samples: int = 16,
    temperature: float = 0.6,
    top_p: float = 0.95,
    max_tokens: int = 8192,
    backend: Literal["hf", "vllm"] = "vllm",
    out_dir: str | os.PathLike = "eval_results",
    grader: str = "math_verify",
    seed: int = 0,
    max_problems: int | None = None,
    template: str = DEFAULT_TEMPLATE,
    use_chat_template: bool = True,
    max_prompt_tokens: int | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    timeout_s: float = 5.0,
    workers: int = 2,
    tensor_parallel_size: int = 1,
    generator: Any | None = None,
    replicates: int = DEFAULT_REPLICATES,
    bootstrap_seed: int = 0,
    resample_samples: bool = True,
    chunk_problems: int = DEFAULT_CHUNK_PROBLEMS,
    overwrite: bool = False,
) -> EvalSummary | None:
    """Sample ``samples`` responses per benchmark problem, grade them, write and return the pass@k table.

    Nothing is lost: the problems are cut into chunks of ``chunk_problems``; each chunk's graded records are
    appended to ``out_dir/partial/part-<engine>.jsonl`` (flushed) as soon as it is done, and a rerun with the
    same settings continues from the chunks already written (one log line says how many). Each chunk is
    sampled with its own seed (:func:`chunk_seed`), so an interrupted and continued evaluation, or one split
    over data-parallel engines, gives exactly the records of an uninterrupted single-engine run. At the end
    ``responses.jsonl`` and ``summary.{md,csv,json}`` are written and ``partial/`` removed. A folder that holds
    a finished result is refused unless ``overwrite``.

    Data parallel: launched by torchrun / srun with W processes (one per GPU), the job runs W / ``tensor_
    parallel_size`` engines, each generating every E-th remaining chunk; process 0 merges. Every process calls
    this function; only process 0 returns the table (the others None).

    Args:
        model_dir: Hugging Face model folder (weights + tokenizer).
        benchmarks: benchmark names (``aime``, ``math``, ...) or DeepScaleR-format files.
        samples: responses per problem (the paper: 16).
        temperature: sampling temperature (the paper: 0.6).
        top_p: nucleus sampling (the authors' evaluation: 0.95).
        max_tokens: longest response (the paper: 8192 or 32768).
        backend: "vllm" or "hf" (transformers generate) when ``generator`` is None.
        out_dir: where the records and the tables are written.
        grader: "math_verify" or "deepscaler".
        seed: sampling seed (each chunk's seed derives from it, the benchmark and the chunk's index).
        max_problems: only the first N problems of each benchmark (smoke tests).
        template: prompt template (:func:`nemo_disco.data.format_prompt`).
        use_chat_template: wrap prompts in the tokenizer's chat template.
        max_prompt_tokens: drop (and log) longer prompts; None keeps all.
        chat_template_kwargs: extra chat-template variables (Qwen3: ``{"enable_thinking": True}``), as
            ``data.chat_template_kwargs`` in training.
        timeout_s: per-item grading limit.
        workers: grading processes (per engine).
        tensor_parallel_size: vLLM tensor parallelism (processes per engine).
        generator: an already built Generator (then ``backend`` is unused and it is not shut down here).
        replicates: bootstrap replicates of the intervals (0: none).
        bootstrap_seed: bootstrap seed.
        resample_samples: the bootstrap redraws samples within problems too (False: problems only).
        chunk_problems: problems per generation call: the unit of progress, resumption and data-parallel
            sharing. Part of the sampling: another value draws other responses.
        overwrite: replace a finished result in ``out_dir``, or an interrupted one with other settings.

    Raises:
        ValueError / FileNotFoundError: a model that cannot be loaded (one line naming it and what was
            tried), bad benchmark names, files or settings, an ``out_dir`` that cannot be written or holds
            another evaluation.
    """
    from transformers import AutoTokenizer

    from nemo_disco import distributed
    from nemo_disco.generation.base import SamplingParams
    from nemo_disco.rewards import GraderPool

    if samples < 1 or max_tokens < 1 or chunk_problems < 1:
        raise ValueError(f"samples={samples}, max_tokens={max_tokens} and chunk_problems={chunk_problems} must be >= 1")
    env = distributed.read_env()
    if env.world_size % tensor_parallel_size:
        raise ValueError(
            f"--tp {tensor_parallel_size} does not divide the {env.world_size} processes of the job (one per GPU)"
        )
    engines, engine, tp_rank = (
        env.world_size // tensor_parallel_size,
        env.rank // tensor_parallel_size,
        env.rank % tensor_parallel_size,
    )
    out = Path(out_dir)
    check_model(model_dir)
    with quiet_hub_logs():
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    sets = []
    for bench in benchmarks:
        problems = _benchmark_problems(bench)
        problems = problems[:max_problems] if max_problems else problems
        ids, kept, dropped = encode_prompts(
            tokenizer,
            problems,
            template=template,
            use_chat_template=use_chat_template,
            max_prompt_tokens=max_prompt_tokens,
            chat_template_kwargs=chat_template_kwargs,
        )
        if dropped and env.is_main:
            logger.warning("%s: %d prompts over %s tokens left out", bench, dropped, max_prompt_tokens)
        sets.append((_benchmark_key(bench), [problems[i] for i in kept], ids))
    chunks = _chunks(sets, chunk_problems)
    settings = json.loads(
        json.dumps(
            {
                "model": str(Path(model_dir).resolve()) if Path(model_dir).is_dir() else str(model_dir),
                "benchmarks": {bench: [p.index for p in problems] for bench, problems, _ in sets},
                "samples": samples,
                "temperature": temperature,
                "top_p": top_p,
                "max_tokens": max_tokens,
                "backend": backend if generator is None else type(generator).__name__,
                "grader": grader,
                "seed": seed,
                "template": template,
                "use_chat_template": use_chat_template,
                "chat_template_kwargs": dict(chat_template_kwargs or {}),
                "chunk_problems": chunk_problems,
            }
        )
    )
    group = _eval_group(env.world_size)
    # Process 0 checks and opens the output before any engine starts; the others learn the outcome from it.
    problem = None
    done: set[tuple] = set()
    if env.is_main:
        try:
            _prepare_out(out, settings, overwrite)
            done = set(_complete(_read_partial(out / EVAL_PARTIAL), chunks, samples))
        except ValueError as err:
            problem = str(err)
    if group is not None:
        problem, done = distributed.broadcast_object((problem, done), src=0, group=group)
    if problem is not None:
        from nemo_disco.files import OutputError

        raise OutputError(problem)
    todo = [c for c in chunks if c.key not in done]
    if env.is_main:
        print(
            f"evaluation into {out}: graded responses are appended to {out / EVAL_PARTIAL} as they are made",
            file=sys.stderr,
        )
    if done and env.is_main:
        print(
            f"resuming the evaluation in {out}: {len(done)} of {len(chunks)} chunks already written "
            f"({EVAL_PARTIAL}/), generating the other {len(todo)}",
            file=sys.stderr,
        )
    mine = todo[engine::engines]
    writer = tp_rank == 0
    part_file = out / EVAL_PARTIAL / f"part-{engine}.jsonl"
    longest = max((len(p) for _, _, ids in sets for p in ids), default=0)
    # Every process builds its engine, even one with no chunk left to it: vLLM's external launcher creates its
    # process groups collectively over the whole job.
    own = generator is None and bool(todo)
    if own:
        generator = build_generator(
            model_dir, backend, seed=seed, max_model_len=longest + max_tokens, tensor_parallel_size=tensor_parallel_size
        )
    sampling = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        max_tokens=max_tokens,
        stop_token_ids=stop_token_ids(tokenizer),
        seed=seed,
    )
    who = f"engine {engine + 1}/{engines}: " if engines > 1 else ""
    start = time.monotonic()
    try:
        with GraderPool(grader, timeout_s=timeout_s, workers=workers) if writer and mine else nullcontext() as pool:
            for n, chunk in enumerate(mine, 1):
                chunk_sampling = replace(sampling, seed=chunk_seed(seed, chunk.benchmark, chunk.index))
                rollouts = generator.generate(chunk.prompt_ids, samples, chunk_sampling)  # [P][samples]
                if not writer:
                    continue
                _append_records(part_file, _graded(chunk, rollouts, tokenizer, pool, samples))
                first = chunk.problems[0].index
                logger.info(
                    "%s%s problems %d-%d: %d responses graded and written; %d/%d chunks, %.0f s",
                    who,
                    chunk.benchmark,
                    first,
                    chunk.problems[-1].index,
                    len(chunk.problems) * samples,
                    n,
                    len(mine),
                    time.monotonic() - start,
                )
    except KeyboardInterrupt:
        if writer:
            print(
                f"interrupted: the responses written so far are kept in {out / EVAL_PARTIAL}; rerun the same "
                "command to continue",
                file=sys.stderr,
            )
        raise
    finally:
        if own:
            generator.shutdown()
    if group is not None:
        distributed.barrier(group)
    if not env.is_main:
        return None
    complete = _complete(_read_partial(out / EVAL_PARTIAL), chunks, samples)
    missing = [c.key for c in chunks if c.key not in complete]
    if missing:
        raise RuntimeError(f"{out / EVAL_PARTIAL}: chunks {missing[:3]} are missing after generation")
    records = [r for c in chunks for r in complete[c.key]]
    summary = write_results(records, out, replicates=replicates, seed=bootstrap_seed, resample_samples=resample_samples)
    shutil.rmtree(out / EVAL_PARTIAL, ignore_errors=True)
    return summary


def _graded(chunk: _Chunk, rollouts: list[list[Any]], tokenizer: Any, pool: Any, samples: int) -> list[dict]:
    """The records of one chunk: decoded, graded."""
    texts = [tokenizer.decode(r.token_ids, skip_special_tokens=True) for rs in rollouts for r in rs]
    scores, metrics = pool.score(texts, [p.answer for p in chunk.problems for _ in range(samples)])
    if metrics["reward/timeouts"] or metrics["reward/errors"]:
        logger.warning(
            "%s: grading had %d timeouts, %d errors (scored 0)",
            chunk.benchmark,
            metrics["reward/timeouts"],
            metrics["reward/errors"],
        )
    flat = [(p, j, r) for p, rs in zip(chunk.problems, rollouts, strict=True) for j, r in enumerate(rs)]
    return [
        {
            "benchmark": chunk.benchmark,
            "problem_index": p.index,
            "sample_index": j,
            "response": text,
            "score": score,
            "answer": p.answer,
            "finish_reason": r.finish_reason,
            "response_tokens": len(r.token_ids),
        }
        for (p, j, r), text, score in zip(flat, texts, scores, strict=True)
    ]
