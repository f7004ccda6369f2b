"""Statistics over seeds that the experiments report: the mean and sample standard deviation, the
standard error of a mean, paired differences, and the gap between two groups in units of its
standard error (Welch's: each group's own variance)."""

from __future__ import annotations

import math
import statistics

__all__ = ["sample_std", "spread", "paired_differences", "gap_in_standard_errors"]


def sample_std(values) -> float:
    """The sample standard deviation (``n - 1``), 0 for a single value."""
    values = list(values)
    return statistics.stdev(values) if len(values) > 1 else 0.0


def spread(values) -> dict:
    """``mean``, sample ``std``, ``n`` and the ``standard_error`` of the mean (``std / sqrt(n)``)."""
    values = list(values)
    std = sample_std(values)
    return {"mean": statistics.mean(values), "std": std, "n": len(values), "standard_error": std / math.sqrt(len(values))}


def paired_differences(a: dict, b: dict) -> dict:
    """``a[seed] - b[seed]`` for every seed of ``a`` (``b`` must have them all)."""
    return {seed: a[seed] - b[seed] for seed in a}


def gap_in_standard_errors(a, b) -> tuple[float, float]:
    """``(mean(a) - mean(b), that gap / its standard error)``, the error from each group's own sample
    variance: ``sqrt(var(a) / n_a + var(b) / n_b)``."""
    a, b = list(a), list(b)
    gap = statistics.mean(a) - statistics.mean(b)
    se = math.sqrt(statistics.variance(a) / len(a) + statistics.variance(b) / len(b))
    return gap, gap / se
