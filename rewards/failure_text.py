"""A reward's own text in a failure reason: an exception's message, a returned value's repr.

These reasons are logged, printed under the progress bar and stored with the sample, so the text is
escaped as slime.security.printable_excerpt escapes a remote service's (an escape code or a line
break in it can neither drive a terminal nor forge a log line), and formatting it never raises: a
`__str__` or `__repr__` that raises is named instead (it must not end the worker thread).
"""

from __future__ import annotations

from typing import Any

from slime.security import printable_excerpt

# An exception's message in a failure reason: a longer one keeps its head and tail (its cause is at
# one end or the other), as the buffer stores failures.
MAX_MESSAGE_CHARS = 4000


def exception_text(exc: BaseException) -> str:
    """The message of an exception a reward raised, fit for a failure reason and a log line: escaped
    as slime.security.printable_excerpt does (no escape codes, `\\n` for a line break), a long one cut
    in the middle. Never raises: a `__str__` that raises is named instead."""
    try:
        text = str(exc)
    except BaseException as err:
        return f"<its message could not be printed: {type_name(err)}>"
    if len(text) > MAX_MESSAGE_CHARS:
        half = MAX_MESSAGE_CHARS // 2
        return f"{_escaped(text[:half])} ...[{len(text) - 2 * half} characters cut]... {_escaped(text[-half:])}"
    return _escaped(text)


def describe_exception(exc: BaseException) -> str:
    """`Type: message` (`exception_text`), or `Type` for an exception without a message."""
    text = exception_text(exc)
    return f"{type_name(exc)}: {text}" if text else type_name(exc)


def shown(value: Any, limit: int = 80) -> str:
    """`repr(value)`, its first `limit` characters, escaped like `exception_text`; never raises."""
    try:
        text = repr(value)[:limit]
    except BaseException as exc:
        return f"<a {type_name(value)} whose repr raised {type_name(exc)}>"
    return _escaped(text)


def _escaped(text: str) -> str:
    return printable_excerpt(text, 10 * len(text))  # \U0010ffff, the longest escape, is 10 characters: none cut


def type_name(value: Any) -> str:
    try:
        return str(type(value).__name__)
    except Exception:  # a metaclass's __name__ that raises
        return "object"
