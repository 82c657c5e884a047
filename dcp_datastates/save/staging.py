"""How saves begin through one writer: one at a time (``SaveSlot``), each async save's state
dict as DCP gets it (``StagedState``, and ``ProcessHandoff`` when DCP pickles it for its
checkpoint process), and the save ids a process wrote with (``SaveIds``).  What a save's
completion state is, and how the trainer waits for it, is ``save/progress.py``."""

from __future__ import annotations

import copy
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from .. import process_state
from ..engine.live import copy_small, for_process, iter_tensors, ready_point, versions, watch_of
from ..errors import CheckpointError, SnapshotError, TornSnapshotError
from ..tiers.claim import release_idle
from .options import WriterOptions
from .progress import SAVE_THREADS, SaveSession, hold_step

log = logging.getLogger(__name__)


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

    # copying is not handing over: a copy is a plain dict (copy and deepcopy would otherwise
    # take __reduce__)
    def __copy__(self) -> dict:
        return dict(self)

    def __deepcopy__(self, memo) -> dict:
        return copy.deepcopy(dict(self), memo)


class ProcessHandoff:
    """An async save handed to DCP's checkpoint process.  Tensors that process can read in
    place (GPU memory, shared memory) are left for it to copy lazily; every other CPU tensor is
    copied here, into one shared-memory arena, at most ``room`` bytes (``for_process``).  A
    tensor changed in place between the call and its copy fails the save (the version check
    of THREAD mode).  The thread doing this is DCP's for the save: its end ends the save on
    this rank (``SaveThreads``), which releases the optimizer step at once if it failed."""

    def __init__(self, session: SaveSession, room: int, end: Callable[[SaveSession], None],
                 path: str | None) -> None:
        self.session, self.room, self.end, self.path = session, room, end, path

    def for_process(self, state: dict) -> dict:
        s = self.session
        SAVE_THREADS.watch(s, self.end)
        try:
            if s.failed:
                raise SnapshotError(f"async save failed before DCP handed it to its checkpoint process: "
                                    f"{s.error_text()}")
            _wait_ready(s.ready, state)
            moved = for_process(state, self.room, "host_cache_bytes + eager_copy_bytes")
            started = s.versions or {}
            torn = [t for t in moved.copied if (w := watch_of(started, t)) is not None and w.changed(t)]
            if torn:
                raise TornSnapshotError(
                    f"{len(torn)} tensor(s) changed in place before DCP handed the save to its checkpoint "
                    "process; the save is not committed. Call writer.wait_snapshot() (or use "
                    "SnapshotGuard) before changing the state outside an optimizer step", checkpoint=self.path)
        except BaseException as e:
            s.mark_failed(e)  # lets the optimizer step go; DCP fails the save's future
            raise
        s.ready = s.versions = None
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
        self._failed: tuple[str, ...] = ()  # directories of failed saves (``release_failed``)
        self._one_by_one = False  # in DCP's checkpoint process, where this arrives pickled

    def __setstate__(self, state: dict) -> None:
        vars(self).update(state, _one_by_one=True)

    def release_failed(self, paths: Sequence[str]) -> None:
        """Saves into ``paths`` failed (their futures raised).  DCP tells a writer nothing when
        a save fails on another rank, so its coordinator still holds the directory's claim,
        which retention leaves alone: the next save here lets it go first (``set_up``)."""
        self._failed = tuple(str(p) for p in paths)

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
            session.versions = versions(small.left, small.through)
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
        return StagedState(small.state_dict, ProcessHandoff(session, room, self.end, path))

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
        # DCP's checkpoint process runs one save at a time: there, every claim of a save that
        # no longer runs is a failed save's (on another rank most often)
        release_idle(None if self._one_by_one else self._failed)
        self._failed = ()
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
        alone = process_state.world_size() == 1
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
        return str(process_state.broadcast(mine))


SAVE_IDS = SaveIds()  # the process's (see SaveIds)
