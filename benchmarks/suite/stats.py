"""Summaries of repeated measurements: median and run range, mean and a 95% interval."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

# Two-sided 97.5% quantiles of Student's t by degrees of freedom (no scipy needed).
_T975 = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
}


def summarise(values: Sequence[float]) -> dict[str, float | list[float]]:
    """Median, [min, max], mean and the 95% t-interval half-width of the mean.

    With one value the half-width is NaN: one run says nothing about its spread.
    """
    if not values:
        raise ValueError("no values to summarise")
    mean = statistics.fmean(values)
    n = len(values)
    half = math.nan
    if n > 1:
        t = _T975.get(n - 1, 1.96)
        half = t * statistics.stdev(values) / math.sqrt(n)
    return {
        "median": statistics.median(values),
        "range": [min(values), max(values)],
        "mean": mean,
        "ci95_half_width": half,
    }
