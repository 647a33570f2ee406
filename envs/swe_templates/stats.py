"""Template `stats`: descriptive statistics and correlation helpers (package `statkit`)."""

from __future__ import annotations

from envs.swe_templates import Mutation, Template, source

INIT = source('''
"""statkit: descriptive statistics for plain lists of numbers."""

from statkit.correlation import covariance, moving_average, pearson, zscores
from statkit.descriptive import mean, median, mode, percentile, stdev, value_range, variance

__all__ = [
    "covariance",
    "mean",
    "median",
    "mode",
    "moving_average",
    "pearson",
    "percentile",
    "stdev",
    "value_range",
    "variance",
    "zscores",
]
''')

DESCRIPTIVE = source('''
"""Descriptive statistics of one sample: centre, spread and percentiles.

Every function takes a sequence of numbers and raises ValueError when it has too few values.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence


def _require(data: Sequence[float], minimum: int = 1) -> None:
    if len(data) < minimum:
        raise ValueError(f"need at least {minimum} value(s), got {len(data)}")


def mean(data: Sequence[float]) -> float:
    """Arithmetic mean."""
    _require(data)
    return sum(data) / len(data)


def median(data: Sequence[float]) -> float:
    """Middle value of the sorted data; for an even count, the mean of the two middle values."""
    _require(data)
    ordered = sorted(data)
    mid = len(ordered) // 2
    if len(ordered) % 2 == 1:
        return ordered[mid]
    return (ordered[mid - 1] + ordered[mid]) / 2


def mode(data: Sequence[float]) -> float:
    """Most common value; when several values are equally common, the smallest of them."""
    _require(data)
    counts = Counter(data)
    best = max(counts.values())
    return min(value for value, count in counts.items() if count == best)


def variance(data: Sequence[float], sample: bool = True) -> float:
    """Variance. sample=True (an estimate from a sample) divides by n - 1, sample=False by n."""
    _require(data, 2 if sample else 1)
    centre = mean(data)
    squares = sum((x - centre) ** 2 for x in data)
    return squares / (len(data) - 1) if sample else squares / len(data)


def stdev(data: Sequence[float], sample: bool = True) -> float:
    """Standard deviation: the square root of variance()."""
    return math.sqrt(variance(data, sample))


def value_range(data: Sequence[float]) -> float:
    """Largest value minus smallest value (never negative)."""
    _require(data)
    return max(data) - min(data)


def percentile(data: Sequence[float], p: float) -> float:
    """The p-th percentile, 0 <= p <= 100, interpolating linearly between the closest ranks.

    percentile(data, 0) is the minimum, percentile(data, 100) the maximum and
    percentile(data, 50) the median.
    """
    _require(data)
    if not 0 <= p <= 100:
        raise ValueError(f"p must be within [0, 100], got {p}")
    ordered = sorted(data)
    position = (len(ordered) - 1) * p / 100
    lower = math.floor(position)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (position - lower)
''')

CORRELATION = source('''
"""Relations between two samples, and smoothing of a series."""

from __future__ import annotations

from collections.abc import Sequence

from statkit.descriptive import mean, stdev


def _require_pairs(xs: Sequence[float], ys: Sequence[float]) -> None:
    if len(xs) != len(ys):
        raise ValueError(f"xs and ys differ in length: {len(xs)} != {len(ys)}")
    if len(xs) < 2:
        raise ValueError("need at least two pairs")


def covariance(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Sample covariance: the mean product of the deviations of x and y, dividing by n - 1."""
    _require_pairs(xs, ys)
    mx, my = mean(xs), mean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / (len(xs) - 1)


def pearson(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Pearson's correlation coefficient, in [-1, 1]; ValueError when a sample is constant."""
    _require_pairs(xs, ys)
    sx, sy = stdev(xs), stdev(ys)
    if sx == 0 or sy == 0:
        raise ValueError("correlation is undefined for a constant sample")
    return covariance(xs, ys) / (sx * sy)


def zscores(data: Sequence[float]) -> list[float]:
    """How many sample standard deviations each value lies from the mean (all 0 for a constant sample)."""
    centre, spread = mean(data), stdev(data)
    if spread == 0:
        return [0.0 for _ in data]
    return [(x - centre) / spread for x in data]


def moving_average(data: Sequence[float], window: int) -> list[float]:
    """The mean of every run of `window` consecutive values: len(data) - window + 1 of them."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    if window > len(data):
        return []
    return [sum(data[i : i + window]) / window for i in range(len(data) - window + 1)]
''')

TEST_DESCRIPTIVE = source("""
import unittest

from statkit.descriptive import mean, median, mode, percentile, stdev, value_range, variance


class TestMean(unittest.TestCase):
    def test_integers(self):
        self.assertEqual(mean([1, 2, 3, 4]), 2.5)

    def test_single_value(self):
        self.assertEqual(mean([7]), 7)

    def test_empty_raises(self):
        with self.assertRaises(ValueError):
            mean([])


class TestMedian(unittest.TestCase):
    def test_odd_count(self):
        self.assertEqual(median([5, 1, 3]), 3)

    def test_even_count(self):
        self.assertEqual(median([4, 1, 3, 2]), 2.5)

    def test_two_values(self):
        self.assertEqual(median([10, 20]), 15)

    def test_empty_raises(self):
        with self.assertRaises(ValueError):
            median([])


class TestMode(unittest.TestCase):
    def test_single_most_common(self):
        self.assertEqual(mode([1, 2, 2, 3]), 2)

    def test_tie_returns_smallest(self):
        self.assertEqual(mode([3, 3, 1, 1, 2]), 1)

    def test_all_distinct(self):
        self.assertEqual(mode([9, 4, 6]), 4)


class TestVariance(unittest.TestCase):
    def test_sample_variance(self):
        self.assertAlmostEqual(variance([2, 4, 4, 4, 5, 5, 7, 9]), 32 / 7)

    def test_population_variance(self):
        self.assertAlmostEqual(variance([2, 4, 4, 4, 5, 5, 7, 9], sample=False), 4.0)

    def test_sample_needs_two_values(self):
        with self.assertRaises(ValueError):
            variance([3])

    def test_stdev_population(self):
        self.assertAlmostEqual(stdev([2, 4, 4, 4, 5, 5, 7, 9], sample=False), 2.0)

    def test_stdev_sample(self):
        self.assertAlmostEqual(stdev([1, 3]), 2 ** 0.5)


class TestRange(unittest.TestCase):
    def test_range(self):
        self.assertEqual(value_range([3, 9, 1, 4]), 8)

    def test_single_value(self):
        self.assertEqual(value_range([5]), 0)


class TestPercentile(unittest.TestCase):
    def test_extremes(self):
        data = [15, 20, 35, 40, 50]
        self.assertEqual(percentile(data, 0), 15)
        self.assertEqual(percentile(data, 100), 50)

    def test_median(self):
        self.assertEqual(percentile([15, 20, 35, 40, 50], 50), 35)

    def test_interpolates(self):
        self.assertAlmostEqual(percentile([1, 2, 3, 4], 25), 1.75)

    def test_out_of_range_raises(self):
        with self.assertRaises(ValueError):
            percentile([1, 2], 101)


if __name__ == "__main__":
    unittest.main()
""")

TEST_CORRELATION = source("""
import unittest

from statkit.correlation import covariance, moving_average, pearson, zscores


class TestCovariance(unittest.TestCase):
    def test_positive(self):
        self.assertAlmostEqual(covariance([1, 2, 3], [2, 4, 6]), 2.0)

    def test_negative(self):
        self.assertAlmostEqual(covariance([1, 2, 3], [3, 2, 1]), -1.0)

    def test_length_mismatch_raises(self):
        with self.assertRaises(ValueError):
            covariance([1, 2], [1, 2, 3])


class TestPearson(unittest.TestCase):
    def test_perfect_positive(self):
        self.assertAlmostEqual(pearson([1, 2, 3, 4], [10, 20, 30, 40]), 1.0)

    def test_perfect_negative(self):
        self.assertAlmostEqual(pearson([1, 2, 3], [5, 3, 1]), -1.0)

    def test_constant_raises(self):
        with self.assertRaises(ValueError):
            pearson([1, 1, 1], [1, 2, 3])


class TestZscores(unittest.TestCase):
    def test_symmetric(self):
        self.assertEqual([round(z, 6) for z in zscores([1, 2, 3])], [-1.0, 0.0, 1.0])

    def test_constant(self):
        self.assertEqual(zscores([4, 4, 4]), [0.0, 0.0, 0.0])


class TestMovingAverage(unittest.TestCase):
    def test_window_two(self):
        self.assertEqual(moving_average([1, 2, 3, 4], 2), [1.5, 2.5, 3.5])

    def test_window_equals_length(self):
        self.assertEqual(moving_average([2, 4, 6], 3), [4.0])

    def test_window_too_large(self):
        self.assertEqual(moving_average([1, 2], 3), [])

    def test_bad_window_raises(self):
        with self.assertRaises(ValueError):
            moving_average([1, 2], 0)


if __name__ == "__main__":
    unittest.main()
""")

MUTATIONS = (
    Mutation(
        "median-even",
        "statkit/descriptive.py",
        "    return (ordered[mid - 1] + ordered[mid]) / 2\n",
        "    return ordered[mid]\n",
        "median() of an even number of values must return the mean of the two middle values.",
        (
            "tests.test_descriptive.TestMedian.test_even_count",
            "tests.test_descriptive.TestMedian.test_two_values",
        ),
    ),
    Mutation(
        "mode-tie",
        "statkit/descriptive.py",
        "return min(value for value, count in counts.items() if count == best)",
        "return max(value for value, count in counts.items() if count == best)",
        "mode() must return the smallest of the most common values when several are equally common.",
        (
            "tests.test_descriptive.TestMode.test_all_distinct",
            "tests.test_descriptive.TestMode.test_tie_returns_smallest",
        ),
    ),
    Mutation(
        "variance-bessel",
        "statkit/descriptive.py",
        "return squares / (len(data) - 1) if sample else squares / len(data)",
        "return squares / len(data) if sample else squares / len(data)",
        "variance() and stdev() with sample=True (the default) must divide by n - 1, not n.",
        (
            "tests.test_correlation.TestPearson.test_perfect_negative",
            "tests.test_correlation.TestPearson.test_perfect_positive",
            "tests.test_correlation.TestZscores.test_symmetric",
            "tests.test_descriptive.TestVariance.test_sample_variance",
            "tests.test_descriptive.TestVariance.test_stdev_sample",
        ),
    ),
    Mutation(
        "percentile-rank",
        "statkit/descriptive.py",
        "position = (len(ordered) - 1) * p / 100",
        "position = len(ordered) * p / 100",
        "percentile() must interpolate between the closest ranks: p=0 gives the minimum, p=100 the maximum.",
        (
            "tests.test_descriptive.TestPercentile.test_extremes",
            "tests.test_descriptive.TestPercentile.test_interpolates",
            "tests.test_descriptive.TestPercentile.test_median",
        ),
    ),
    Mutation(
        "range-sign",
        "statkit/descriptive.py",
        "return max(data) - min(data)",
        "return min(data) - max(data)",
        "value_range() must return the largest value minus the smallest, which is never negative.",
        ("tests.test_descriptive.TestRange.test_range",),
    ),
    Mutation(
        "covariance-sample",
        "statkit/correlation.py",
        "for x, y in zip(xs, ys)) / (len(xs) - 1)",
        "for x, y in zip(xs, ys)) / len(xs)",
        "covariance() must be the sample covariance, dividing by n - 1; pearson() is wrong too.",
        (
            "tests.test_correlation.TestCovariance.test_negative",
            "tests.test_correlation.TestCovariance.test_positive",
            "tests.test_correlation.TestPearson.test_perfect_negative",
            "tests.test_correlation.TestPearson.test_perfect_positive",
        ),
    ),
    Mutation(
        "moving-average-last",
        "statkit/correlation.py",
        "for i in range(len(data) - window + 1)]",
        "for i in range(len(data) - window)]",
        "moving_average() must return len(data) - window + 1 averages; the last window is missing.",
        (
            "tests.test_correlation.TestMovingAverage.test_window_equals_length",
            "tests.test_correlation.TestMovingAverage.test_window_two",
        ),
    ),
)

TEMPLATE = Template(
    "stats",
    "statkit",
    {
        "statkit/__init__.py": INIT,
        "statkit/descriptive.py": DESCRIPTIVE,
        "statkit/correlation.py": CORRELATION,
        "tests/test_descriptive.py": TEST_DESCRIPTIVE,
        "tests/test_correlation.py": TEST_CORRELATION,
    },
    MUTATIONS,
)
