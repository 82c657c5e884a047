"""The order in which a rank uses its replica group.

Replication (``Replicator``) and a restore's repair (``NodeRepair``) both talk over the same
gloo group.  Its operations must be issued from one thread, in each rank's program order, the
same on every rank: from two threads at once gloo could pair one rank's repair with another's
replication and end the process on a size mismatch.  ``GroupOrder`` is that order, held by
both: one thread that runs what is queued, first in first out, each over the group of the epoch
it was given (made again first where that is newer).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import TypeVar

from .group import ReplicaGroup

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class GroupOrder:
    """Runs work that uses ``group`` on one thread, in the order it is queued.  ``before(epoch)``
    runs before each piece of work (replication's sender takes the epoch there)."""

    def __init__(self, group: ReplicaGroup, before: Callable[[int | None], None]) -> None:
        self.group, self._before = group, before
        self._lock = threading.Lock()
        self.epoch = 0  # the newest epoch work was given
        self.pending = 0  # queued or running
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dcpds-replicas", daemon=True)
        self._thread.start()

    def queue(self, work: Callable[[], _T], epoch: int | None = None) -> Future:
        """Run ``work`` after what was queued before it, over the group of ``epoch``."""
        fut: Future = Future()
        with self._lock:
            self.pending += 1
            self.epoch = max(self.epoch, epoch or 0)
        self._q.put((work, fut, epoch))
        return fut

    def in_turn(self, work: Callable[[], _T], label: str, epoch: int | None = None) -> _T:
        """Run ``work`` in its turn and return what it returns, over the group of ``epoch``
        (made again first where newer).  At once where called from the order's own thread
        (nested work) or after ``close`` (nothing else uses the group)."""
        def run() -> _T:
            if epoch is not None and epoch > self.group.epoch:
                self.group.remake(epoch)
            return work()
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            return run()
        with self._lock:
            if self.pending:
                log.info("%s: waiting for %d replication(s) of this rank under way", label, self.pending)
        return self.queue(run).result()

    def note_epoch(self, epoch: int | None) -> None:
        """An epoch decided elsewhere (a restore's): no later work is given an older one."""
        with self._lock:
            self.epoch = max(self.epoch, epoch or 0)

    def state(self) -> tuple[int, bool]:
        """The newest epoch and whether nothing is queued or running, read together."""
        with self._lock:
            return self.epoch, self.pending == 0

    def close(self) -> None:
        """End after the work queued so far."""
        self._q.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._q.get()) is not None:
            work, fut, epoch = item
            error = result = None
            try:
                self._before(epoch)
                result = work()
            except BaseException as e:  # noqa: BLE001 - delivered through the future, and logged there
                error = e
            with self._lock:  # idle before the future says so: a save planned next sees it
                self.pending -= 1
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)


__all__ = ["GroupOrder"]
