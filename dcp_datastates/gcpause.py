"""A pause of the cyclic garbage collector while many acyclic records are built.

Decoding a manifest, planning a save of thousands of tensors or building DCP's metadata makes
a few objects per chunk; every young-generation collection then walks the ever larger heap of
young records.  They hold no cycles, so nothing is lost by collecting once, afterwards.  Every
layer that builds such records (format, engine, planner, reader, writer) takes the same
process-wide pause from here.
"""

from __future__ import annotations

import gc
import threading

from . import process_state

# young objects at the end of a pause above which they go to the oldest generation (_GcPause)
PROMOTE_AFTER = 10_000


class _GcPause:
    """One process-wide pause of the cyclic collector, however many threads are inside it: the
    first to enter turns the collector off (if it was on) and the last to leave turns it back
    on, so that a flush thread leaving its pause does not end the planner's, and the collector
    is never left off by an interleaving of threads.  The lock is reentrant and the depth is
    counted before the collector is touched: a signal handler that saves (a preemption
    checkpoint) may enter while its own thread is inside ``__enter__`` or ``__exit__``."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._was_on = False

    def __enter__(self) -> None:
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self._was_on = gc.isenabled()
                gc.disable()

    def __exit__(self, *exc) -> None:
        with self._lock:
            was_on = self._was_on
            self._depth -= 1
            if self._depth == 0 and was_on:
                _promote_young()
                gc.enable()

    def after_fork(self) -> None:
        """In a forked child, the threads that were inside the pause are gone: end it."""
        self._lock = threading.RLock()
        if self._depth and self._was_on:
            gc.enable()
        self._depth = 0


def _promote_young() -> None:
    """At the end of a pause that made many objects, move every young one to the oldest
    generation (``gc.freeze`` then ``gc.unfreeze``), where full collections walk them, instead of
    leaving them all to the next young collection: the pause's objects are records that live
    until the save or load ends and hold no cycles, so walking them young is wasted work.  Only on the main thread, inside a save's or a load's call (its
    plans, its manifest): a pause that ends on a flush thread runs beside training, whose own
    young objects (a reference cycle holding a GPU tensor) must not wait for a full collection.
    Not where the application has frozen objects itself, whose freeze ``gc.unfreeze`` would end."""
    if (gc.get_count()[0] > PROMOTE_AFTER and gc.get_freeze_count() == 0
            and threading.current_thread() is threading.main_thread()):
        gc.freeze()
        gc.unfreeze()


# One pause for the whole process, by design: the collector is process-wide, so every thread's
# pause must be counted in one place (see _GcPause).
_GC_PAUSE = _GcPause()
process_state.in_child(_GC_PAUSE.after_fork)


def paused_gc() -> _GcPause:
    """Build many acyclic records without the cyclic collector running over them.

    Decoding a manifest or building DCP's metadata creates a few objects per chunk; each
    generation-0 collection then walks the ever larger heap of young records, which grows as the
    square of the records made (``docs/benchmarks.md`` has the figures).  The records hold no cycles, so nothing is lost by collecting once, afterwards.
    A save pauses it around its Python work only (a plan, a batch's records, the manifest),
    never around a write, since training runs beside an async save; a load, which its caller
    waits for, keeps it paused through its reads.  All threads share one pause (``_GcPause``)."""
    return _GC_PAUSE
