"""Graceful stops: SIGINT or SIGTERM ends the run after the step in progress is logged.

The first signal sets a flag the loops check once a step's log line is written; they then raise
`Interrupted`, and the run's manifest says `interrupted`. A second signal stops at once. After
SIGKILL nothing runs, but every finished step is already in the log (written and fsync'ed per step).
"""

from __future__ import annotations

import signal
from contextlib import contextmanager


class Interrupted(KeyboardInterrupt):
    """Raised by a loop at a step boundary after SIGINT/SIGTERM."""


class _Stop:
    requested: str | None = None


STOP = _Stop()


def check_stop(step: int) -> None:
    """Call after a step's log line is written."""
    if STOP.requested:
        raise Interrupted(f"{STOP.requested} after step {step}")


@contextmanager
def graceful_stop():
    def handler(signum, frame):
        if STOP.requested:  # a second signal: stop now
            raise KeyboardInterrupt(signal.Signals(signum).name)
        STOP.requested = signal.Signals(signum).name

    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave the default behaviour
            pass
    try:
        yield STOP
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        STOP.requested = None
