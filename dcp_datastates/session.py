"""Per-save completion state shared between the trainer and the saving side.

An async save has two completion levels (DataStates' ``wait(persist=False)``
and ``wait(persist=True)``):

* **snapshotted**: every byte has left the live tensors, so training may
  mutate them (the optimizer step);
* **committed**: the manifest is durable on the first tier.

In THREAD mode both sides live in one process.  In PROCESS mode the writer
(and this object with it) is pickled into DCP's checkpoint daemon, so the
flags live in a small shared-memory tensor that both processes map.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .errors import SnapshotError

log = logging.getLogger(__name__)

_SNAPSHOT, _FAILED, _COMMITTED, _PERSISTED, _PERSIST_FAILED = 0, 1, 2, 3, 4
_MSG_BYTES = 1024
STAGES = ("save_called", "snapshot_done", "data_written", "committed", "persisted")


class SaveSession:
    """One save's completion state: snapshotted, failed, committed, persisted, with the time
    each stage was reached; shared with DCP's checkpoint process in PROCESS mode."""

    def __init__(self, *, lazy: bool, cross_process: bool = False) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.lazy = lazy
        self.cross_process = cross_process
        self.flags = torch.zeros(6, dtype=torch.int64)
        self.msg = torch.zeros(_MSG_BYTES, dtype=torch.uint8)
        self.persist_msg = torch.zeros(_MSG_BYTES, dtype=torch.uint8)
        # CLOCK_MONOTONIC is system-wide on Linux, so stamps from the PROCESS-mode daemon compare
        self.stamps = torch.zeros(len(STAGES), dtype=torch.float64)
        if cross_process:
            self.flags.share_memory_()
            self.msg.share_memory_()
            self.persist_msg.share_memory_()
            self.stamps.share_memory_()
        self.stamps[0] = time.monotonic()
        self._event = threading.Event()  # snapshotted or failed (this process)
        self._persisted = threading.Event()  # persisted, or failed (this process)
        self._future = None  # the async_save future, when the caller attached it

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_event"] = d["_persisted"] = None
        d["_future"] = None
        return d

    def __setstate__(self, d):
        self.__dict__.update(d)
        self._event = threading.Event()
        self._persisted = threading.Event()

    @property
    def future(self):
        return self._future

    @future.setter
    def future(self, fut) -> None:
        """The async_save future: its failure wakes waiters too."""
        self._future = fut
        if fut is not None:
            fut.add_done_callback(lambda _f: self._event.set())

    # -- producer side ------------------------------------------------------
    def stamp(self, stage: str) -> None:
        i = STAGES.index(stage)
        if self.stamps[i] == 0:
            self.stamps[i] = time.monotonic()

    def timings(self) -> dict[str, float]:
        """Seconds from the save call to each stage reached so far."""
        t0 = float(self.stamps[0])
        return {f"{name}_s": round(float(v) - t0, 6) for name, v in zip(STAGES[1:], self.stamps[1:].tolist())
                if v}

    def mark_snapshot(self) -> None:
        self.stamp("snapshot_done")
        self.flags[_SNAPSHOT] = 1
        self._event.set()

    def mark_failed(self, exc: BaseException) -> None:
        text = f"{type(exc).__name__}: {exc}".encode()[: _MSG_BYTES - 1]
        self.msg[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
        self.flags[_FAILED] = 1
        self._event.set()
        self._persisted.set()

    def mark_persisted(self, error: BaseException | None = None) -> None:
        """This rank's part of the slow-tier flush is over (coordinator: every tier committed)."""
        if error is not None:
            text = f"{type(error).__name__}: {error}".encode()[: _MSG_BYTES - 1]
            self.persist_msg[: len(text)] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
            self.flags[_PERSIST_FAILED] = 1
        else:
            self.stamp("persisted")
        self.flags[_PERSISTED] = 1
        self._persisted.set()

    def wait_persisted(self, timeout: float | None = None) -> bool:
        """Wait until this rank's part of the flush to the slower tiers is over; False on timeout,
        raises if the save or a flush failed."""
        if not self._wait(self._persisted, lambda: bool(self.flags[_PERSISTED]) or self.failed, timeout):
            return False
        if self.failed and not self.flags[_PERSISTED]:
            raise SnapshotError(f"save failed: {self.error_text()}")
        if self.flags[_PERSIST_FAILED]:
            raw = bytes(self.persist_msg.numpy()).rstrip(b"\0").decode(errors="replace")
            raise SnapshotError(f"flush to a persistent tier failed: {raw}")
        return True

    def mark_committed(self) -> None:
        self.stamp("committed")
        self.flags[_COMMITTED] = 1

    # -- consumer side ------------------------------------------------------
    @property
    def snapshotted(self) -> bool:
        return bool(self.flags[_SNAPSHOT])

    @property
    def failed(self) -> bool:
        return bool(self.flags[_FAILED])

    def error_text(self) -> str:
        raw = bytes(self.msg.numpy()).rstrip(b"\0")
        return raw.decode(errors="replace")

    def wait_snapshot(self, timeout: float | None = None) -> bool:
        """Wait until every byte left the live state; False on timeout, raises if the save failed."""
        fut = self._future
        if not self._wait(self._event, lambda: self.snapshotted or self.failed or (
                fut is not None and fut.done()), timeout):
            return False
        if self.failed:
            raise SnapshotError(f"async save failed before its snapshot completed: {self.error_text()}")
        if not self.snapshotted and fut is not None and fut.exception() is not None:
            raise SnapshotError(f"async save failed: {fut.exception()}") from fut.exception()
        return True  # snapshotted (a completed save implies it)

    def _wait(self, event: threading.Event, done, timeout: float | None) -> bool:
        """Wait until ``done()``.  In one process the producer sets ``event``: a plain wait.  In
        PROCESS mode the producer is DCP's checkpoint daemon, which can only flip flags in the
        shared memory both map (an Event cannot be handed to an already running process), so
        the wait re-reads them at a backing-off interval of at most 10 ms."""
        if not self.cross_process:
            return event.wait(timeout) or done()
        deadline = None if timeout is None else time.monotonic() + timeout
        poll = 0.0005
        while not done():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            event.wait(poll)
            poll = min(poll * 2, 0.01)
        return True


# ------------------------------------------------------------ the step barrier
# A lazy snapshot is safe once training waits for it before its first in-place update.  For
# updates made by a torch optimizer that wait is automatic: a lazy save puts its session here
# and a global optimizer step pre-hook waits for every pending session before any step().  The
# hook stays registered once installed (torch iterates its hooks while calling them, so a hook
# cannot remove itself); with nothing pending it costs one lock.  In-place changes made outside
# an optimizer are caught by the version check instead (engine/snapshot.py).
_barrier_lock = threading.Lock()
_pending: list[tuple[SaveSession, float]] = []
_hook_installed = False


def hold_step(session: SaveSession, timeout_s: float) -> None:
    """Make every optimizer ``step()`` wait (at most ``timeout_s``) until ``session`` has
    snapshotted or failed."""
    global _hook_installed
    with _barrier_lock:
        # saves no step waited for (evaluation, say) are dropped once they are past the snapshot
        _pending[:] = [(s, t) for s, t in _pending if not (s.snapshotted or s.failed)]
        _pending.append((session, timeout_s))
        if not _hook_installed:
            register_optimizer_step_pre_hook(_before_step)
            _hook_installed = True


def _before_step(optimizer, args, kwargs) -> None:
    with _barrier_lock:
        if not _pending:
            return None
        waiting = list(_pending)
        _pending.clear()
    for session, timeout_s in waiting:
        try:
            if not session.wait_snapshot(timeout_s):
                log.warning("optimizer step went on after waiting %.0f s for an async save's snapshot; "
                            "if that save is still copying, it will fail as torn instead of committing",
                            timeout_s)
        except SnapshotError as e:  # the save reports its failure through its own future
            log.warning("an async save failed before its snapshot completed; training goes on: %s", e)
    return None


SLOT_WAIT_S = 600.0  # how long a save waits for the previous save through the same writer


class SaveSlot:
    """One save at a time through a writer.  DCP runs each async save in a thread of its own,
    and a writer's fields (path, save id, session, claims) belong to one save: a second save
    started while the first runs waits here until the first is over on this rank (committed,
    its data written, failed, or its DCP future done).  ``holder`` is the save's session.  A
    synchronous save that holds the slot is over once its own thread asks again: that thread
    has left it (DCP gave up on it between two of the writer's calls)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._holder: object | None = None
        self._thread: int | None = None  # the holder's thread, for a synchronous save

    def __reduce__(self):
        return SaveSlot, ()  # a copy in DCP's checkpoint process starts free: saves run one by one there

    def take(self, holder, *, sync: bool, timeout: float = SLOT_WAIT_S) -> bool:
        """Wait until the slot is free, then hold it for ``holder``; False on timeout."""
        me = threading.get_ident()
        with self._cv:
            if self._holder is not None and self._thread != me:
                log.info("the previous save through this writer is still running; waiting for it")
            if not self._cv.wait_for(lambda: self._holder is None or self._thread == me, timeout):
                return False
            self._holder, self._thread = holder, (me if sync else None)
            return True

    def give_back(self, holder) -> None:
        """Free the slot if ``holder`` still holds it."""
        with self._cv:
            if self._holder is holder:
                self._holder = self._thread = None
                self._cv.notify_all()
