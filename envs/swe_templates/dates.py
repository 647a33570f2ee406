"""Template `dates`: Gregorian calendar arithmetic without datetime (package `calkit`)."""

from __future__ import annotations

from envs.swe_templates import Mutation, Template, source

INIT = source('''
"""calkit: Gregorian calendar arithmetic on (year, month, day) tuples."""

from calkit.months import day_of_year, days_in_month, days_in_year, is_leap_year
from calkit.weekdays import add_days, business_days_between, from_ordinal, ordinal, weekday, weekday_name

__all__ = [
    "add_days",
    "business_days_between",
    "day_of_year",
    "days_in_month",
    "days_in_year",
    "from_ordinal",
    "is_leap_year",
    "ordinal",
    "weekday",
    "weekday_name",
]
''')

MONTHS = source('''
"""The Gregorian calendar: leap years, month lengths, the day number within a year."""

from __future__ import annotations

MONTH_DAYS = (31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31)


def is_leap_year(year: int) -> bool:
    """Divisible by 4, except centuries, except centuries divisible by 400: 2000 is a leap year, 1900 is not."""
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_year(year: int) -> int:
    return 366 if is_leap_year(year) else 365


def days_in_month(year: int, month: int) -> int:
    """28 to 31. ValueError for a month outside 1..12."""
    if not 1 <= month <= 12:
        raise ValueError(f"month must be within 1..12, got {month}")
    if month == 2 and is_leap_year(year):
        return 29
    return MONTH_DAYS[month - 1]


def check_date(year: int, month: int, day: int) -> None:
    """ValueError unless (year, month, day) is a date of the calendar."""
    if year < 1:
        raise ValueError(f"year must be >= 1, got {year}")
    if not 1 <= day <= days_in_month(year, month):
        raise ValueError(f"{year}-{month:02d}-{day:02d} is not a date")


def day_of_year(year: int, month: int, day: int) -> int:
    """1 for January 1st, up to 365 (or 366 in a leap year) for December 31st."""
    check_date(year, month, day)
    return sum(days_in_month(year, m) for m in range(1, month)) + day
''')

WEEKDAYS = source('''
"""Day numbers, weekdays and business days.

Days are numbered like datetime.date.toordinal: 0001-01-01 (a Monday) is day 1.
"""

from __future__ import annotations

from calkit.months import day_of_year, days_in_month, days_in_year

WEEKDAY_NAMES = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
DAYS_PER_400_YEARS = 146097

Date = tuple[int, int, int]


def ordinal(year: int, month: int, day: int) -> int:
    """The day's number: ordinal(1, 1, 1) == 1."""
    y = year - 1
    return y * 365 + y // 4 - y // 100 + y // 400 + day_of_year(year, month, day)


def from_ordinal(n: int) -> Date:
    """The (year, month, day) of day number n, the inverse of ordinal()."""
    if n < 1:
        raise ValueError(f"day numbers start at 1, got {n}")
    cycles, left = divmod(n - 1, DAYS_PER_400_YEARS)
    year = 400 * cycles + 1
    while left >= days_in_year(year):
        left -= days_in_year(year)
        year += 1
    month = 1
    while left >= days_in_month(year, month):
        left -= days_in_month(year, month)
        month += 1
    return year, month, left + 1


def weekday(year: int, month: int, day: int) -> int:
    """0 for Monday up to 6 for Sunday."""
    return (ordinal(year, month, day) - 1) % 7


def weekday_name(year: int, month: int, day: int) -> str:
    return WEEKDAY_NAMES[weekday(year, month, day)]


def add_days(date: Date, days: int) -> Date:
    """The date `days` days after `date` (before it for a negative number)."""
    return from_ordinal(ordinal(*date) + days)


def business_days_between(start: Date, end: Date) -> int:
    """The number of Mondays to Fridays d with start <= d < end (0 when end is not after start)."""
    first, last = ordinal(*start), ordinal(*end)
    return sum(1 for n in range(first, last) if (n - 1) % 7 < 5)
''')

TEST_MONTHS = source("""
import unittest

from calkit.months import check_date, day_of_year, days_in_month, days_in_year, is_leap_year


class TestLeapYear(unittest.TestCase):
    def test_ordinary_leap_year(self):
        self.assertTrue(is_leap_year(2024))

    def test_common_year(self):
        self.assertFalse(is_leap_year(2023))

    def test_century_is_not_leap(self):
        self.assertFalse(is_leap_year(1900))

    def test_century_divisible_by_400_is_leap(self):
        self.assertTrue(is_leap_year(2000))

    def test_days_in_year(self):
        self.assertEqual((days_in_year(2000), days_in_year(2100)), (366, 365))


class TestDaysInMonth(unittest.TestCase):
    def test_thirty_one(self):
        self.assertEqual(days_in_month(2023, 1), 31)
        self.assertEqual(days_in_month(2023, 12), 31)

    def test_thirty(self):
        self.assertEqual(days_in_month(2023, 4), 30)

    def test_february(self):
        self.assertEqual(days_in_month(2023, 2), 28)
        self.assertEqual(days_in_month(2024, 2), 29)

    def test_bad_month_raises(self):
        with self.assertRaises(ValueError):
            days_in_month(2023, 13)


class TestDayOfYear(unittest.TestCase):
    def test_first_day(self):
        self.assertEqual(day_of_year(2023, 1, 1), 1)

    def test_march_first(self):
        self.assertEqual(day_of_year(2023, 3, 1), 60)
        self.assertEqual(day_of_year(2024, 3, 1), 61)

    def test_last_day(self):
        self.assertEqual(day_of_year(2023, 12, 31), 365)

    def test_invalid_date_raises(self):
        with self.assertRaises(ValueError):
            day_of_year(2023, 2, 29)

    def test_last_day_of_month_is_valid(self):
        check_date(2023, 4, 30)
        check_date(2024, 2, 29)


if __name__ == "__main__":
    unittest.main()
""")

TEST_WEEKDAYS = source("""
import unittest

from calkit.weekdays import add_days, business_days_between, from_ordinal, ordinal, weekday, weekday_name


class TestOrdinal(unittest.TestCase):
    def test_day_one(self):
        self.assertEqual(ordinal(1, 1, 1), 1)

    def test_known_day(self):
        self.assertEqual(ordinal(2000, 1, 1), 730120)

    def test_round_trip(self):
        for n in (1, 59, 60, 365, 366, 730119, 730120, 738886):
            self.assertEqual(ordinal(*from_ordinal(n)), n)

    def test_from_ordinal_year_end(self):
        self.assertEqual(from_ordinal(730119), (1999, 12, 31))


class TestWeekday(unittest.TestCase):
    def test_monday(self):
        self.assertEqual(weekday(2024, 1, 1), 0)

    def test_sunday(self):
        self.assertEqual(weekday(2023, 12, 31), 6)

    def test_name(self):
        self.assertEqual(weekday_name(2000, 1, 1), "Saturday")


class TestAddDays(unittest.TestCase):
    def test_within_month(self):
        self.assertEqual(add_days((2024, 3, 10), 5), (2024, 3, 15))

    def test_across_year(self):
        self.assertEqual(add_days((2023, 12, 30), 3), (2024, 1, 2))

    def test_leap_day(self):
        self.assertEqual(add_days((2024, 2, 28), 1), (2024, 2, 29))

    def test_backwards(self):
        self.assertEqual(add_days((2024, 3, 1), -1), (2024, 2, 29))


class TestBusinessDays(unittest.TestCase):
    def test_one_week(self):
        self.assertEqual(business_days_between((2024, 1, 1), (2024, 1, 8)), 5)

    def test_weekend_only(self):
        self.assertEqual(business_days_between((2024, 1, 6), (2024, 1, 8)), 0)

    def test_empty_range(self):
        self.assertEqual(business_days_between((2024, 1, 8), (2024, 1, 1)), 0)


if __name__ == "__main__":
    unittest.main()
""")

MUTATIONS = (
    Mutation(
        "leap-400",
        "calkit/months.py",
        "return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)",
        "return year % 4 == 0 and year % 100 != 0",
        "is_leap_year() must treat centuries divisible by 400 (like 2000) as leap years.",
        (
            "tests.test_months.TestLeapYear.test_century_divisible_by_400_is_leap",
            "tests.test_months.TestLeapYear.test_days_in_year",
        ),
    ),
    Mutation(
        "month-index",
        "calkit/months.py",
        "return MONTH_DAYS[month - 1]",
        "return MONTH_DAYS[month % 12]",
        "days_in_month() returns the wrong number of days for most months (April has 30, January 31).",
        (
            "tests.test_months.TestDayOfYear.test_invalid_date_raises",
            "tests.test_months.TestDayOfYear.test_march_first",
            "tests.test_months.TestDaysInMonth.test_february",
            "tests.test_months.TestDaysInMonth.test_thirty",
            "tests.test_months.TestDaysInMonth.test_thirty_one",
        ),
    ),
    Mutation(
        "last-day-invalid",
        "calkit/months.py",
        "if not 1 <= day <= days_in_month(year, month):",
        "if not 1 <= day < days_in_month(year, month):",
        "check_date() must accept the last day of a month (2023-04-30 is a date).",
        (
            "tests.test_months.TestDayOfYear.test_last_day",
            "tests.test_months.TestDayOfYear.test_last_day_of_month_is_valid",
            "tests.test_weekdays.TestOrdinal.test_round_trip",
            "tests.test_weekdays.TestWeekday.test_sunday",
        ),
    ),
    Mutation(
        "day-of-year-month",
        "calkit/months.py",
        "for m in range(1, month)) + day",
        "for m in range(1, month + 1)) + day",
        "day_of_year() must count only the months before the given one: March 1st 2023 is day 60.",
        (
            "tests.test_months.TestDayOfYear.test_first_day",
            "tests.test_months.TestDayOfYear.test_last_day",
            "tests.test_months.TestDayOfYear.test_march_first",
            "tests.test_weekdays.TestAddDays.test_across_year",
            "tests.test_weekdays.TestAddDays.test_backwards",
            "tests.test_weekdays.TestAddDays.test_leap_day",
            "tests.test_weekdays.TestAddDays.test_within_month",
            "tests.test_weekdays.TestBusinessDays.test_weekend_only",
            "tests.test_weekdays.TestOrdinal.test_day_one",
            "tests.test_weekdays.TestOrdinal.test_known_day",
            "tests.test_weekdays.TestOrdinal.test_round_trip",
            "tests.test_weekdays.TestWeekday.test_monday",
            "tests.test_weekdays.TestWeekday.test_name",
            "tests.test_weekdays.TestWeekday.test_sunday",
        ),
    ),
    Mutation(
        "weekday-offset",
        "calkit/weekdays.py",
        "return (ordinal(year, month, day) - 1) % 7",
        "return ordinal(year, month, day) % 7",
        "weekday() must return 0 for Monday: 2024-01-01 was a Monday.",
        (
            "tests.test_weekdays.TestWeekday.test_monday",
            "tests.test_weekdays.TestWeekday.test_name",
            "tests.test_weekdays.TestWeekday.test_sunday",
        ),
    ),
    Mutation(
        "ordinal-400",
        "calkit/weekdays.py",
        "return y * 365 + y // 4 - y // 100 + y // 400 + day_of_year(year, month, day)",
        "return y * 365 + y // 4 - y // 100 + day_of_year(year, month, day)",
        "ordinal() must count the leap days of centuries divisible by 400: ordinal(2000, 1, 1) is 730120.",
        (
            "tests.test_weekdays.TestAddDays.test_across_year",
            "tests.test_weekdays.TestAddDays.test_backwards",
            "tests.test_weekdays.TestAddDays.test_leap_day",
            "tests.test_weekdays.TestAddDays.test_within_month",
            "tests.test_weekdays.TestBusinessDays.test_weekend_only",
            "tests.test_weekdays.TestOrdinal.test_known_day",
            "tests.test_weekdays.TestOrdinal.test_round_trip",
            "tests.test_weekdays.TestWeekday.test_monday",
            "tests.test_weekdays.TestWeekday.test_name",
            "tests.test_weekdays.TestWeekday.test_sunday",
        ),
    ),
    Mutation(
        "business-saturday",
        "calkit/weekdays.py",
        "if (n - 1) % 7 < 5)",
        "if (n - 1) % 7 <= 5)",
        "business_days_between() must not count Saturdays.",
        (
            "tests.test_weekdays.TestBusinessDays.test_one_week",
            "tests.test_weekdays.TestBusinessDays.test_weekend_only",
        ),
    ),
)

TEMPLATE = Template(
    "dates",
    "calkit",
    {
        "calkit/__init__.py": INIT,
        "calkit/months.py": MONTHS,
        "calkit/weekdays.py": WEEKDAYS,
        "tests/test_months.py": TEST_MONTHS,
        "tests/test_weekdays.py": TEST_WEEKDAYS,
    },
    MUTATIONS,
)
