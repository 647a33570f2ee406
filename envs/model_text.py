"""Reading a tool call the model wrote, for envs/tools.py (ToolEnv) and envs/swe.py (SweEnv).

A model's text is untrusted input, and what is wrong with it must come back to the model as an
error observation, never as an exception out of `env.step` (that fails the sample). Three things
that Python's `json` and `str` let through raise far from where they came in:

* a number of thousands of digits: `json` reads it with `int()`, whose digit limit (4300) raises a
  bare ValueError (no `.msg`, no position); `decoder` refuses one past `MAX_NUMBER_DIGITS` with
  `NumberTooLong`, whose message is meant for the model, whatever `sys.set_int_max_str_digits` says;
* nesting deeper than Python's recursion limit (`[[[[...`): `json` raises RecursionError, which is
  no ValueError; callers catch it and say so (`NESTED_TOO_DEEPLY`);
* a lone UTF-16 surrogate (JSON's `\\ud800` escape decodes to one): not text, so every later
  `.encode()` (a file's size, the sandbox's files, `ast.parse`, the tokenizer of the observation)
  raises UnicodeEncodeError; `is_text` finds one anywhere in decoded JSON, and `NOT_TEXT` says so.
"""

from __future__ import annotations

import json
from typing import Any

MAX_NUMBER_DIGITS = 1000  # far beyond any argument a tool takes; int() of more costs quadratic time
NESTED_TOO_DEEPLY = "nested too deeply"
NOT_TEXT = "not valid UTF-8 text (a lone surrogate)"


class NumberTooLong(ValueError):
    """A JSON integer past MAX_NUMBER_DIGITS digits; the message is meant for the model."""


def _parse_int(digits: str) -> int:
    count = len(digits.lstrip("-"))
    if count > MAX_NUMBER_DIGITS:
        raise NumberTooLong(f"the number is too long ({count} digits; at most {MAX_NUMBER_DIGITS})")
    return int(digits)


decoder = json.JSONDecoder(parse_int=_parse_int)


def loads(text: str) -> Any:
    """`json.loads` with the number limit: ValueError (JSONDecodeError or NumberTooLong) or
    RecursionError for text that is not a call."""
    return decoder.decode(text)


def is_text(value: Any) -> bool:
    """False when a string anywhere in `value` (decoded JSON: keys too) holds a lone surrogate."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    except (TypeError, ValueError, RecursionError):  # not JSON data: nothing here to judge
        return True
    return True
