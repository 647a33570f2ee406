"""The threads env calls run on: a hung call is written off and its slot taken by a new thread, a
call's limit counts from its start, and a hung call does not keep the process alive."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from slime.rollout.env_threads import EnvThreads

ROOT = Path(__file__).resolve().parents[1]


def test_a_written_off_call_gives_its_slot_to_the_calls_queued_behind_it() -> None:
    release = threading.Event()
    threads = EnvThreads(size=1, max_hung=2)
    try:
        hung = threads.submit(release.wait)
        queued = [threads.submit(lambda i=i: i) for i in range(3)]
        time.sleep(0.2)
        assert hung.started_at is not None and all(c.started_at is None for c in queued)  # one slot, held
        threads.write_off(hung)
        assert [c.future.result(timeout=5) for c in queued] == [0, 1, 2]
        assert all(c.started_at >= hung.started_at for c in queued) and threads.hung == 1 and not threads.starved
        release.set()
        hung.future.result(timeout=5)
        deadline = time.monotonic() + 5
        while threads.hung and time.monotonic() < deadline:
            time.sleep(0.01)
        assert threads.hung == 0 and threads.submit(lambda: "again").future.result(timeout=5) == "again"
    finally:
        release.set()
        threads.close()


def test_past_max_hung_the_pool_says_it_is_starved_and_recovers_when_a_call_returns() -> None:
    release = threading.Event()
    threads = EnvThreads(size=1, max_hung=1)
    try:
        first = threads.submit(release.wait)
        time.sleep(0.1)
        threads.write_off(first)  # a replacement thread takes the slot
        second = threads.submit(release.wait)
        time.sleep(0.1)
        threads.write_off(second)  # max_hung reached: no replacement
        waiting = threads.submit(lambda: "ran")
        time.sleep(0.2)
        assert threads.starved and waiting.started_at is None
        release.set()  # the hung calls return: a thread serves on
        assert waiting.future.result(timeout=5) == "ran"
        assert not threads.starved
    finally:
        release.set()
        threads.close()


def test_a_hung_env_call_does_not_keep_the_process_from_exiting() -> None:
    script = (
        "import time\n"
        "from slime.rollout.env_threads import EnvThreads\n"
        "threads = EnvThreads(size=2, max_hung=4)\n"
        "call = threads.submit(time.sleep, 600)\n"
        "time.sleep(0.2)\n"
        "threads.write_off(call)\n"
        "threads.close()\n"
        "print('done')\n"
    )
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip() == "done", done.stderr[-2000:]
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("size", [1, 3])
def test_close_cancels_queued_calls(size: int) -> None:
    release = threading.Event()
    threads = EnvThreads(size=size, max_hung=4)
    running = [threads.submit(release.wait) for _ in range(size)]
    queued = threads.submit(lambda: "never")
    time.sleep(0.1)
    threads.close()
    assert queued.future.cancelled()
    release.set()
    assert all(c.future.result(timeout=5) for c in running)
