"""One result's pass@k table: per-benchmark pass@k and response lengths with standard errors and intervals.

:func:`summarize` turns graded records into an :class:`EvalSummary` (Markdown, CSV and plain-data views);
``ks_for`` names the k reported. The helpers the other tables of :mod:`nemo_disco.evaluation` share live here
too: records grouped by problem (``correct_by_problem``, ``token_counts``, ``length_totals``), a benchmark's
bootstrap stream (``bench_seed``) and the cell formats (``pct``, ``percent_cell``, ``bootstrap_draws``).
"""

from __future__ import annotations

import csv
import hashlib
import io
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from nemo_disco import stats
from nemo_disco.stats import DEFAULT_CONFIDENCE, DEFAULT_REPLICATES, pass_at_k

logger = logging.getLogger(__name__)

__all__ = ["LENGTHS", "BenchmarkResult", "EvalSummary", "ks_for", "summarize"]


def ks_for(samples: int) -> list[int]:
    """The k reported for ``samples`` samples per problem: powers of two below it, and it."""
    ks, k = [], 1
    while k < samples:
        ks.append(k)
        k *= 2
    return ks + [samples]


def k_of(metric: str) -> int:
    """The k of a "pass@k" key."""
    return int(metric.split("@")[1])


def pct(v: float) -> str:
    """A value in [0, 1] in percent, two decimals."""
    return f"{100 * v:.2f}"


def bench_seed(seed: int, bench: str) -> np.random.Generator:
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


def bootstrap_draws(samples: bool) -> str:
    """What the bootstrap redraws, for a table's note (``samples``: the samples within problems too)."""
    return "problems resampled, and for pass@1 the samples within them" if samples else "problems resampled"


def percent_cell(value: float, se: float | None, ci: tuple[float, float] | None) -> str:
    """``value ± se [low, high]`` in percent; the standard error and the interval where given."""
    text = pct(value)
    if se is not None:
        text += f" ± {pct(se)}"
    if ci is not None:
        text += f" [{pct(ci[0])}, {pct(ci[1])}]"
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
    for key in sorted(metrics, key=k_of):
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
        return sorted(keys, key=k_of)

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
                "ci": "percentile bootstrap interval, " + bootstrap_draws(self.resample_samples),
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
            return percent_cell(metrics[c], se.get(c), ci.get(c)) if c in metrics else "-"

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
                f"; [ ] {round(100 * self.confidence)}% bootstrap interval ({bootstrap_draws(self.resample_samples)}; "
                f"{self.replicates} replicates, seed {self.seed})"
            )
        return "\n".join(lines) + f"\n\n{note}.\n"

    def __str__(self) -> str:
        return self.to_markdown()


def correct_by_problem(records: Sequence[dict[str, Any]]) -> dict[str, dict[int, list[bool]]]:
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


def token_counts(records: Sequence[dict[str, Any]]) -> dict[str, dict[int, list[tuple[int, bool]]]]:
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


def length_totals(samples: Sequence[tuple[int, bool]], which: str) -> tuple[float, float]:
    """(sum of tokens, count) of one problem's samples: all of them, or the correct or the wrong ones."""
    chosen = [t for t, ok in samples if which == "length" or ok == (which == "length_correct")]
    return float(sum(chosen)), float(len(chosen))


def _lengths_of(problems: dict[int, list[tuple[int, bool]]], order: Sequence[int]) -> dict[str, tuple[float, float]]:
    """``LENGTHS`` key -> (mean tokens, standard error clustered by problem), the keys that have a sample."""
    out = {}
    for key in LENGTHS:
        totals, counts = zip(*(length_totals(problems[p], key) for p in order), strict=True)
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
    tokens = token_counts(records)
    for bench, problems in correct_by_problem(records).items():
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
                n, c, ks, replicates=replicates, seed=bench_seed(seed, bench), resample_samples=resample_samples
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
    shared = sorted(set.intersection(*(set(r.metrics) for r in rows)), key=k_of)
    for col in shared:
        summary.average[col] = math.fsum(r.metrics[col] for r in rows) / len(rows)
        summary.average_se[col] = stats.combined_se([r.se[col] for r in rows])
        if replicates:
            per_bench = [reps[r.benchmark][ks_for(r.samples).index(k_of(col))] for r in rows]
            low, high = stats.percentile_interval(np.mean(per_bench, axis=0), confidence)
            summary.average_ci[col] = (float(low), float(high))
    return summary
