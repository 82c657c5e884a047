"""How many saves of this process are writing their first tier right now.

The engine counts its jobs in and out; flushes to slower tiers (``persist.py``) wait, a
bounded time, until none is writing, so that the fast tier's commit, which training waits
for, gets the disk first.  It lives in the tiers layer because both use it.
"""

from __future__ import annotations

import threading

from .. import process_state

# Process-wide on purpose: background uploads yield to every save of the process (persist.py).
_active = [0]
_active_cv = threading.Condition()


def _forget_jobs_in_child() -> None:
    """A forked child writes none of its parent's saves: its uploads wait for its own."""
    global _active_cv
    _active[0], _active_cv = 0, threading.Condition()


process_state.in_child(_forget_jobs_in_child)


def job_started() -> None:
    with _active_cv:
        _active[0] += 1


def job_ended(_fut=None) -> None:
    with _active_cv:
        _active[0] -= 1
        _active_cv.notify_all()


def wait_for_quiet(timeout: float) -> bool:
    """Wait until no save of this process is writing to its first tier, at most ``timeout``
    seconds (so a steady stream of saves still lets slower tiers progress)."""
    with _active_cv:
        return _active_cv.wait_for(lambda: _active[0] == 0, timeout)
