"""Template `intervals`: half-open intervals, merging, gaps and free slots (package `spans`)."""

from __future__ import annotations

from envs.swe_templates import Mutation, Template, source

INIT = source('''
"""spans: half-open intervals of numbers and operations on sets of them (calendars, ranges)."""

from spans.interval import Interval
from spans.merge import first_free_slot, gaps, merge, total_length

__all__ = ["Interval", "first_free_slot", "gaps", "merge", "total_length"]
''')

INTERVAL = source('''
"""Half-open intervals [start, end) of numbers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Interval:
    """The numbers x with start <= x < end. start == end is the empty interval."""

    start: float
    end: float

    def __post_init__(self) -> None:
        if self.end < self.start:
            raise ValueError(f"interval end {self.end} is before its start {self.start}")

    @property
    def length(self) -> float:
        return self.end - self.start

    def is_empty(self) -> bool:
        return self.start == self.end

    def contains(self, x: float) -> bool:
        """True when start <= x < end: the end itself lies outside."""
        return self.start <= x < self.end

    def overlaps(self, other: Interval) -> bool:
        """True when the two share a number. [1, 3) and [3, 5) only touch: they do not overlap."""
        return self.start < other.end and other.start < self.end

    def touches(self, other: Interval) -> bool:
        """True when one ends exactly where the other starts."""
        return self.end == other.start or other.end == self.start

    def intersection(self, other: Interval) -> Interval | None:
        """The common part, or None when they do not overlap."""
        if not self.overlaps(other):
            return None
        return Interval(max(self.start, other.start), min(self.end, other.end))

    def shift(self, offset: float) -> Interval:
        """The same interval moved by `offset`."""
        return Interval(self.start + offset, self.end + offset)
''')

MERGE = source('''
"""Operations on collections of intervals: merging, measuring, finding gaps and free slots."""

from __future__ import annotations

from collections.abc import Iterable

from spans.interval import Interval


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same numbers: overlapping or touching intervals
    are joined into one; empty intervals are dropped."""
    ordered = sorted(i for i in intervals if not i.is_empty())
    merged: list[Interval] = []
    for current in ordered:
        if merged and current.start <= merged[-1].end:
            last = merged.pop()
            merged.append(Interval(last.start, max(last.end, current.end)))
        else:
            merged.append(current)
    return merged


def total_length(intervals: Iterable[Interval]) -> float:
    """The length of the union: overlapping parts count once."""
    return sum(i.length for i in merge(intervals))


def gaps(intervals: Iterable[Interval], lo: float, hi: float) -> list[Interval]:
    """The parts of [lo, hi) that no interval covers, in order."""
    if hi < lo:
        raise ValueError(f"hi {hi} is below lo {lo}")
    free: list[Interval] = []
    cursor = lo
    for busy in merge(intervals):
        if busy.end <= lo or busy.start >= hi:
            continue
        if busy.start > cursor:
            free.append(Interval(cursor, busy.start))
        cursor = max(cursor, busy.end)
    if cursor < hi:
        free.append(Interval(cursor, hi))
    return free


def first_free_slot(busy: Iterable[Interval], duration: float, lo: float, hi: float) -> Interval | None:
    """The earliest [t, t + duration) within [lo, hi) that overlaps no busy interval, or None."""
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    for gap in gaps(busy, lo, hi):
        if gap.length >= duration:
            return Interval(gap.start, gap.start + duration)
    return None
''')

TEST_INTERVAL = source("""
import unittest

from spans.interval import Interval


class TestInterval(unittest.TestCase):
    def test_length(self):
        self.assertEqual(Interval(2, 7).length, 5)

    def test_reversed_raises(self):
        with self.assertRaises(ValueError):
            Interval(5, 1)

    def test_empty(self):
        self.assertTrue(Interval(3, 3).is_empty())
        self.assertFalse(Interval(3, 4).is_empty())

    def test_shift(self):
        self.assertEqual(Interval(1, 2).shift(10), Interval(11, 12))


class TestContains(unittest.TestCase):
    def test_inside_and_start(self):
        self.assertTrue(Interval(1, 5).contains(1))
        self.assertTrue(Interval(1, 5).contains(4.5))

    def test_end_is_outside(self):
        self.assertFalse(Interval(1, 5).contains(5))

    def test_before_start(self):
        self.assertFalse(Interval(1, 5).contains(0))


class TestOverlaps(unittest.TestCase):
    def test_overlapping(self):
        self.assertTrue(Interval(1, 4).overlaps(Interval(3, 6)))

    def test_touching_do_not_overlap(self):
        self.assertFalse(Interval(1, 3).overlaps(Interval(3, 5)))
        self.assertTrue(Interval(1, 3).touches(Interval(3, 5)))

    def test_disjoint(self):
        self.assertFalse(Interval(1, 2).overlaps(Interval(5, 6)))


class TestIntersection(unittest.TestCase):
    def test_partial(self):
        self.assertEqual(Interval(1, 5).intersection(Interval(3, 8)), Interval(3, 5))

    def test_nested(self):
        self.assertEqual(Interval(0, 10).intersection(Interval(2, 4)), Interval(2, 4))

    def test_disjoint_is_none(self):
        self.assertIsNone(Interval(0, 1).intersection(Interval(2, 3)))


if __name__ == "__main__":
    unittest.main()
""")

TEST_MERGE = source("""
import unittest

from spans.interval import Interval
from spans.merge import first_free_slot, gaps, merge, total_length


class TestMerge(unittest.TestCase):
    def test_overlapping_joined(self):
        self.assertEqual(merge([Interval(1, 4), Interval(3, 6)]), [Interval(1, 6)])

    def test_touching_joined(self):
        self.assertEqual(merge([Interval(1, 3), Interval(3, 5)]), [Interval(1, 5)])

    def test_unsorted_input(self):
        self.assertEqual(
            merge([Interval(8, 9), Interval(1, 2), Interval(1.5, 3)]),
            [Interval(1, 3), Interval(8, 9)],
        )

    def test_nested_interval_kept_whole(self):
        self.assertEqual(merge([Interval(0, 10), Interval(2, 3)]), [Interval(0, 10)])

    def test_empty_dropped(self):
        self.assertEqual(merge([Interval(2, 2), Interval(4, 5)]), [Interval(4, 5)])


class TestTotalLength(unittest.TestCase):
    def test_overlap_counted_once(self):
        self.assertEqual(total_length([Interval(0, 4), Interval(2, 6)]), 6)

    def test_disjoint(self):
        self.assertEqual(total_length([Interval(0, 1), Interval(5, 7)]), 3)


class TestGaps(unittest.TestCase):
    def test_gaps_between(self):
        busy = [Interval(9, 10), Interval(12, 13)]
        self.assertEqual(gaps(busy, 8, 17), [Interval(8, 9), Interval(10, 12), Interval(13, 17)])

    def test_fully_busy(self):
        self.assertEqual(gaps([Interval(0, 24)], 8, 17), [])

    def test_nothing_busy(self):
        self.assertEqual(gaps([], 8, 17), [Interval(8, 17)])


class TestFirstFreeSlot(unittest.TestCase):
    def test_first_fitting_gap(self):
        busy = [Interval(9, 10), Interval(10.5, 12)]
        self.assertEqual(first_free_slot(busy, 1, 9, 17), Interval(12, 13))

    def test_exact_fit(self):
        busy = [Interval(9, 10), Interval(11, 12)]
        self.assertEqual(first_free_slot(busy, 1, 9, 12), Interval(10, 11))

    def test_no_room(self):
        self.assertIsNone(first_free_slot([Interval(9, 17)], 1, 9, 17))


if __name__ == "__main__":
    unittest.main()
""")

MUTATIONS = (
    Mutation(
        "contains-end",
        "spans/interval.py",
        "return self.start <= x < self.end",
        "return self.start <= x <= self.end",
        "Interval.contains() must treat the end as outside the interval ([start, end) is half-open).",
        ("tests.test_interval.TestContains.test_end_is_outside",),
    ),
    Mutation(
        "overlaps-touching",
        "spans/interval.py",
        "return self.start < other.end and other.start < self.end",
        "return self.start <= other.end and other.start <= self.end",
        "Interval.overlaps() must be False for intervals that only touch, like [1, 3) and [3, 5).",
        ("tests.test_interval.TestOverlaps.test_touching_do_not_overlap",),
    ),
    Mutation(
        "intersection-start",
        "spans/interval.py",
        "return Interval(max(self.start, other.start), min(self.end, other.end))",
        "return Interval(min(self.start, other.start), min(self.end, other.end))",
        "Interval.intersection() must return only the part both intervals share.",
        (
            "tests.test_interval.TestIntersection.test_nested",
            "tests.test_interval.TestIntersection.test_partial",
        ),
    ),
    Mutation(
        "merge-touching",
        "spans/merge.py",
        "if merged and current.start <= merged[-1].end:",
        "if merged and current.start < merged[-1].end:",
        "merge() must join touching intervals such as [1, 3) and [3, 5) into [1, 5).",
        ("tests.test_merge.TestMerge.test_touching_joined",),
    ),
    Mutation(
        "merge-unsorted",
        "spans/merge.py",
        "ordered = sorted(i for i in intervals if not i.is_empty())",
        "ordered = [i for i in intervals if not i.is_empty()]",
        "merge() must give sorted, disjoint intervals even when its input is not sorted.",
        ("tests.test_merge.TestMerge.test_unsorted_input",),
    ),
    Mutation(
        "merge-nested",
        "spans/merge.py",
        "merged.append(Interval(last.start, max(last.end, current.end)))",
        "merged.append(Interval(last.start, current.end))",
        "merge() must keep an interval whole when another one lies inside it.",
        ("tests.test_merge.TestMerge.test_nested_interval_kept_whole",),
    ),
    Mutation(
        "slot-exact-fit",
        "spans/merge.py",
        "if gap.length >= duration:",
        "if gap.length > duration:",
        "first_free_slot() must accept a gap exactly as long as the duration.",
        ("tests.test_merge.TestFirstFreeSlot.test_exact_fit",),
    ),
)

TEMPLATE = Template(
    "intervals",
    "spans",
    {
        "spans/__init__.py": INIT,
        "spans/interval.py": INTERVAL,
        "spans/merge.py": MERGE,
        "tests/test_interval.py": TEST_INTERVAL,
        "tests/test_merge.py": TEST_MERGE,
    },
    MUTATIONS,
)
