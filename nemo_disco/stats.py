r"""Uncertainty of pass@k figures: standard errors over problems, bootstrap intervals, paired differences.

A pass@k over a benchmark is a mean over problems of per-problem values (Chen et al. 2021, eq. 1: with
``n`` samples of which ``c`` are correct, ``1 - C(n - c, k) / C(n, k)``; for pass@1 the share of correct
samples). Two sources of noise make it uncertain:

- **which problems**: a benchmark is one draw of problems; its standard error treats problems as the
  sampled units, ``se = sd(values) / sqrt(P)`` with the sample standard deviation (ddof 1);
- **which samples**: each problem's value is itself estimated from ``n`` samples.

:func:`bootstrap_pass_at_k` resamples problems (``P`` drawn with replacement) and, for pass@1, also the
samples of each drawn problem (``n`` drawn with replacement, which makes the correct count a binomial draw
``c* ~ Binomial(n, c / n)``); the percentile interval of the replicate means is reported. Samples are
redrawn for pass@1 only: pass@1 is linear in ``c`` so the redraw leaves it unbiased, while for k > 1 a
redraw with replacement duplicates samples and biases the estimator down (a nominal 95% interval covered
the true pass@16 of 500 problems x 16 samples in 36% of simulated benchmarks, against 94% with problems
only; ``docs/evaluation.md``). The problem-level draw carries the within-problem noise already, so
redrawing samples as well makes pass@1 intervals slightly wider.

Two runs on the same problems are compared per problem (:func:`paired_difference`,
:func:`paired_bootstrap_pass_at_k`): the between-problem spread both share cancels, which is what makes
"A beats B by 2 points" testable on 30 AIME problems.

Every bootstrap takes a ``seed`` (or a ``numpy.random.Generator``) so tables are reproducible.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

DEFAULT_REPLICATES = 2000
DEFAULT_CONFIDENCE = 0.95


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """Mean of ``values`` and its standard error ``sd / sqrt(n)`` (sd with ddof 1; se 0 for n < 2).

    Raises:
        ValueError: ``values`` is empty.
    """
    n = len(values)
    if n == 0:
        raise ValueError("mean_se needs at least one value")
    mean = math.fsum(values) / n
    if n < 2:
        return mean, 0.0
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def paired_difference(after: Sequence[float], before: Sequence[float]) -> tuple[float, float]:
    """Mean of ``after[i] - before[i]`` over problems and its standard error (paired by problem).

    Raises:
        ValueError: the two sequences differ in length or are empty.
    """
    if len(after) != len(before):
        raise ValueError(f"paired_difference needs values for the same problems ({len(after)} vs {len(before)})")
    return mean_se([a - b for a, b in zip(after, before, strict=True)])


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof 1; 0 for one value) of e.g. one figure over several seeds.

    Raises:
        ValueError: ``values`` is empty.
    """
    mean, se = mean_se(values)
    return mean, se * math.sqrt(len(values))


def ratio_mean_se(totals: Sequence[float], counts: Sequence[float]) -> tuple[float, float]:
    """``sum(totals) / sum(counts)`` over problems and its standard error clustered by problem.

    The mean of a per-sample quantity (a response length) over some samples of every problem (all of them, or
    only the correct ones): ``totals[p]`` is problem p's sum over its chosen samples, ``counts[p]`` their number
    (0 allowed). The samples of one problem are not independent, so the standard error treats problems as the
    units, as pass@k's does: the linearised (delta-method) ratio estimator
    ``se = sqrt(P / (P - 1) * sum_p z_p^2)`` with ``z_p = (totals[p] - R counts[p]) / sum(counts)`` (0 for P < 2).
    With the same count for every problem this is :func:`mean_se` of the per-problem means.

    Raises:
        ValueError: lengths differ, nothing given, or no sample counted.
    """
    z, ratio = _ratio_influence(totals, counts)
    return ratio, _cluster_se(z)


def paired_ratio_difference(
    totals_a: Sequence[float], counts_a: Sequence[float], totals_b: Sequence[float], counts_b: Sequence[float]
) -> tuple[float, float]:
    """``R_a - R_b`` of two :func:`ratio_mean_se` means on the same problems, its standard error paired by problem.

    ``z_p = z_a,p - z_b,p`` (each run's linearised term of problem p), so what the two runs share per problem cancels.

    Raises:
        ValueError: lengths differ, nothing given, or no sample counted in one run.
    """
    if len(totals_a) != len(totals_b):
        raise ValueError(f"paired_ratio_difference needs the same problems ({len(totals_a)} vs {len(totals_b)})")
    za, ra = _ratio_influence(totals_a, counts_a)
    zb, rb = _ratio_influence(totals_b, counts_b)
    return ra - rb, _cluster_se([a - b for a, b in zip(za, zb, strict=True)])


def _ratio_influence(totals: Sequence[float], counts: Sequence[float]) -> tuple[list[float], float]:
    if len(totals) != len(counts) or not totals:
        raise ValueError(f"need equal-length, non-empty per-problem totals and counts ({len(totals)}, {len(counts)})")
    n = math.fsum(counts)
    if n <= 0:
        raise ValueError("no sample counted")
    ratio = math.fsum(totals) / n
    return [(t - ratio * c) / n for t, c in zip(totals, counts, strict=True)], ratio


def _cluster_se(z: Sequence[float]) -> float:
    p = len(z)
    return math.sqrt(p / (p - 1) * math.fsum(v * v for v in z)) if p > 1 else 0.0


def combined_se(ses: Sequence[float]) -> float:
    """Standard error of the unweighted mean of independent estimates: ``sqrt(sum se_i^2) / m``.

    Raises:
        ValueError: ``ses`` is empty.
    """
    if not ses:
        raise ValueError("combined_se needs at least one standard error")
    return math.sqrt(math.fsum(s * s for s in ses)) / len(ses)


# ----------------------------------------------------------------------------------------------------------------------
# pass@k


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct out of ``n`` samples (Chen et al. 2021, eq. 1).

    Computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)`` (no large binomials).

    Raises:
        ValueError: unless 0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0  # every k-subset holds a correct sample
    # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k/i)
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def _pass_table(ns: np.ndarray, k: int) -> np.ndarray:
    """``T[n, c] = pass_at_k(n, c, k)`` for every ``n`` in ``ns`` and ``0 <= c <= n`` (NaN elsewhere)."""
    n_max = int(ns.max())
    table = np.full((n_max + 1, n_max + 1), np.nan)
    for n in np.unique(ns).tolist():
        # C(n-c, k) / C(n, k) for c = 0..n: a running product of (1 - k/i), i = n, n-1, ..., n-c+1.
        ratio = np.concatenate([[1.0], np.cumprod(1.0 - k / np.arange(n, 0, -1))])
        ratio[n - k + 1 :] = 0.0  # n - c < k: every k-subset holds a correct sample
        table[n, : n + 1] = 1.0 - ratio
    return table


def _counts(n: Sequence[int], c: Sequence[int], ks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    n_arr, c_arr = np.asarray(n, dtype=np.int64), np.asarray(c, dtype=np.int64)
    if n_arr.ndim != 1 or n_arr.shape != c_arr.shape or n_arr.size == 0:
        raise ValueError(f"need equal-length, non-empty per-problem counts (got {n_arr.shape} and {c_arr.shape})")
    if np.any(c_arr < 0) or np.any(c_arr > n_arr):
        raise ValueError("every problem needs 0 <= correct <= samples")
    if not ks or min(ks) < 1 or max(ks) > int(n_arr.min()):
        raise ValueError(f"k must lie in [1, {int(n_arr.min())}] (the fewest samples of a problem); got {list(ks)}")
    return n_arr, c_arr


def _rng(seed: int | np.random.Generator) -> np.random.Generator:
    return seed if isinstance(seed, np.random.Generator) else np.random.default_rng(seed)


def _draw_correct(nn: np.ndarray, cc: np.ndarray, rng: np.random.Generator, samples: bool) -> np.ndarray:
    """Correct counts of the drawn problems; with ``samples``, their n samples redrawn with replacement."""
    return rng.binomial(nn, cc / nn) if samples else cc  # n samples with replacement: c* ~ Binomial(n, c/n)


def _replicate_means(nn: np.ndarray, cc: np.ndarray, redrawn: np.ndarray, k: int, ns: np.ndarray) -> np.ndarray:
    """Mean pass@k over the drawn problems of each replicate; redrawn sample counts are used for k = 1 only."""
    return _pass_table(ns, k)[nn, redrawn if k == 1 else cc].mean(axis=1)


def bootstrap_pass_at_k(
    n: Sequence[int],
    c: Sequence[int],
    ks: Sequence[int],
    *,
    replicates: int = DEFAULT_REPLICATES,
    seed: int | np.random.Generator = 0,
    resample_samples: bool = True,
) -> np.ndarray:
    """Bootstrap replicates of a benchmark's pass@k: problems resampled, and samples too for pass@1.

    Args:
        n: samples of each problem.
        c: correct samples of each problem.
        ks: the k to report (each at most ``min(n)``).
        replicates: number of bootstrap replicates B.
        seed: seed or generator (fixed seed: the same replicates every time).
        resample_samples: for pass@1, also redraw each drawn problem's samples (False: problems only, a cluster
            bootstrap; k > 1 always resamples problems only, see the module docstring).

    Returns:
        ``[len(ks), B]`` replicate values of the benchmark's pass@k (mean over its problems).

    Raises:
        ValueError: bad counts or k.
    """
    n_arr, c_arr = _counts(n, c, ks)
    if replicates < 1:
        raise ValueError(f"replicates={replicates} must be >= 1")
    rng = _rng(seed)
    idx = rng.integers(0, n_arr.size, size=(replicates, n_arr.size))  # [B, P] problems with replacement
    nn, cc = n_arr[idx], c_arr[idx]
    redrawn = _draw_correct(nn, cc, rng, resample_samples)
    return np.stack([_replicate_means(nn, cc, redrawn, k, n_arr) for k in ks])


def paired_bootstrap_pass_at_k(
    n_a: Sequence[int],
    c_a: Sequence[int],
    n_b: Sequence[int],
    c_b: Sequence[int],
    ks: Sequence[int],
    *,
    replicates: int = DEFAULT_REPLICATES,
    seed: int | np.random.Generator = 0,
    resample_samples: bool = True,
) -> np.ndarray:
    """Bootstrap replicates of ``pass@k(A) - pass@k(B)`` on the same problems (row i of A and B: one problem).

    Each replicate draws one set of problems for both runs (the pairing), then, for pass@1 and with
    ``resample_samples``, each run's samples of each drawn problem independently.

    Returns:
        ``[len(ks), B]`` replicate differences.

    Raises:
        ValueError: bad counts or k, or A and B of different lengths.
    """
    na, ca = _counts(n_a, c_a, ks)
    nb, cb = _counts(n_b, c_b, ks)
    if na.size != nb.size:
        raise ValueError(f"paired bootstrap needs the same problems in both runs ({na.size} vs {nb.size})")
    if replicates < 1:
        raise ValueError(f"replicates={replicates} must be >= 1")
    rng = _rng(seed)
    idx = rng.integers(0, na.size, size=(replicates, na.size))  # [B, P], shared by both runs
    nna, nnb, cca, ccb = na[idx], nb[idx], ca[idx], cb[idx]
    reda = _draw_correct(nna, cca, rng, resample_samples)
    redb = _draw_correct(nnb, ccb, rng, resample_samples)
    ns = np.concatenate([na, nb])
    return np.stack([_replicate_means(nna, cca, reda, k, ns) - _replicate_means(nnb, ccb, redb, k, ns) for k in ks])


def percentile_interval(replicates: np.ndarray, confidence: float = DEFAULT_CONFIDENCE) -> np.ndarray:
    """Percentile bootstrap interval along the last axis: ``[..., 2]`` (low, high).

    Raises:
        ValueError: ``confidence`` outside (0, 1).
    """
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence} must lie in (0, 1)")
    tail = (1 - confidence) / 2
    return np.stack(np.quantile(replicates, [tail, 1 - tail], axis=-1), axis=-1)
