"""How a job stops: the first SIGINT/SIGTERM finishes the step and checkpoints, a second one stops
at once (the driver's loops in slime/train.py, the parts in slime/job.py)."""

from __future__ import annotations

import signal
import sys
import threading


class JobInterrupted(KeyboardInterrupt):
    """A second SIGINT/SIGTERM: stop at once, storing every partial trajectory on the way out."""


class GracefulStop:
    """The job's SIGINT/SIGTERM handler. The first signal asks the loop to finish its step, write a
    checkpoint and return (exit 0); a second one stops at once (JobInterrupted): partials are
    stored, no checkpoint is written, the last complete one stays the resume point."""

    def __init__(self) -> None:
        self.requested: str | None = None  # the signal's name once one arrived
        # Set while the job stops its own processes (redis-server, Ray, the dashboard): a signal then
        # must not cut that short, or they outlive the job.
        self.cleaning_up = False

    def __call__(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.cleaning_up:
            print(f"\nreceived {name}: stopping the job's processes (redis-server, Ray)", file=sys.stderr, flush=True)
            return
        if self.requested is not None:
            raise JobInterrupted(f"received {name} again: stopping now")
        self.requested = name
        print(
            f"\nreceived {name}: finishing this step, then a checkpoint and exit (send it again to stop at once)",
            file=sys.stderr,
            flush=True,
        )

    def install(self) -> dict:
        """Handle SIGINT and SIGTERM (main thread only); returns the handlers it replaced."""
        if not main_thread():
            return {}
        return {sig: signal.signal(sig, self) for sig in (signal.SIGINT, signal.SIGTERM)}


def main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()
