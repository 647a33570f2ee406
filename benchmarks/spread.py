"""Mean and spread of a benchmark arm's repeated runs, as the benchmarks print them."""

from __future__ import annotations

import statistics


def mean_sd(values: list[float]) -> tuple[float, float]:
    """(mean, sample standard deviation; 0 for a single run)."""
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)
