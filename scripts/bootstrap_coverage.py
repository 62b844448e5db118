"""Coverage of nemo_disco's pass@k intervals in simulation (the figures in docs/evaluation.md).

Problems are drawn from a population whose per-sample success probability p is 0, 0.05, 0.2, 0.5 or 0.9
with equal weight (true pass@k: the mean of 1 - (1 - p)^k); each simulated benchmark draws P problems and
n samples per problem, and we count how often each interval holds the true value.

    .venv/bin/python scripts/bootstrap_coverage.py            # about a minute on one core
"""

from __future__ import annotations

import argparse

import numpy as np

from nemo_disco.stats import (
    _pass_table,
    bootstrap_pass_at_k,
    mean_se,
    paired_bootstrap_pass_at_k,
    paired_difference,
    pass_at_k,
    percentile_interval,
)

POPULATION = np.array([0.0, 0.05, 0.2, 0.5, 0.9])
DEFAULT = "default (problems; samples too for pass@1)"
REDRAW_ALL = "samples redrawn for every k (not used)"


def _redraw_every_k(
    samples: int, c: np.ndarray, ks: list[int], replicates: int, rng: np.random.Generator
) -> np.ndarray:
    """The rejected variant: problems, then every problem's samples redrawn with replacement, for every k."""
    idx = rng.integers(0, c.size, size=(replicates, c.size))
    redrawn = rng.binomial(samples, c[idx] / samples)
    n = np.full(c.size, samples)
    return np.stack([_pass_table(n, k)[np.full_like(redrawn, samples), redrawn].mean(axis=1) for k in ks])


def coverage(problems: int, samples: int, ks: list[int], benchmarks: int, replicates: int, seed: int) -> list[str]:
    """Coverage of the pass@k intervals of one setting (Markdown rows)."""
    rng = np.random.default_rng(seed)
    true = np.array([np.mean(1 - (1 - POPULATION) ** k) for k in ks])
    names = (DEFAULT, "problems only", REDRAW_ALL, "mean ± 1.96 se")
    hits = {name: np.zeros(len(ks)) for name in names}
    for _ in range(benchmarks):
        c = rng.binomial(samples, rng.choice(POPULATION, problems))
        for name, redraw in ((DEFAULT, True), ("problems only", False)):
            reps = bootstrap_pass_at_k(
                [samples] * problems, c, ks, replicates=replicates, seed=rng, resample_samples=redraw
            )
            iv = percentile_interval(reps)
            hits[name] += (iv[:, 0] <= true) & (true <= iv[:, 1])
        iv = percentile_interval(_redraw_every_k(samples, c, ks, replicates, rng))
        hits[REDRAW_ALL] += (iv[:, 0] <= true) & (true <= iv[:, 1])
        for i, k in enumerate(ks):
            mean, se = mean_se([pass_at_k(samples, x, k) for x in c])
            hits["mean ± 1.96 se"][i] += abs(mean - true[i]) <= 1.96 * se
    rows = []
    for name, h in hits.items():
        cells = ", ".join(f"pass@{k} {v / benchmarks:.3f}" for k, v in zip(ks, h, strict=True))
        rows.append(f"| {problems} x {samples} | {name} | {cells} |")
    return rows


def paired_coverage(problems: int, samples: int, benchmarks: int, replicates: int, seed: int) -> list[str]:
    """A - B of pass@1 where B's p is A's + 0.1 (capped at 1): the true difference is the mean of the shifts."""
    rng = np.random.default_rng(seed)
    true = float(np.mean(POPULATION - np.minimum(POPULATION + 0.1, 1.0)))
    both, problems_only, normal = (
        "paired, problems and samples",
        "paired, problems only (compare's default)",
        "paired, mean ± 1.96 se",
    )
    hits = {both: 0, problems_only: 0, normal: 0}
    for _ in range(benchmarks):
        p = rng.choice(POPULATION, problems)
        ca, cb = rng.binomial(samples, p), rng.binomial(samples, np.minimum(p + 0.1, 1.0))
        n = [samples] * problems
        for name, redraw in ((both, True), (problems_only, False)):
            reps = paired_bootstrap_pass_at_k(
                n, ca, n, cb, [1], replicates=replicates, seed=rng, resample_samples=redraw
            )
            low, high = percentile_interval(reps)[0]
            hits[name] += low <= true <= high
        diff, se = paired_difference(ca / samples, cb / samples)
        hits[normal] += abs(diff - true) <= 1.96 * se
    return [f"| {problems} x {samples} | {name} | A - B of pass@1 {v / benchmarks:.3f} |" for name, v in hits.items()]


def main() -> None:
    """Print the coverage table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--benchmarks", type=int, default=300, help="simulated benchmarks per setting")
    p.add_argument("--replicates", type=int, default=400)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    print("| problems x samples | interval | coverage of a nominal 95% interval |")
    print("|---|---|---|")
    for problems, samples in ((30, 16), (500, 16)):
        for line in coverage(problems, samples, [1, 4, 8, 16], args.benchmarks, args.replicates, args.seed):
            print(line)
    for problems, samples in ((30, 16), (500, 16)):
        for line in paired_coverage(problems, samples, args.benchmarks, args.replicates, args.seed):
            print(line)


if __name__ == "__main__":
    main()
