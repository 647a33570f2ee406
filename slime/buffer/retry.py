"""How the buffer's clients wait out a Redis that went away: backoff, retries bounded by a
deadline (buffer.reconnect_timeout_s), and a read timeout, so that a server that accepts
connections and never answers (stopped, or behind a blackholed path) fails the job in bounded time."""

from __future__ import annotations

import time

from redis.backoff import ExponentialBackoff
from redis.retry import Retry

BACKOFF_BASE_S, BACKOFF_CAP_S = 0.02, 1.0
READ_TIMEOUT_S = 30.0  # the longest a reply may take: far beyond any script or blocking read of ours


def backoff_s(attempt: int) -> float:
    """The wait after failure ``attempt``: doubling from BACKOFF_BASE_S, capped at BACKOFF_CAP_S."""
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2**attempt)


class DeadlineRetry(Retry):
    """redis-py's Retry, but no retry starts later than ``deadline_s`` after the call's first try:
    against a server that accepts connections and never answers (stopped, or a blackholed path),
    every try waits out the read timeout, and the retry count alone allowed many minutes of that."""

    def __init__(self, backoff: ExponentialBackoff, retries: int, deadline_s: float) -> None:
        super().__init__(backoff, retries)
        self.deadline_s = deadline_s

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):
        started = time.monotonic()

        def retryable(error: Exception) -> bool:
            in_time = time.monotonic() - started < self.deadline_s
            return in_time and (is_retryable is None or is_retryable(error))

        return super().call_with_retry(do, fail, retryable, with_failure_count)


def reconnecting_retry(timeout_s: float) -> Retry:
    """Retries on a lost connection (and on LOADING while Redis replays its AOF) with exponential
    backoff capped at BACKOFF_CAP_S, as many as fit in ``timeout_s`` of waiting, and none after it."""
    retries, waited = 0, 0.0
    while waited < timeout_s:
        retries += 1
        waited += backoff_s(retries)  # redis-py waits backoff(failures) after failure 1, 2, ...
    return DeadlineRetry(ExponentialBackoff(cap=BACKOFF_CAP_S, base=BACKOFF_BASE_S), retries, timeout_s)
