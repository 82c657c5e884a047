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
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .engine.live import copy_small, iter_tensors, ready_point, versions
from .errors import CheckpointError, SnapshotError
from .options import WriterOptions

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
        self.ready: object = None  # a lazy THREAD save: the point its copies follow (engine/live.py)
        self.versions: dict | None = None  # and the version counters of what it copies lazily

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
            log.info("an async save ended before this rank's snapshot (it failed in DCP's planning "
                     "or on another rank); releasing the optimizer step barrier")
            session.mark_failed(CheckpointError("the save failed before this rank's snapshot "
                                                "(in DCP's planning or on another rank)"))
        end(session)


SAVE_THREADS = SaveThreads()  # the process's (see SaveThreads)

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


class WriterSessions:
    """The saves through one writer, one at a time, and how each begins.

    An async save begins in ``stage`` (:meth:`begin_async`), in the caller's thread; DCP then
    makes the save's other calls in a thread of its own (THREAD mode) or in its checkpoint
    process (PROCESS mode, where this object arrives pickled).  A synchronous save begins in
    its first call on the writer (:meth:`begin_sync`), which takes the slot; the DCP thread of
    an async save staged here does not take it again."""

    def __init__(self) -> None:
        self.slot = SaveSlot()
        self.current: SaveSession | None = None  # the save in flight, or the last one
        self._staged = False  # stage() ran, and the save's own calls have not begun yet
        self._stage_pid = os.getpid()
        self._staged_by: int | None = None  # the thread that staged it

    def begin_async(self, state_dict, opts: WriterOptions, path: str | None):
        """``stage``: an async save's session, and the state dict DCP saves: in THREAD mode
        with the small tensors copied (``engine/live.py``), snapshotted at once when nothing
        else is live."""
        if opts.async_mode == "process":  # DCP's checkpoint process runs saves one by one, on its own copy
            session = SaveSession(lazy=True, cross_process=True)
            if opts.step_barrier_s > 0:
                hold_step(session, opts.step_barrier_s)
            if opts.at_call_room() is not None:  # copied here; the daemon reads the copies
                state_dict = copy_small(state_dict, opts.eager_copy_bytes, opts.at_call_room()).state_dict
            # The daemon reads CPU tensors through shared memory: move them there now, in the
            # caller thread, so the pickler never copies live memory in the background.
            for t in iter_tensors(state_dict):
                if t.device.type == "cpu" and not t.is_shared():
                    t.share_memory_()
                elif t.device.type == "cuda":
                    torch.cuda.current_stream(t.device).synchronize()
        else:
            session = SaveSession(lazy=True)
            self._take(session, sync=False, path=path)
            try:
                if opts.step_barrier_s > 0:
                    hold_step(session, opts.step_barrier_s)
                whole = opts.at_call_room()
                small = copy_small(state_dict, opts.eager_copy_bytes, whole)
                if whole is not None and small.left:
                    log.warning("snapshot='at_call': %d tensors (%.1f MiB) did not fit the first cache "
                                "level and are copied lazily", len(small.left),
                                sum(t.nbytes for t in small.left) / 2**20)
                # copies follow the kernels queued so far (the small copies' too); a tensor left
                # live that changes in place before its bytes are copied fails the save
                # (engine/snapshot.py), never a torn checkpoint
                session.ready = ready_point(small.left + small.copies)
                session.versions = versions(small.left)
            except BaseException as e:
                session.mark_failed(e)  # lets the optimizer's step barrier go
                self.slot.give_back(session)
                raise
            if not small.live:
                session.mark_snapshot()
            self._staged_by = threading.get_ident()
            state_dict = small.state_dict
        self.current = session
        self._stage_pid, self._staged = os.getpid(), True
        return state_dict

    def begin_sync(self, path: str | None) -> None:
        """A save's first calls on the writer (``reset``, ``set_up_storage_writer``): a
        synchronous save takes the slot, waiting while another save runs through the writer.
        Not the DCP thread of the async save staged here, which took the slot in ``stage``."""
        if self._staged and (threading.get_ident() != self._staged_by or os.getpid() != self._stage_pid):
            return
        session = SaveSession(lazy=False)
        self._take(session, sync=True, path=path)
        self.current, self._staged = session, False

    def set_up(self, path: str | None) -> None:
        """``set_up_storage_writer``: the save's calls begin.  A save staged for THREAD mode
        whose calls arrive in another process is refused: its waiters could not see it end."""
        self.begin_sync(path)
        staged_elsewhere = self._staged and os.getpid() != self._stage_pid
        if staged_elsewhere and (self.current is None or not self.current.cross_process):
            raise CheckpointError(
                "this save runs in DCP's checkpoint process (async_checkpointer_type=PROCESS), but "
                "the writer was staged for THREAD mode, so wait_snapshot() could not see it finish; "
                "pass DataStatesWriter(async_mode='process') or save with "
                "dcp_datastates.async_save(...), which tells the writer", checkpoint=path)
        s = self.current
        if self._staged and s is not None and s.lazy and not s.cross_process:
            SAVE_THREADS.watch(s, self.end)
        self._staged = False

    def session(self) -> SaveSession:
        """The session of the save whose calls run now (a plain one where none began)."""
        return self.current or SaveSession(lazy=False)

    def attach(self, future) -> None:
        """The async save's DCP future: its failure wakes waiters, and its end frees the slot."""
        s = self.current
        if s is not None:
            s.future = future
            future.add_done_callback(lambda f: self.slot.give_back(s))  # over, however it ended

    def end(self, session: SaveSession | None = None) -> None:
        """The save of ``session`` (default: the current one) is over on this rank."""
        self.slot.give_back(self.current if session is None else session)

    def fail(self, e: BaseException) -> None:
        if self.current is not None:
            self.current.mark_failed(e)
        self.end()

    def _take(self, session: SaveSession, *, sync: bool, path: str | None) -> None:
        if not self.slot.take(session, sync=sync):
            raise CheckpointError(f"the previous save through this DataStatesWriter has not ended after "
                                  f"{SLOT_WAIT_S:.0f} s; wait for its future before saving again, or give "
                                  "each concurrent save its own writer", checkpoint=path)


class SaveIds:
    """The save ids this process wrote with.  Process-wide on purpose: DCP's plan cache can
    replay the plan of a save made through another writer object, and only a record shared by
    every writer of the process tells a replayed id from a fresh one.  Bounded: a replay
    repeats one of the recent plans, so the oldest ids are forgotten first."""

    KEEP = 4096

    def __init__(self) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def _add(self, save_id: str) -> bool:
        """Record ``save_id``; False when it was recorded already."""
        with self._lock:
            if save_id in self._ids:
                return False
            self._ids[save_id] = None
            while len(self._ids) > self.KEEP:
                self._ids.popitem(last=False)
            return True

    def fresh(self, planned: str, own: str, *, coordinator: bool, path: str | None) -> str:
        """The save id the coordinator planned, unless DCP's plan cache replayed an earlier
        save's plan (an id this process already wrote with): a single process then keeps its
        own (``own``); ranks of a job cannot agree on a new one without the plan, so the save
        fails before writing."""
        if self._add(planned):
            return planned
        alone = not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1
        if alone and coordinator:
            self._add(own)
            return own
        raise CheckpointError(
            f"DCP's plan cache replayed the plan of an earlier save (id {planned}) without this save's "
            "id; pass planner=DataStatesSavePlanner(enable_plan_caching=True), which carries it",
            checkpoint=path)

    @staticmethod
    def agree(mine: str) -> str:
        """Per-rank manifests (``use_collectives=False``) still name one save: rank 0's id, sent
        to the others with one broadcast on the default process group (DCP itself ends such a
        save with a barrier on it).  A single process keeps its own."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return mine
        box = [mine]
        dist.broadcast_object_list(box, src=0)
        return str(box[0])


SAVE_IDS = SaveIds()  # the process's (see SaveIds)
