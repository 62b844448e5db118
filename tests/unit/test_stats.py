import itertools
import math

import numpy as np
import pytest

from nemo_disco.stats import (
    bootstrap_pass_at_k,
    combined_se,
    mean_sd,
    mean_se,
    paired_bootstrap_pass_at_k,
    paired_difference,
    paired_ratio_difference,
    pass_at_k,
    percentile_interval,
    ratio_mean_se,
)


def test_mean_se_hand_computed():
    # values 0, 0.5, 1: mean 0.5; sample variance ((0.25 + 0 + 0.25) / 2) = 0.25; se = sqrt(0.25 / 3)
    mean, se = mean_se([0.0, 0.5, 1.0])
    assert mean == 0.5
    assert se == pytest.approx(math.sqrt(0.25 / 3), abs=1e-15)


def test_mean_se_single_value_and_empty():
    assert mean_se([0.75]) == (0.75, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        mean_se([])


def test_paired_difference_removes_shared_problem_variance():
    before = [0.0, 0.25, 1.0, 0.5]
    after = [0.25, 0.5, 1.0, 0.75]  # differences 0.25, 0.25, 0, 0.25: mean 0.1875
    mean, se = paired_difference(after, before)
    assert mean == pytest.approx(0.1875)
    # sample variance of the differences: (3 * 0.0625^2 + 0.1875^2) / 3 = 0.015625; se = sqrt(0.015625 / 4)
    assert se == pytest.approx(math.sqrt(0.015625 / 4))
    assert se < mean_se(after)[1]  # pairing removes the between-problem spread
    with pytest.raises(ValueError, match="same problems"):
        paired_difference([1.0], [1.0, 0.0])


def test_ratio_mean_se_hand_computed():
    # Wrong responses' lengths: problem 0 one of 20 tokens, problem 1 two of 30 and 50 -> R = 100 / 3.
    # z = (total - R count) / 3: (20 - 100/3) / 3 = -40/9 and (80 - 200/3) / 3 = +40/9;
    # se = sqrt(2 / 1 * 2 (40/9)^2) = 80/9 (the per-sample mean with problems as the units, not 3 independent samples).
    mean, se = ratio_mean_se([20.0, 80.0], [1, 2])
    assert mean == pytest.approx(100 / 3) and se == pytest.approx(80 / 9)
    # Equal counts: the mean of the per-problem means and mean_se's standard error (means 15 and 40 -> se 12.5).
    assert ratio_mean_se([30.0, 80.0], [2, 2]) == (pytest.approx(27.5), pytest.approx(12.5))
    assert ratio_mean_se([30.0, 80.0], [2, 2])[1] == pytest.approx(mean_se([15.0, 40.0])[1])
    # A problem without such a sample counts 0 and still is a unit: totals [10, 0], counts [1, 0] -> 10 +- 0.
    assert ratio_mean_se([10.0, 0.0], [1, 0]) == (10.0, 0.0)
    assert ratio_mean_se([7.0], [2]) == (3.5, 0.0)
    with pytest.raises(ValueError, match="no sample counted"):
        ratio_mean_se([0.0, 0.0], [0, 0])


def test_paired_ratio_difference_hand_computed():
    # All responses, 2 samples per problem: A totals 30, 80 (means 15, 40), B totals 26, 80 (means 13, 40):
    # R_a - R_b = 27.5 - 26.5 = 1; per-problem differences 2, 0 -> se sqrt(2 / 2) = 1 (paired_difference's).
    diff, se = paired_ratio_difference([30.0, 80.0], [2, 2], [26.0, 80.0], [2, 2])
    assert (diff, se) == (pytest.approx(1.0), pytest.approx(1.0))
    assert paired_difference([15.0, 40.0], [13.0, 40.0]) == (pytest.approx(1.0), pytest.approx(1.0))
    # Correct responses: A totals 10, 0 of counts 1, 0 (R 10), B 26, 40 of 2, 1 (R 22): z_a = 0, 0;
    # z_b = (26 - 44) / 3, (40 - 22) / 3 = -6, 6 -> z = 6, -6; se = sqrt(2 * 72) = 12.
    diff, se = paired_ratio_difference([10.0, 0.0], [1, 0], [26.0, 40.0], [2, 1])
    assert (diff, se) == (pytest.approx(-12.0), pytest.approx(12.0))
    with pytest.raises(ValueError, match="same problems"):
        paired_ratio_difference([1.0], [1], [1.0, 2.0], [1, 1])


def test_mean_sd_and_combined_se_hand_computed():
    # three seeds 0.30, 0.34, 0.35: mean 0.33; deviations -0.03, 0.01, 0.02 -> variance (9 + 1 + 4)e-4 / 2 = 7e-4
    mean, sd = mean_sd([0.30, 0.34, 0.35])
    assert mean == pytest.approx(0.33)
    assert sd == pytest.approx(math.sqrt(7e-4))
    assert mean_sd([0.4]) == (0.4, 0.0)
    # unweighted mean of two independent estimates with se 0.03 and 0.04: sqrt(0.0009 + 0.0016) / 2 = 0.025
    assert combined_se([0.03, 0.04]) == pytest.approx(0.025)


def test_pass_at_k_edge_cases():
    assert pass_at_k(16, 3, 1) == pytest.approx(3 / 16)
    assert pass_at_k(4, 1, 4) == 1.0 and pass_at_k(4, 0, 4) == 0.0
    # n=4, c=2, k=2: 1 - C(2, 2) / C(4, 2) = 1 - 1/6
    assert pass_at_k(4, 2, 2) == pytest.approx(5 / 6)


# ----------------------------------------------------------------------------------------------------------------------
# Bootstrap: hand-computed distributions


def test_percentile_interval_hand_computed():
    # 101 replicates 0..100: the 2.5% and 97.5% quantiles (linear interpolation) are 2.5 and 97.5.
    low, high = percentile_interval(np.arange(101.0))
    assert (low, high) == (pytest.approx(2.5), pytest.approx(97.5))
    two = percentile_interval(np.stack([np.arange(101.0), 10 * np.arange(101.0)]), confidence=0.5)
    np.testing.assert_allclose(two, [[25.0, 75.0], [250.0, 750.0]])
    with pytest.raises(ValueError, match="confidence"):
        percentile_interval(np.arange(3.0), confidence=1.0)


def test_bootstrap_resamples_the_samples_of_a_problem():
    # One problem, 2 samples, 1 correct. Resampling the problems changes nothing; redrawing its 2 samples
    # makes c* ~ Binomial(2, 1/2): c* = 0, 1, 2 with probabilities 1/4, 1/2, 1/4, so the replicate pass@1 is
    # 0, 1/2, 1 with those probabilities. pass@2 (k = n) uses the problem's own samples: always 1.
    reps = bootstrap_pass_at_k([2], [1], [1, 2], replicates=20_000, seed=0)
    values, counts = np.unique(reps[0], return_counts=True)
    assert values.tolist() == [0.0, 0.5, 1.0]
    np.testing.assert_allclose(counts / 20_000, [0.25, 0.5, 0.25], atol=0.015)  # 4 sd of a share of 20k draws
    assert np.all(reps[1] == 1.0)
    fixed = bootstrap_pass_at_k([2], [1], [1], replicates=100, seed=0, resample_samples=False)
    assert np.all(fixed == 0.5)


def test_bootstrap_resamples_problems():
    # Two problems of one sample each, one right (c=1) and one wrong (c=0): no sample-level noise. Drawing two
    # problems with replacement gives pass@1 0 (both the wrong one), 1/2, or 1 with probabilities 1/4, 1/2, 1/4.
    reps = bootstrap_pass_at_k([1, 1], [1, 0], [1], replicates=20_000, seed=1)
    values, counts = np.unique(reps[0], return_counts=True)
    assert values.tolist() == [0.0, 0.5, 1.0]
    np.testing.assert_allclose(counts / 20_000, [0.25, 0.5, 0.25], atol=0.015)


def test_bootstrap_is_reproducible_and_checks_its_input():
    n, c = [8] * 5, [0, 2, 4, 8, 3]
    a = bootstrap_pass_at_k(n, c, [1, 4], replicates=300, seed=3)
    assert a.shape == (2, 300)
    np.testing.assert_array_equal(a, bootstrap_pass_at_k(n, c, [1, 4], replicates=300, seed=3))
    assert not np.array_equal(a, bootstrap_pass_at_k(n, c, [1, 4], replicates=300, seed=4))
    with pytest.raises(ValueError, match="k must lie in"):
        bootstrap_pass_at_k(n, c, [16])
    with pytest.raises(ValueError, match="0 <= correct <= samples"):
        bootstrap_pass_at_k([2], [3], [1])


def test_paired_bootstrap_hand_computed():
    # A solves every sample of every problem, B none: every replicate difference is exactly 1 (pass@1, pass@4).
    reps = paired_bootstrap_pass_at_k([4] * 3, [4] * 3, [4] * 3, [0] * 3, [1, 4], replicates=200, seed=0)
    assert np.all(reps == 1.0)
    # The pairing: A and B equal on each problem but problems differ (c = 0 or 4 of 4). Problem draws are
    # shared and no sample noise exists (c/n is 0 or 1), so every difference is exactly 0; unpaired draws of
    # the same data would spread between -1 and 1.
    c = [0, 4, 4, 0, 4]
    reps = paired_bootstrap_pass_at_k([4] * 5, c, [4] * 5, c, [1, 2], replicates=500, seed=0)
    assert np.all(reps == 0.0)
    with pytest.raises(ValueError, match="same problems"):
        paired_bootstrap_pass_at_k([4, 4], [1, 1], [4], [1], [1])


# ----------------------------------------------------------------------------------------------------------------------
# Coverage in simulation: the intervals cover a known value at the stated rate

# Problems are drawn from a population whose per-sample success probability p is 0, 0.2, 0.5 or 0.9 with
# equal weight, so the population's pass@k is the mean of 1 - (1 - p)^k:
#   pass@1 = (0 + 0.2 + 0.5 + 0.9) / 4 = 0.4
#   pass@4 = (0 + (1 - 0.8^4) + (1 - 0.5^4) + (1 - 0.1^4)) / 4 = (0 + 0.5904 + 0.9375 + 0.9999) / 4 = 0.63195
POPULATION = np.array([0.0, 0.2, 0.5, 0.9])
TRUE = {1: 0.4, 4: 0.63195}
BENCHMARKS = 300  # simulated benchmarks; a 95% coverage share has sd sqrt(0.95 * 0.05 / 300) = 0.0126
PROBLEMS, SAMPLES, REPLICATES = 40, 8, 400


def test_bootstrap_interval_covers_the_true_pass_at_k_at_the_stated_rate():
    rng = np.random.default_rng(20260101)
    covered = {1: 0, 4: 0}
    covered_se = {1: 0, 4: 0}
    for _ in range(BENCHMARKS):
        c = rng.binomial(SAMPLES, rng.choice(POPULATION, PROBLEMS))
        reps = bootstrap_pass_at_k([SAMPLES] * PROBLEMS, c, [1, 4], replicates=REPLICATES, seed=rng)
        for k, (low, high) in zip((1, 4), percentile_interval(reps), strict=True):
            covered[k] += low <= TRUE[k] <= high
            mean, se = mean_se([pass_at_k(SAMPLES, x, k) for x in c])
            covered_se[k] += abs(mean - TRUE[k]) <= 1.96 * se
    for k in (1, 4):
        # 95% nominal; the band is about +-3 sd of the coverage estimate.
        assert 0.91 <= covered[k] / BENCHMARKS <= 0.99, (k, covered[k] / BENCHMARKS)
        assert 0.91 <= covered_se[k] / BENCHMARKS <= 0.99, (k, covered_se[k] / BENCHMARKS)


def test_paired_bootstrap_interval_covers_the_true_difference():
    # B succeeds 0.1 more often than A on every problem (p + 0.1; 0.9 -> 1.0): the true difference A - B of
    # pass@1 is exactly -0.1. Redrawing samples makes the paired pass@1 interval conservative (the problem draw
    # already carries the sample noise, which dominates a paired difference); problems only is close to 95%.
    rng = np.random.default_rng(7)
    covered = {True: 0, False: 0}
    for _ in range(BENCHMARKS):
        p = rng.choice(POPULATION, PROBLEMS)
        ca, cb = rng.binomial(SAMPLES, p), rng.binomial(SAMPLES, np.minimum(p + 0.1, 1.0))
        for samples in (True, False):
            reps = paired_bootstrap_pass_at_k(
                [SAMPLES] * PROBLEMS, ca, [SAMPLES] * PROBLEMS, cb, [1], replicates=REPLICATES, seed=rng,
                resample_samples=samples,
            )  # fmt: skip
            low, high = percentile_interval(reps)[0]
            covered[samples] += low <= -0.1 <= high
    assert 0.95 <= covered[True] / BENCHMARKS <= 1.0, covered
    assert 0.90 <= covered[False] / BENCHMARKS <= 0.98, covered


def _brute_force(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (the first c correct) holding at least one correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration():
    for n in range(1, 8):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute_force(n, c, k), abs=1e-12), (n, c, k)
    assert pass_at_k(16, 3, 1) == pytest.approx(3 / 16)  # pass@1 = c / n
    # Large n stays finite and exact where binomials would overflow floats: c = 1 of 10,000, k = 1.
    assert pass_at_k(10_000, 1, 1) == pytest.approx(1e-4)
    assert math.isfinite(pass_at_k(5000, 2500, 2000))
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)
