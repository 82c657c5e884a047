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
from collections import OrderedDict
from collections.abc import Callable
from multiprocessing.reduction import DupFd

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .engine.live import copy_small, for_process, iter_tensors, ready_point, version_at_start, versions
from .engine.snapshot import tensor_version
from .errors import CheckpointError, SnapshotError, TornSnapshotError
from .options import WriterOptions

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
            os.close(self.w)
            self.w = -1

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
            os.close(self.r)


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


class StagedState(dict):
    """The state dict ``stage`` returns.  To DCP in this process it is a plain dict; pickled, it
    is being handed to DCP's checkpoint process (PROCESS mode), and ``ProcessHandoff`` makes
    the copy that process gets, in the thread that pickles it, before it is sent."""

    def __init__(self, state, handoff: ProcessHandoff) -> None:
        super().__init__(state)
        self.handoff = handoff

    def __reduce__(self):
        return dict, (self.handoff.for_process(dict(self)),)


class ProcessHandoff:
    """An async save handed to DCP's checkpoint process.  Tensors that process can read in
    place (GPU memory, shared memory) are left for it to copy lazily; every other CPU tensor is
    copied here, into one shared-memory arena, at most ``room`` bytes (``for_process``).  A
    tensor changed in place between the call and its copy fails the save (the version check
    of THREAD mode).  The thread doing this is DCP's for the save: its end ends the save on
    this rank (``SaveThreads``), which releases the optimizer step at once if it failed."""

    def __init__(self, session: SaveSession, own: list, room: int, end: Callable[[SaveSession], None],
                 path: str | None) -> None:
        self.session, self.own, self.room, self.end, self.path = session, own, room, end, path

    def for_process(self, state: dict) -> dict:
        s = self.session
        SAVE_THREADS.watch(s, self.end)
        try:
            if s.failed:
                raise SnapshotError(f"async save failed before DCP handed it to its checkpoint process: "
                                    f"{s.error_text()}")
            _wait_ready(s.ready, state)
            moved = for_process(state, self.own, self.room, "host_cache_bytes + eager_copy_bytes")
            started = s.versions or {}
            torn = [t for t in moved.copied if version_at_start(started, t) != tensor_version(t)]
            if torn:
                raise TornSnapshotError(
                    f"{len(torn)} tensor(s) changed in place before DCP handed the save to its checkpoint "
                    "process; the save is not committed. Call writer.wait_snapshot() (or use "
                    "SnapshotGuard) before changing the state outside an optimizer step", checkpoint=self.path)
        except BaseException as e:
            s.mark_failed(e)  # lets the optimizer step go; DCP fails the save's future
            raise
        s.ready = s.versions = None
        self.own = []
        if not moved.live:
            s.mark_snapshot()  # everything is copied: training may go on before that process starts
        assert isinstance(moved.state_dict, dict), "a state dict is rebuilt as a dict"
        return moved.state_dict


def _wait_ready(ready, state) -> None:
    """Wait until the kernels queued before the call are done, so that DCP's checkpoint process
    reads GPU memory as it was at the call: on the point recorded then, or, without one, on the
    whole device."""
    if ready is not None:
        ready.synchronize()  # pyright: ignore[reportAttributeAccessIssue] (a cuda_ext Event)
        return
    for dev in {t.device for t in iter_tensors(state) if t.device.type == "cuda"}:
        torch.cuda.synchronize(dev)


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
        """``stage``: an async save's session, and the state dict DCP saves, with the small
        tensors copied (``engine/live.py``), snapshotted at once when nothing else is live.
        Whether DCP runs the save in this process or pickles it for its checkpoint process is
        learnt when it pickles the state dict (``StagedState``); ``async_mode="process"``
        only says so in advance, so that CPU tensors move into shared memory here, now."""
        session = SaveSession(lazy=True)
        process = opts.async_mode == "process"  # DCP's checkpoint process runs saves one by one
        if not process:
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
            if process:  # read in place over there, lazily: in shared memory, moved here and now
                for t in small.left:
                    if t.device.type == "cpu" and not t.is_shared():
                        t.share_memory_()
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
        self.current = session
        self._stage_pid, self._staged = os.getpid(), True
        room = (opts.host_cache_bytes or 0) + opts.eager_copy_bytes
        return StagedState(small.state_dict, ProcessHandoff(session, small.copies, room, self.end, path))

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
        """``set_up_storage_writer``: the save's calls begin (in DCP's checkpoint process, on
        the session pickled with the writer).  A THREAD-mode save staged here is watched: its
        DCP thread ending before the snapshot fails it on this rank (``SaveThreads``)."""
        self.begin_sync(path)
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
