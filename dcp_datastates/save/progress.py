"""Per-save completion state shared between the trainer and the saving side.

An async save has two completion levels (DataStates' ``wait(persist=False)``
and ``wait(persist=True)``):

* **snapshotted**: every byte has left the live tensors, so training may
  mutate them (the optimizer step);
* **committed**: the manifest is durable on the first tier.

In THREAD mode both sides live in one process and share the session object.  In PROCESS mode
DCP pickles the writer (and its session) into its checkpoint process; pickling is how the
session learns it crosses processes, and it then gets a pipe (``_Link``) over which the copy in
the checkpoint process reports each stage back, read by one thread in the trainer.  The trainer
wakes on those reports, and on DCP's executor thread ending (``SaveThreads``): no shared flags
to poll.
"""

from __future__ import annotations

import logging
import os
import struct
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from multiprocessing.reduction import DupFd

from torch.optim.optimizer import register_optimizer_step_pre_hook

from .. import process_state
from ..errors import CheckpointError, SnapshotError

log = logging.getLogger(__name__)

_MSG_BYTES = 1024
STAGES = ("save_called", "snapshot_done", "data_written", "committed", "persisted")
# reports over the link: a kind byte, a CLOCK_MONOTONIC stamp (system-wide on Linux, so stamps
# from the checkpoint process compare), and a text of at most _MSG_BYTES (one atomic pipe write)
_HEAD = struct.Struct("<cdH")
_SNAP, _FAIL, _STAGE, _PERSISTED, _PERSIST_FAIL, _CALLER_ENDED = b"S", b"F", b"T", b"P", b"Q", b"E"


class SaveSession:
    """One save's completion state: snapshotted, failed, committed, persisted, with the time
    each stage was reached.  Pickled into DCP's checkpoint process, the copy there reports
    every change back over a pipe (``_Link``)."""

    def __init__(self, *, lazy: bool) -> None:
        self.id = uuid.uuid4().hex[:12]
        self.lazy = lazy
        self.snapshotted = self.failed = self.committed = self.persisted = False
        self.error = self.persist_error = ""
        self.stamps = [0.0] * len(STAGES)
        self.stamps[0] = time.monotonic()
        self._event = threading.Event()  # snapshotted or failed
        self._persisted = threading.Event()  # persisted, or failed
        self._future = None  # the async_save future, when the caller attached it
        self.ready: object = None  # a lazy THREAD save: the point its copies follow (engine/live.py)
        self.versions: dict | None = None  # and the version counters of what it copies lazily
        self._out: int | None = None  # in the checkpoint process: the pipe's write end
        self._link: _Link | None = None  # in the trainer, once pickled: the pipe's reader

    @property
    def cross_process(self) -> bool:
        """Whether this save's calls run in DCP's checkpoint process (the session was pickled)."""
        return self._link is not None or self._out is not None

    def __getstate__(self):
        """Pickled for DCP's checkpoint process: the copy there gets the pipe's write end."""
        d = dict(self.__dict__)
        d.update(_event=None, _persisted=None, _future=None, _link=None, ready=None, versions=None)
        if self._link is None and self._out is None:
            self._link = _Link(self)
        d["_out"] = self._link.handoff() if self._link is not None else None
        return d

    def __setstate__(self, d):
        out = d.pop("_out")
        self.__dict__.update(d)
        self._event, self._persisted = threading.Event(), threading.Event()
        self._out = out.detach() if out is not None else None
        self._link = None

    def __del__(self):
        fd = getattr(self, "_out", None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass  # closed already

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
    def _report(self, kind: bytes, text: str = "", stamp: float = 0.0) -> None:
        """Tell the trainer (in the checkpoint process only)."""
        if self._out is None:
            return
        body = text.encode()[:_MSG_BYTES]
        try:
            os.write(self._out, _HEAD.pack(kind, stamp, len(body)) + body)
        except OSError as e:  # the trainer is gone: nobody is left to tell
            log.info("could not report a save's progress to the trainer: %s", e)

    def stamp(self, stage: str) -> None:
        i = STAGES.index(stage)
        if self.stamps[i] == 0:
            self.stamps[i] = time.monotonic()
            self._report(_STAGE, stage, self.stamps[i])

    def timings(self) -> dict[str, float]:
        """Seconds from the save call to each stage reached so far."""
        t0 = self.stamps[0]
        return {f"{name}_s": round(v - t0, 6) for name, v in zip(STAGES[1:], self.stamps[1:]) if v}

    def mark_snapshot(self) -> None:
        if self.stamps[1] == 0:
            self.stamps[1] = time.monotonic()
        self.snapshotted = True
        self._report(_SNAP, "", self.stamps[1])
        self._event.set()

    def mark_failed(self, exc: BaseException | str) -> None:
        text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        self.error = self.error or text[:_MSG_BYTES]
        self.failed = True
        self._report(_FAIL, self.error)
        self._event.set()
        self._persisted.set()

    def mark_persisted(self, error: BaseException | str | None = None) -> None:
        """This rank's part of the slow-tier flush is over (coordinator: every tier committed)."""
        if error is not None:
            self.persist_error = (error if isinstance(error, str) else f"{type(error).__name__}: {error}")[
                :_MSG_BYTES]
            self._report(_PERSIST_FAIL, self.persist_error)
        else:
            self.stamp("persisted")
            self._report(_PERSISTED)
        self.persisted = True
        self._persisted.set()

    def mark_committed(self) -> None:
        self.stamp("committed")
        self.committed = True

    # -- consumer side ------------------------------------------------------
    def error_text(self) -> str:
        return self.error

    def wait_persisted(self, timeout: float | None = None) -> bool:
        """Wait until this rank's part of the flush to the slower tiers is over; False on timeout,
        raises if the save or a flush failed."""
        if not (self._persisted.wait(timeout) or self.persisted or self.failed):
            return False
        if self.failed and not self.persisted:
            raise SnapshotError(f"save failed: {self.error_text()}")
        if self.persist_error:
            raise SnapshotError(f"flush to a persistent tier failed: {self.persist_error}")
        return True

    def wait_snapshot(self, timeout: float | None = None) -> bool:
        """Wait until every byte left the live state; False on timeout, raises if the save failed."""
        fut = self._future
        if not (self._event.wait(timeout) or self.snapshotted or self.failed or (fut is not None and fut.done())):
            return False
        if self.failed:
            raise SnapshotError(f"async save failed before its snapshot completed: {self.error_text()}")
        if not self.snapshotted and fut is not None and fut.exception() is not None:
            raise SnapshotError(f"async save failed: {fut.exception()}") from fut.exception()
        return True  # snapshotted (a completed save implies it)

    def caller_ended(self) -> None:
        """DCP's thread that handed this save to the checkpoint process has ended (the save is
        over there, however it ended).  Reports from over there that are still in the pipe are
        read first; if none said the snapshot is done, the save failed before it."""
        if self._link is not None:
            self._link.caller_ended()
        elif not (self.snapshotted or self.failed):
            self.mark_failed(CheckpointError("the save failed before this rank's snapshot "
                                             "(in DCP's planning or on another rank)"))


class _Link:
    """The trainer's end of a pickled session's pipe: one thread applies the reports of the
    session's copy in DCP's checkpoint process to the session here, waking its waiters.  The
    trainer keeps a write end too, to say in order, after every report sent before it, that
    DCP's thread for the save has ended (``caller_ended``)."""

    def __init__(self, session: SaveSession) -> None:
        self.session = session
        self.r, self.w = os.pipe()
        self._w_lock = threading.Lock()  # the trainer's write end: written once, then closed
        self._handed = False
        _LINKS.add(self)
        threading.Thread(target=self._read, name="dcp-datastates-save-link", daemon=True).start()

    def handoff(self) -> object:
        """The write end, picklable for the checkpoint process (once: a second copy could not
        be told apart from the first)."""
        if self._handed:
            log.warning("a save's session was pickled twice; the second copy cannot report back")
            return None
        self._handed = True
        return DupFd(self.w)

    def caller_ended(self) -> None:
        """Say so after every report already in the pipe, then close the trainer's write end:
        the pipe ends once the checkpoint process closes its own (or dies)."""
        with self._w_lock:
            if self.w < 0:
                return
            try:
                os.write(self.w, _HEAD.pack(_CALLER_ENDED, 0.0, 0))
            except OSError:
                pass  # the reader has finished already
            fd, self.w = self.w, -1  # forgotten first: a fork from now on closes no stale number
            os.close(fd)

    def _read(self) -> None:
        s = self.session
        try:
            while True:
                head = _read_exactly(self.r, _HEAD.size)
                if head is None:  # the checkpoint process closed its end, or died
                    if not (s.snapshotted or s.failed):
                        s.mark_failed("DCP's checkpoint process let go of the save before its snapshot")
                    elif not s.persisted:
                        s.mark_persisted("DCP's checkpoint process let go of the save before its flush "
                                         "to the persistent tiers was over")
                    break
                kind, stamp, n = _HEAD.unpack(head)
                text = (_read_exactly(self.r, n) or b"").decode(errors="replace") if n else ""
                if kind == _SNAP:
                    s.stamps[1] = s.stamps[1] or stamp
                    s.mark_snapshot()
                elif kind == _FAIL:
                    s.mark_failed(text)
                elif kind == _STAGE:
                    i = STAGES.index(text)
                    s.stamps[i] = s.stamps[i] or stamp
                    s.committed = s.committed or text == "committed"
                elif kind in (_PERSISTED, _PERSIST_FAIL):
                    s.mark_persisted(text if kind == _PERSIST_FAIL else None)
                elif kind == _CALLER_ENDED:
                    if not (s.snapshotted or s.failed):
                        s.mark_failed("the save ended in DCP's checkpoint process before this rank's "
                                      "snapshot (it failed there, or on another rank)")
                if s.failed or s.persisted:
                    break  # nothing more will come that anyone waits for
        finally:
            # forgotten before it is closed: a child forked later would close the number in
            # its copy of whatever reuses it (``_close_links_in_child``)
            fd, self.r = self.r, -1
            os.close(fd)


# A process forked from the trainer (a DataLoader worker) inherits every open pipe end; one that
# kept a link's write end open would hide the checkpoint process's end (its death mid-flush)
# from the trainer for the worker's lifetime.  The child closes its copies at once.
_LINKS: weakref.WeakSet[_Link] = weakref.WeakSet()


def _close_links_in_child() -> None:
    for link in list(_LINKS):
        for fd in (link.r, link.w):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass  # closed already
        link.r = link.w = -1
    _LINKS.clear()


process_state.in_child(_close_links_in_child)


def _read_exactly(fd: int, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


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


def _forget_sessions_in_child() -> None:
    """A forked child's optimizer never waits for its parent's snapshots, which run on threads
    it does not have (the hook stays, with nothing pending)."""
    global _barrier_lock
    _barrier_lock = threading.Lock()
    process_state.keep(list(_pending))
    _pending.clear()


process_state.in_child(_forget_sessions_in_child)


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


class SaveThreads:
    """Ends the async saves whose DCP thread ended before their snapshot.

    DCP runs each THREAD-mode async save in a thread of an executor of its own, which ends with
    the save.  When that thread ends before this rank's snapshot, the save failed somewhere this
    rank's writer never heard of: in the coordinator's planning, on another rank, in DCP
    itself.  Then the session is marked failed, which lets every optimizer step barrier go, and
    the save's slot is given back, so the next save through the writer starts at once.  One
    waiter thread per DCP thread, joining it: no polling.  (A DCP that kept one thread for
    every save would only have its last save ended here; the barrier's timeout ends the rest.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._watched: dict[threading.Thread, tuple[SaveSession, Callable[[SaveSession], None]]] = {}

    def watch(self, session: SaveSession, end: Callable[[SaveSession], None]) -> None:
        """The current thread runs ``session``'s save; ``end(session)`` once it is over."""
        thread = threading.current_thread()
        if thread is threading.main_thread():
            return
        with self._lock:
            first = thread not in self._watched
            self._watched[thread] = (session, end)
        if first:
            threading.Thread(target=self._wait, args=(thread,), name="dcp-datastates-save-end",
                             daemon=True).start()

    def _wait(self, thread: threading.Thread) -> None:
        thread.join()
        with self._lock:
            session, end = self._watched.pop(thread)
        if not (session.snapshotted or session.failed):
            log.info("an async save's DCP thread ended before this rank's snapshot was known done; "
                     "unless it is, the optimizer step barrier lets go now")
        session.caller_ended()
        end(session)


SAVE_THREADS = SaveThreads()  # the process's (see SaveThreads)
