"""Uncertainty of pass@k figures: standard errors over problems and paired differences.

A pass@k over a benchmark is a mean over problems of per-problem values (for pass@1: the share of a
problem's samples that are correct). Its standard error treats problems as the sampled units:
``se = sd(values) / sqrt(n)`` with the sample standard deviation (ddof 1). Two runs on the same problems
are compared per problem (a paired difference), which removes the between-problem variance that both
share.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


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
