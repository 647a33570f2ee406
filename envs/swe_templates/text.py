"""Template `text`: letter cases, slugs, truncation and word wrap (package `textkit`)."""

from __future__ import annotations

from envs.swe_templates import Mutation, Template, source

INIT = source('''
"""textkit: small helpers for identifiers, titles and fixed-width text."""

from textkit.case import camel_case, slugify, snake_case, split_words, title_case
from textkit.fit import count_words, is_palindrome, truncate, wrap

__all__ = [
    "camel_case",
    "count_words",
    "is_palindrome",
    "slugify",
    "snake_case",
    "split_words",
    "title_case",
    "truncate",
    "wrap",
]
''')

CASE = source(r'''
"""Converting identifiers and titles between letter cases."""

from __future__ import annotations

import re

# A capitalised or lower-case word, or a run of capitals not followed by a lower-case letter (an acronym).
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")
SMALL_WORDS = frozenset({"a", "an", "and", "as", "at", "but", "by", "for", "in", "of", "on", "or", "the", "to"})


def split_words(text: str) -> list[str]:
    """The words of an identifier or phrase, lower-cased.

    >>> split_words("parseHTTPResponse_code")
    ['parse', 'http', 'response', 'code']
    """
    return [word.lower() for word in _WORD.findall(text)]


def snake_case(text: str) -> str:
    """'Hello World' or 'helloWorld' -> 'hello_world'."""
    return "_".join(split_words(text))


def camel_case(text: str) -> str:
    """'hello world' or 'hello_world' -> 'helloWorld': the first word lower case, the others capitalised."""
    words = split_words(text)
    if not words:
        return ""
    return words[0] + "".join(word.capitalize() for word in words[1:])


def title_case(text: str) -> str:
    """Capitalise every word, except that small words ('of', 'the', ...) stay lower case unless
    they are the first or the last word."""
    words = text.split()
    out = []
    for i, word in enumerate(words):
        lower = word.lower()
        if 0 < i < len(words) - 1 and lower in SMALL_WORDS:
            out.append(lower)
        else:
            out.append(lower.capitalize())
    return " ".join(out)


def slugify(text: str, separator: str = "-") -> str:
    """A URL slug: the lower-case ASCII words and digits of `text` joined by `separator`."""
    return separator.join(re.findall(r"[a-z0-9]+", text.lower()))
''')

FIT = source(r'''
"""Fitting text into a width: truncation and word wrap; counting words; palindromes."""

from __future__ import annotations


def truncate(text: str, width: int, suffix: str = "...") -> str:
    """`text` itself when it has at most `width` characters; otherwise text cut so that the
    result, `suffix` included, is exactly `width` characters long."""
    if width < len(suffix):
        raise ValueError(f"width {width} is shorter than the suffix {suffix!r}")
    if len(text) <= width:
        return text
    return text[: width - len(suffix)] + suffix


def wrap(text: str, width: int) -> list[str]:
    """Greedy word wrap into lines of at most `width` characters; a longer word gets a line of its own."""
    if width < 1:
        raise ValueError(f"width must be positive, got {width}")
    lines: list[str] = []
    current = ""
    for word in text.split():
        if not current:
            current = word
        elif len(current) + 1 + len(word) <= width:
            current += " " + word
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines


def count_words(text: str) -> int:
    """The number of words; any run of spaces, tabs or newlines separates two words."""
    return len(text.split())


def is_palindrome(text: str) -> bool:
    """True when the letters and digits read the same backwards, ignoring case and everything else."""
    cleaned = [ch.lower() for ch in text if ch.isalnum()]
    return cleaned == cleaned[::-1]
''')

TEST_CASE = source("""
import unittest

from textkit.case import camel_case, slugify, snake_case, split_words, title_case


class TestSplitWords(unittest.TestCase):
    def test_camel_with_acronym(self):
        self.assertEqual(split_words("parseHTTPResponse_code"), ["parse", "http", "response", "code"])

    def test_phrase(self):
        self.assertEqual(split_words("Hello, big World!"), ["hello", "big", "world"])


class TestSnakeCase(unittest.TestCase):
    def test_from_camel(self):
        self.assertEqual(snake_case("helloWorld"), "hello_world")

    def test_from_words(self):
        self.assertEqual(snake_case("Hello World Again"), "hello_world_again")


class TestCamelCase(unittest.TestCase):
    def test_from_words(self):
        self.assertEqual(camel_case("hello world"), "helloWorld")

    def test_from_snake(self):
        self.assertEqual(camel_case("max_retry_count"), "maxRetryCount")

    def test_empty(self):
        self.assertEqual(camel_case(""), "")


class TestTitleCase(unittest.TestCase):
    def test_small_words_inside(self):
        self.assertEqual(title_case("the lord of the rings"), "The Lord of the Rings")

    def test_small_word_last(self):
        self.assertEqual(title_case("what it is made of"), "What It Is Made Of")

    def test_mixed_case_input(self):
        self.assertEqual(title_case("gONE wITH the wIND"), "Gone With the Wind")


class TestSlugify(unittest.TestCase):
    def test_default_separator(self):
        self.assertEqual(slugify("Hello, World! 2024"), "hello-world-2024")

    def test_custom_separator(self):
        self.assertEqual(slugify("Hello World", separator="_"), "hello_world")

    def test_only_symbols(self):
        self.assertEqual(slugify("!!!"), "")


if __name__ == "__main__":
    unittest.main()
""")

TEST_FIT = source(r"""
import unittest

from textkit.fit import count_words, is_palindrome, truncate, wrap


class TestTruncate(unittest.TestCase):
    def test_short_text_unchanged(self):
        self.assertEqual(truncate("hello", 10), "hello")

    def test_exact_width_unchanged(self):
        self.assertEqual(truncate("hello", 5), "hello")

    def test_cut_to_width(self):
        self.assertEqual(truncate("hello world", 8), "hello...")
        self.assertEqual(len(truncate("a" * 50, 20)), 20)

    def test_custom_suffix(self):
        self.assertEqual(truncate("abcdefgh", 5, suffix="~"), "abcd~")

    def test_width_below_suffix_raises(self):
        with self.assertRaises(ValueError):
            truncate("hello", 2)


class TestWrap(unittest.TestCase):
    def test_wraps_greedily(self):
        self.assertEqual(wrap("the quick brown fox", 10), ["the quick", "brown fox"])

    def test_line_of_exact_width(self):
        self.assertEqual(wrap("aaa bbb ccc", 7), ["aaa bbb", "ccc"])

    def test_long_word_alone(self):
        self.assertEqual(wrap("a extraordinary b", 5), ["a", "extraordinary", "b"])

    def test_empty(self):
        self.assertEqual(wrap("", 5), [])


class TestCountWords(unittest.TestCase):
    def test_simple(self):
        self.assertEqual(count_words("one two three"), 3)

    def test_runs_of_whitespace(self):
        self.assertEqual(count_words("  one   two\tthree\nfour  "), 4)

    def test_empty(self):
        self.assertEqual(count_words(""), 0)


class TestPalindrome(unittest.TestCase):
    def test_plain(self):
        self.assertTrue(is_palindrome("level"))

    def test_ignores_case_and_punctuation(self):
        self.assertTrue(is_palindrome("A man, a plan, a canal: Panama"))

    def test_not_palindrome(self):
        self.assertFalse(is_palindrome("python"))


if __name__ == "__main__":
    unittest.main()
""")

MUTATIONS = (
    Mutation(
        "camel-first-word",
        "textkit/case.py",
        'return words[0] + "".join(word.capitalize() for word in words[1:])',
        'return "".join(word.capitalize() for word in words)',
        "camel_case() must keep the first word lower case: 'hello world' -> 'helloWorld'.",
        (
            "tests.test_case.TestCamelCase.test_from_snake",
            "tests.test_case.TestCamelCase.test_from_words",
        ),
    ),
    Mutation(
        "title-first-small-word",
        "textkit/case.py",
        "if 0 < i < len(words) - 1 and lower in SMALL_WORDS:",
        "if i < len(words) - 1 and lower in SMALL_WORDS:",
        "title_case() must capitalise a small word ('the', 'of', ...) when it is the first word.",
        ("tests.test_case.TestTitleCase.test_small_words_inside",),
    ),
    Mutation(
        "slug-separator",
        "textkit/case.py",
        'def slugify(text: str, separator: str = "-") -> str:',
        'def slugify(text: str, separator: str = "_") -> str:',
        "slugify() must join the words with '-' unless another separator is given.",
        ("tests.test_case.TestSlugify.test_default_separator",),
    ),
    Mutation(
        "truncate-width",
        "textkit/fit.py",
        "return text[: width - len(suffix)] + suffix",
        "return text[:width] + suffix",
        "truncate() must return at most `width` characters, the suffix included.",
        (
            "tests.test_fit.TestTruncate.test_custom_suffix",
            "tests.test_fit.TestTruncate.test_cut_to_width",
        ),
    ),
    Mutation(
        "truncate-exact",
        "textkit/fit.py",
        "if len(text) <= width:",
        "if len(text) < width:",
        "truncate() must leave a text of exactly `width` characters unchanged.",
        ("tests.test_fit.TestTruncate.test_exact_width_unchanged",),
    ),
    Mutation(
        "wrap-exact-width",
        "textkit/fit.py",
        "elif len(current) + 1 + len(word) <= width:",
        "elif len(current) + 1 + len(word) < width:",
        "wrap() must allow a line of exactly `width` characters.",
        ("tests.test_fit.TestWrap.test_line_of_exact_width",),
    ),
    Mutation(
        "count-whitespace",
        "textkit/fit.py",
        "return len(text.split())",
        'return len(text.split(" "))',
        "count_words() must treat any run of spaces, tabs or newlines as one separator.",
        (
            "tests.test_fit.TestCountWords.test_empty",
            "tests.test_fit.TestCountWords.test_runs_of_whitespace",
        ),
    ),
    Mutation(
        "palindrome-case",
        "textkit/fit.py",
        "cleaned = [ch.lower() for ch in text if ch.isalnum()]",
        "cleaned = [ch for ch in text if ch.isalnum()]",
        "is_palindrome() must ignore letter case.",
        ("tests.test_fit.TestPalindrome.test_ignores_case_and_punctuation",),
    ),
)

TEMPLATE = Template(
    "text",
    "textkit",
    {
        "textkit/__init__.py": INIT,
        "textkit/case.py": CASE,
        "textkit/fit.py": FIT,
        "tests/test_case.py": TEST_CASE,
        "tests/test_fit.py": TEST_FIT,
    },
    MUTATIONS,
)
