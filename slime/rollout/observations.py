"""An env's observation as tokens within env.max_observation_tokens: longer ones keep their head
and tail around a marker that says how much of the middle went (a tool's output opens with what it
is and closes with its verdict, and a chat template's turn markers sit at both ends)."""

from __future__ import annotations

import threading
from collections.abc import Callable

OBSERVATION_CUT = "\n[...middle of {n} tokens cut...]\n"
OBSERVATION_CUT_CHARS = "\n[...middle of {n} characters cut...]\n"
# With a small budget the marker above would take most of it (33 tokens of a character tokenizer):
# past a quarter of the budget, this one says only that something was cut.
SHORT_CUT = "\n[...]\n"
# An observation longer than this many characters per kept token is cut as text first: tokenising a
# 1 MB tool output whole held the tokenizer lock (and so every episode's decoding) for seconds.
CHARS_PER_KEPT_TOKEN = 16


def encode_observation(
    text: str, limit: int, to_ids: Callable[[str], list[int]], tokenizer_lock: threading.Lock
) -> list[int]:
    """At most ``limit`` tokens of ``text`` (``to_ids`` tokenises, under ``tokenizer_lock``)."""
    side = CHARS_PER_KEPT_TOKEN * max(limit, 1)
    with tokenizer_lock:
        if len(text) > 2 * side:  # far more text than fits: its middle goes before it is tokenised
            head, tail = to_ids(text[:side]), to_ids(text[-side:])
            cut = OBSERVATION_CUT_CHARS.format(n=len(text) - 2 * side)
        else:
            head = tail = to_ids(text) if text else []
            if len(head) <= limit:
                return head
            cut = OBSERVATION_CUT.format(n=len(head))
        marker = to_ids(cut)
        if len(marker) > limit // 4:
            marker = to_ids(SHORT_CUT)
    return _head_marker_tail(head, marker, tail, limit)


def _head_marker_tail(head: list[int], marker: list[int], tail: list[int], limit: int) -> list[int]:
    """At most ``limit`` tokens: the start of ``head``, the marker, the end of ``tail``; with too
    little room for a marker, the start of ``head`` alone."""
    kept = limit - len(marker)
    if kept < 2:
        return head[:limit]
    n_tail = kept // 2
    return head[: kept - n_tail] + marker + tail[len(tail) - n_tail :]
