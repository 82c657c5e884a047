"""``DataStatesWriter``: DCP's ``StorageWriter`` and ``AsyncStager``, as an adapter.

It turns DCP's calls into calls on the layers below and holds no policy of its own:
layout is ``format.layout``, records and the manifest are ``format.records``/``format.build``,
the copy and flush are the engine's, claims and cleanup are ``tiers.ownership``, the
incremental base is ``tiers.incremental`` and slower tiers are ``tiers.persist``.

Call order under ``dcp.save`` / ``dcp.async_save`` (DCP drives it):

0. (caller thread, async only) ``stage(state_dict)`` returns the live state dict at once:
   nothing is copied yet (the *lazy* snapshot); version counters are read now.
1. (all ranks) ``reset(checkpoint_id)`` when an id is given, then ``set_up_storage_writer``
   and ``prepare_local_plan`` (incremental base).
2. (coordinator; every rank with ``use_collectives=False``) ``prepare_global_plan`` claims the
   directory on every tier before anything is written, names one save id for all ranks.
3. (all ranks) ``write_data`` lays the rank's items out in its data files and hands them to
   the engine; its future resolves once the files are fsynced.
4. (coordinator) ``finish`` builds the manifest from the typed records of every rank and
   commits it (temp file, fsync, rename): that rename is the commit.  Then it removes what the
   replaced manifest owned and lets the claim go.  With ``use_collectives=False`` every rank
   commits its own rank manifest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import threading
import time
import uuid
from itertools import compress, count
from operator import attrgetter

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ._version import __version__
from .engine import get_engine
from .engine.device_cache import device_cache_for, prepare_device_cache
from .engine.host_cache import default_host_cache_bytes, prepare_host_cache, shared_host_cache
from .engine.live import any_gpu, copy_small, iter_tensors, ready_point, versions, want_pinned
from .errors import CheckpointError, CheckpointExistsError
from .format import BLOCK_SIZE, MANIFEST_NAME, dtype_name, encode_manifest
from .format.build import build_manifest
from .format.columnar import tail_offsets
from .format.index import ExplicitChunk, HeldColumns, IndexTensor, index_wire
from .format.limits import FormatViolation
from .format.listed import HeldRecord
from .format.manifest import Chunk, Manifest, encode_index, encode_part, paused_gc
from .format.names import data_file_stripe, part_file_name, rank_manifest_name
from .format.ranked import GatheredFiles, PartRef
from .format.records import Gathered, ItemRecord, PartRecord, RankRecord, RareRecord
from .format.rules import RuleTable
from .planner import RULES_KEY, SMALL_ITEM_BYTES, Placed, lay_out, records_for
from .session import SLOT_WAIT_S, SaveSession, SaveSlot, hold_step
from .tiers import StorageTier
from .tiers.incremental import Base, load_base
from .tiers.manifests import committed_here
from .tiers.ownership import SaveClaims
from .tiers.persist import Persistence

log = logging.getLogger(__name__)

DEFAULT_DEDUP_UNIT = 4 << 20


class DataStatesWriter(StorageWriter):
    """Save DCP checkpoints in the dcp-datastates format (options: ``docs/configuration.md``).

    Args:
        path: checkpoint directory (local path or fsspec URL), or ``checkpoint_id`` of ``dcp.save``.
        overwrite: replace a committed checkpoint at ``path`` (it stays loadable until the new
            manifest commits).  Off: saving over one raises ``CheckpointExistsError``.
        thread_count: flush threads per rank.  host_cache_bytes: the bounded staging cache of
            this process (default 2 GiB or ``DCP_DATASTATES_HOST_CACHE_BYTES``).
        device_cache_bytes: a first cache level on the GPU for async saves (0: off).
        allow_pickle: store values msgpack cannot express with pickle (the reader must opt in too).
        sync_files: fsync data files and the manifest.  storage_options: fsspec options.
        async_mode: ``"process"`` when the save runs in DCP's checkpoint process; set for you by
            ``dcp_datastates.async_save``.  Otherwise a PROCESS save fails with a clear error.
        persist_to / persist / persist_options: slower tiers this checkpoint is flushed to in the
            background, each committing on its own (``tiers/persist.py``).
        incremental_base: a committed sibling checkpoint whose unchanged bytes are referenced,
            per ``dedup_unit_bytes`` (a multiple of 1 MiB, default 4 MiB).
        o_direct: write local data files with O_DIRECT from the aligned host cache.
        step_barrier_s: optimizers' ``step()`` waits up to this for an async save's snapshot (0: off).
        eager_copy_bytes: an async save copies tensors of at most 64 KiB when it is called, up to
            this many bytes in all (0: none); the rest are copied lazily.
    """

    _synchronize_after_execute: bool = False

    def __init__(self, path: str | None = None, *, overwrite: bool = False,
                 thread_count: int = 4, host_cache_bytes: int | None = None,
                 allow_pickle: bool = False, sync_files: bool = True,
                 storage_options: dict | None = None, async_mode: str | None = None,
                 persist_to: list[str] | str | None = None, persist: bool = True,
                 persist_options: dict | None = None, o_direct: bool = True,
                 incremental_base: str | None = None, dedup_unit_bytes: int = DEFAULT_DEDUP_UNIT,
                 step_barrier_s: float = 600.0, device_cache_bytes: int = 0,
                 eager_copy_bytes: int = 64 << 20) -> None:
        super().__init__()
        _check_options(thread_count, host_cache_bytes, async_mode, dedup_unit_bytes, device_cache_bytes,
                       eager_copy_bytes)
        self.path = None if path is None else str(path)
        self.overwrite, self.thread_count, self.allow_pickle = overwrite, thread_count, allow_pickle
        self.host_cache_bytes = host_cache_bytes or default_host_cache_bytes()
        prepare_host_cache(self.host_cache_bytes)  # in the background: ready for the first save
        self.device_cache_bytes = device_cache_bytes
        if async_mode != "process":  # there, the level lives in DCP's checkpoint process
            prepare_device_cache(device_cache_bytes)
        self.sync_files, self.storage_options, self.async_mode = sync_files, storage_options, async_mode
        self.persist_to = [str(p) for p in ([persist_to] if isinstance(persist_to, str) else persist_to or [])]
        self.persist, self.persist_options, self.o_direct = persist, persist_options, o_direct
        self.incremental_base = None if incremental_base is None else str(incremental_base)
        self.dedup_unit_bytes, self.step_barrier_s = dedup_unit_bytes, step_barrier_s
        self.eager_copy_bytes = eager_copy_bytes
        self.rank, self.is_coordinator, self.use_collectives = 0, True, True
        self.save_id = uuid.uuid4().hex[:12]
        self.last_stats: dict[str, int] = {}
        self.last_timings: dict[str, float] = {}
        self._base: Base | None = None
        self._session: SaveSession | None = None
        self._staged, self._stage_pid, self._job = False, os.getpid(), None
        self._slot, self._staged_by = SaveSlot(), None  # one save at a time through this writer
        self._wrote = False  # write_data ran for the save planned at _planned_at
        self._claims: SaveClaims | None = None
        self._persistence: Persistence | None = None
        self._refs: dict[str, tuple[str, int]] = {}
        self._planned_at = 0.0
        self._rules: RuleTable | None = None
        self._part_file: dict[str, int] = {}  # format 4: this rank's metadata part, uploaded with its data

    # ------------------------------------------------------------ AsyncStager
    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict):
        """Start a lazy snapshot: copy the small tensors now (``eager_copy_bytes``), the rest
        later; return the state dict DCP saves.  Waits while a previous save through this
        writer still runs (``session.SaveSlot``).  DCP makes the staged save's calls in another
        thread (or process); a save from this thread meanwhile waits for it."""
        self._session, state_dict = _start_session(self, state_dict)
        self._stage_pid, self._staged = os.getpid(), True
        return state_dict

    def synchronize_staging(self) -> None:
        self.wait_snapshot()

    def close(self) -> None:
        """Nothing to release: the engine and cache are per process and reused."""

    def attach(self, future) -> None:
        """Let :meth:`wait_snapshot` see failures that happen before ``write_data``."""
        if self._session is not None:
            self._session.future = future
            future.add_done_callback(lambda f, s=self._session: self._slot.give_back(s))  # over, however it ended

    def wait_snapshot(self, timeout: float | None = None) -> bool:
        """Block until the current async save has copied every byte out of the live state; then
        training may mutate it.  False only on timeout; raises if the save failed."""
        s = self._session
        return True if s is None or not s.lazy else s.wait_snapshot(timeout)

    def wait_persisted(self, timeout: float | None = None) -> bool:
        """Block until the last save reached every ``persist_to`` tier (coordinator: committed
        there; other ranks: uploaded).  False on timeout; raises if the flush failed."""
        s = self._session
        return True if s is None or not self.persist_to or not self.persist else s.wait_persisted(timeout)

    def timings(self) -> dict[str, float]:
        """Seconds from the last save's call to each stage it reached (``snapshot_done_s``...)."""
        return {} if self._session is None else self._session.timings()

    # ---------------------------------------------------------- StorageWriter
    def reset(self, checkpoint_id=None) -> None:
        _begin_sync(self)
        if checkpoint_id is not None:
            self.path = str(checkpoint_id)

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        if self.path is None:
            raise CheckpointError("DataStatesWriter has no path: pass one to the constructor "
                                  "or give dcp.save a checkpoint_id")
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)
        self.use_collectives = bool(kwargs.get("use_collectives", True))
        if self._claims is not None:
            self._claims.release()  # a previous save through this writer that DCP abandoned
        self.save_id = uuid.uuid4().hex[:12]
        if not self.use_collectives:
            self.save_id = _agree_save_id(self.save_id)
        _begin_sync(self)
        if self._staged and os.getpid() != self._stage_pid and not self._session.cross_process:
            raise CheckpointError(
                "this save runs in DCP's checkpoint process (async_checkpointer_type=PROCESS), but "
                "the writer was staged for THREAD mode, so wait_snapshot() could not see it finish; "
                "pass DataStatesWriter(async_mode='process') or save with "
                "dcp_datastates.async_save(...), which tells the writer", checkpoint=self.path)
        self._staged = False
        self.tier = StorageTier(self.path, self.storage_options)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        with _failing(self):
            self.tier.makedirs()
            if not self.overwrite and self._committed_here():
                raise CheckpointExistsError(
                    "a committed checkpoint already exists here; pass overwrite=True to "
                    "DataStatesWriter to replace it, or save to a new path", checkpoint=self.path)
            self._base = load_base(self.tier, self.incremental_base, self.storage_options)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        with _failing(self):
            self._planned_at, self._wrote = time.monotonic(), False
            self._claims = SaveClaims(self.save_id, rank=None if self.use_collectives else self.rank,
                                      busy=self._busy)
            self._claims.acquire([self.tier, *self._persist_tiers()])
            if not self.overwrite and self._committed_here():
                raise CheckpointExistsError("a committed checkpoint appeared here while this save "
                                            "was planning; pass overwrite=True to replace it",
                                            checkpoint=self.path)
        if len(plans) == 1 and not self.use_collectives:
            return [dataclasses.replace(plans[0], storage_data={"rank": self.rank, "save_id": self.save_id})]
        return [dataclasses.replace(p, storage_data={"rank": i, "save_id": self.save_id})
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        with _failing(self):
            sd = plan.storage_data if isinstance(plan.storage_data, dict) else {}
            self.rank = int(sd.get("rank", self.rank))
            self.save_id = _fresh_save_id(self, sd.get("save_id", self.save_id))
            self._rules = _rules_of(planner) if self.use_collectives else None
            return self._write(plan, planner, self._session or SaveSession(lazy=False))

    def _write(self, plan: SavePlan, planner: SavePlanner, session: SaveSession) -> Future:
        self._wrote = True
        with paused_gc():  # a few records per item, none cyclic (format/model.py)
            placed, copy_items, names = lay_out(
                plan, planner, rank=self.rank, save_id=self.save_id, thread_count=self.thread_count,
                base=self._base, started=getattr(session, "versions", None) if session.lazy else None,
                allow_pickle=self.allow_pickle, checkpoint=self.path)
        fut: Future = Future()
        if not self.is_coordinator:  # this rank's part of the save is over once DCP has its results
            fut.add_done_callback(lambda f: self._slot.give_back(session))
        claims = self._claims  # this save's own: its slow tiers may commit after the next save began
        self._persistence = Persistence(self.tier, self._persist_tiers(), self.save_id, self.rank,
                                        on_done=session.mark_persisted,
                                        after_commit=self._after_commit if claims is None else claims.after_commit,
                                        on_tier_failed=self._release if claims is None else claims.release)
        if not copy_items:
            session.mark_snapshot()
            res = self._results(placed, names, [])
            self._persistence.start_uploads(dict(self._part_file), {}, waits_for_commit=self._commits_persist())
            fut.set_result(res)
            return fut
        persisting = bool(self.persist_to and self.persist)
        sinks = [self.tier.open_sink(n, o_direct=self.o_direct, drop_cache=not persisting) for n in names]
        job = self._job = _submit(self, copy_items, sinks, session)
        job.snapshotted.add_done_callback(lambda f: session.mark_snapshot() if f.exception() is None else None)

        def durable(f) -> None:
            try:
                sizes = f.result().file_sizes
                session.stamp("data_written")
                for n, sz in zip(names, sizes):
                    if sz == 0:  # every byte of this stripe was reused from the base
                        self.tier.remove(n)
                res = self._results(placed, names, sizes, f.result().timings)
                self._persistence.start_uploads({**{n: sz for n, sz in zip(names, sizes) if sz > 0},
                                                 **self._part_file}, self._refs,
                                                waits_for_commit=self._commits_persist())
                fut.set_result(res)
            except BaseException as e:  # noqa: BLE001 - delivered through DCP's future
                self._fail(e)
                fut.set_exception(CheckpointError(f"writing rank {self.rank}'s data failed: {e}",
                                                  checkpoint=self.path, file=names[0]))
            finally:
                # over: the writer keeps nothing of the job, neither the state's tensors (its
                # items) nor, through this callback, its records, which would otherwise live on
                # in a cycle until the collector's next full pass.  (Unless the next save has
                # already replaced it: DCP's future is set above.)
                if self._job is not None and self._job.durable is f:
                    self._job = None
        job.durable.add_done_callback(durable)
        if not session.lazy:
            job.durable.exception()  # synchronous dcp.save: DCP waits on the future right away
        return fut

    def _results(self, placed: list[Placed], names: list[str], sizes: list[int],
                 timings: dict | None = None) -> list[WriteResult]:
        out, self._refs, self.last_stats = _write_results(placed, names, sizes, self._base, self.rank, timings)
        self.last_timings = dict(timings or {})
        self._part_file = {}
        return [_write_part(self, placed, out)] if self._rules is not None else out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        with _failing(self):
            manifest, body = _commit_body(self, metadata, results)
            name = MANIFEST_NAME if self.use_collectives else rank_manifest_name(self.rank, self.save_id)
            self.tier.commit_bytes(name, body, sync=self.sync_files)
            if self.use_collectives:
                # DCP broadcasts this Metadata to every rank as the save's result: a run-level
                # checkpointer on another node commits the manifest on its own disk from it.
                metadata.storage_data = {"dcp_datastates.manifest": body}
            if self._persistence is not None:
                self._persistence.start_commits(manifest, body, name, collective=self.use_collectives,
                                                record_on=self.tier)
            if self._session is not None:
                self._session.mark_committed()
            log.info("committed %s (%d tensors, %d values, %.1f MiB)", self.path, len(manifest.tensors),
                     len(manifest.values), sum(manifest.files.values()) / 2**20)
            self._after_commit(self.tier, manifest)
            self._slot.give_back(self._session)

    # --------------------------------------------------------------- helpers
    def _persist_tiers(self) -> list[StorageTier]:
        return [StorageTier(u, self.persist_options) for u in self.persist_to] if self.persist else []

    def _commits_persist(self) -> bool:
        """Whether this rank's persist is over only when a slow tier commits (not at upload)."""
        return self.is_coordinator or not self.use_collectives

    def _after_commit(self, tier: StorageTier, manifest) -> None:
        if self._claims is not None:
            self._claims.after_commit(tier, manifest)

    def _release(self, url: str | None = None) -> None:
        if self._claims is not None:
            self._claims.release(url)

    def _committed_here(self) -> bool:
        return committed_here(self.tier, rank=None if self.use_collectives else self.rank)

    def _busy(self) -> bool:
        """Whether this save still runs (a claim of one DCP abandoned after planning is stale)."""
        if self._job is not None:  # its data is not durable yet
            return True
        if self._persistence is not None and self._persistence.pending():
            return True
        return not self._wrote and time.monotonic() - self._planned_at < 120.0

    def _fail(self, e: BaseException) -> None:
        if self._session is not None:
            self._session.mark_failed(e)
        self._release()
        self._slot.give_back(self._session)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # never auto-selected by DCP; users pass the writer explicitly

    def __getstate__(self):
        d = dict(self.__dict__)
        d.update(_job=None, _claims=None, _persistence=None)
        d.pop("tier", None)
        return d


def _submit(w: DataStatesWriter, copy_items: list, sinks: list, session: SaveSession):
    """Queue this rank's copies on the process's engine: through the host cache, and for an
    async save through the device cache first (``engine/device_cache.py``)."""
    sources = [i.source for i in copy_items]
    ready = getattr(session, "ready", None) if session.lazy else None
    engine = get_engine(shared_host_cache(w.host_cache_bytes, want_pinned(copy_items)), w.thread_count)
    direct = any(getattr(s, "o_direct", False) for s in sinks)
    return engine.submit(
        copy_items, sinks, copy=session.lazy or direct or any_gpu(copy_items),
        label=f"{w.path} rank {w.rank}", unit_bytes=w.dedup_unit_bytes,
        device_cache=device_cache_for(sources, w.device_cache_bytes if session.lazy else 0),
        ready_event=ready if ready is not None else ready_point(sources))


def _start_session(w: DataStatesWriter, state_dict) -> tuple[SaveSession, object]:
    """An async save's session, and the state dict it saves: in THREAD mode with the small
    tensors copied (``engine/live.py``), snapshotted at once when nothing else is live."""
    if w.async_mode == "process":  # DCP's checkpoint process runs the saves one by one, on its own copy
        session = SaveSession(lazy=True, cross_process=True)
        if w.step_barrier_s > 0:
            hold_step(session, w.step_barrier_s)
        # The daemon reads CPU tensors through shared memory: move them there now, in the
        # caller thread, so the pickler never copies live memory in the background.
        for t in iter_tensors(state_dict):
            if t.device.type == "cpu" and not t.is_shared():
                t.share_memory_()
            elif t.device.type == "cuda":
                torch.cuda.current_stream(t.device).synchronize()
        return session, state_dict
    session = SaveSession(lazy=True)
    _take_slot(w, session, sync=False)
    try:
        if w.step_barrier_s > 0:
            hold_step(session, w.step_barrier_s)
        small = copy_small(state_dict, w.eager_copy_bytes)
        # copies follow the kernels queued so far (the small copies' too); a tensor left live that
        # changes in place before its bytes are copied fails the save (engine/snapshot.py), never a
        # torn checkpoint
        session.ready = ready_point(small.left + small.copies)
        session.versions = versions(small.left)
    except BaseException as e:
        session.mark_failed(e)  # lets the optimizer's step barrier go
        w._slot.give_back(session)
        raise
    if not small.live:
        session.mark_snapshot()
    w._staged_by = threading.get_ident()
    return session, small.state_dict


def _begin_sync(w: DataStatesWriter) -> None:
    """A save's first calls on the writer (``reset``, ``set_up_storage_writer``): a synchronous
    save takes the writer's slot, waiting while another save runs through it.  Not the DCP
    thread of the async save staged on this writer, which took the slot in ``stage``."""
    if w._staged and (threading.get_ident() != w._staged_by or os.getpid() != w._stage_pid):
        return
    session = SaveSession(lazy=False)
    _take_slot(w, session, sync=True)
    w._session, w._staged = session, False


def _take_slot(w: DataStatesWriter, session: SaveSession, *, sync: bool) -> None:
    if not w._slot.take(session, sync=sync):
        raise CheckpointError(f"the previous save through this DataStatesWriter has not ended after "
                              f"{SLOT_WAIT_S:.0f} s; wait for its future before saving again, or give "
                              "each concurrent save its own writer", checkpoint=w.path)


@contextlib.contextmanager
def _failing(writer: DataStatesWriter):
    """``with _failing(writer):`` marks the save failed (its claims let go) if the block raises."""
    try:
        yield
    except BaseException as e:
        writer._fail(e)
        raise


def _write_results(placed: list[Placed], names: list[str], sizes: list[int], base: Base | None,
                   rank: int, timings: dict | None):
    """DCP's ``WriteResult``s of one rank (typed records; the first carries the rank's files),
    the base files it references (``{file: (home, size)}``) and the save's byte counts."""
    with paused_gc():  # a few records per item, none cyclic (format/model.py)
        records, refs, written = records_for(placed, names, sizes, base)
        base_files = base.manifest.files if base is not None else {}
        out = [WriteResult(index=p.item.index, size_in_bytes=_item_bytes(p), storage_data=rec)
               for p, rec in zip(placed, records)]
    if out:
        out[0].storage_data.rank = RankRecord(rank, {**written, **{f: base_files[f] for f in refs}},
                                              refs, dict(timings or {}))
    stats = {"bytes_written": sum(written.values()), "files_written": len(written),
             "bytes_reused": sum(x[3].reused_bytes for p in placed for x in p.parts) if base is not None else 0,
             "files_referenced": len(refs)}
    return out, {f: (home, base_files[f]) for f, home in refs.items()}, stats


def _item_bytes(p: Placed) -> int:
    parts = p.parts
    if len(parts) == 1:  # most items: one region
        return parts[0][3].nbytes
    return sum(x[3].nbytes for x in parts) if parts else len(p.value.data)


def _rules_of(planner: SavePlanner) -> RuleTable | None:
    """The rank's sharding rules, where its planner made them (format 4)."""
    rules = getattr(planner, "rules", None)
    return rules if isinstance(rules, RuleTable) else None


def _commit_body(w: DataStatesWriter, metadata: Metadata, results: list[list[WriteResult]]):
    """The manifest to commit and its bytes: a format 4 index where the planner gave sharding
    rules, else a version 3 manifest (of this rank alone with ``use_collectives=False``)."""
    raw = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    rules = raw.get(RULES_KEY)
    with paused_gc():
        if isinstance(rules, RuleTable) and w.use_collectives:
            return _index_for(metadata, results, w.save_id, rules, w.path)
        manifest = _manifest_for(metadata, results, w.save_id)
    if not w.use_collectives:
        manifest.ranks = [w.rank]
    return manifest, encode_manifest(manifest)


PART_INDEX = MetadataIndex("\x00dcp_datastates.part")


def _write_part(w: DataStatesWriter, placed: list[Placed], out: list[WriteResult]) -> WriteResult:
    """Format 4: commit this rank's records as its metadata part (a version 3 manifest of its
    chunks) beside its data files; the one result the coordinator gets names it."""
    grank = dist.get_rank() if dist.is_available() and dist.is_initialized() else w.rank
    rank_rec = out[0].storage_data.rank if out else None
    files = dict(rank_rec.files) if rank_rec else {}
    homes = dict(rank_rec.homes) if rank_rec else {}
    shapes, chunks, explicit = {}, [], []
    for p, wr in zip(placed, out):
        rec: ItemRecord = wr.storage_data
        fqn = wr.index.fqn
        if rec.kind in ("value", "provider-value"):  # values go to the index, as build_manifest makes them
            chunks.append((fqn, None, rec))
            continue
        td = p.item.tensor_data
        shapes[fqn] = (rec.dtype, tuple(td.size))
        offs = tuple(wr.index.offset or ())
        chunks.append((fqn, offs, rec))
        if fqn not in w._rules.rules:  # no rule: listed in the index; small plain chunks in full
            small = rec.kind == "tensor" and rec.extent.nbytes <= SMALL_ITEM_BYTES
            explicit.append((fqn, offs, tuple(rec.sizes), rec.extent if small else None))
    world = max(dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1, grank + 1)
    part = build_manifest(shapes=shapes, results=[chunks], planner_data={}, save_id=w.save_id, world_size=world,
                          torch_version=torch.__version__, writer=f"dcp-datastates {__version__}")
    part.ranks, part.files, part.homes = [grank], files, homes
    values, part.values = part.values, {}
    usage = part.usage()
    tail_at = tail_offsets(part.tensors)
    held = tuple(HeldRecord.of(fqn, w._rules.chunk_of(fqn, shapes[fqn][1], offs), rec.extent, tail_at[(fqn, offs)])
                 for fqn, offs, rec in chunks
                 if offs is not None and w._rules.replicas(fqn) > 1 and rec.kind == "tensor")
    head, tail = encode_part(part)
    body = head + tail
    name = part_file_name(grank, w.save_id)
    w.tier.commit_bytes(name, body, sync=w.sync_files)
    ref = PartRef(grank, name, len(body), len(head))
    w._part_file = {name: len(body)}
    w.last_stats["part_bytes"] = len(body)
    stripes = {f: data_file_stripe(f, grank, w.save_id) for f in files}
    own = [(s, files[f], f) for f, s in stripes.items() if s is not None]
    rare = RareRecord({f: size for f, size in files.items() if stripes[f] is None}, homes, explicit, values, usage[1])
    return WriteResult(index=PART_INDEX, size_in_bytes=len(body),
                       storage_data=PartRecord.of(grank, w.save_id, ref, usage[0], own, held, rare))


def _index_for(metadata: Metadata, results: list[list[WriteResult]], save_id: str, rules: RuleTable,
               path: str | None) -> tuple[Manifest, bytes]:
    """Format 4: the index of a save from DCP's global metadata (dtypes and sizes), the merged
    rule table and one part record per rank; it grows in tensors + ranks."""
    tensors = [IndexTensor(fqn, dtype_name(md.properties.dtype), tuple(md.size), rules.rules.get(fqn))
               for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)]
    at = {t.fqn: i for i, t in enumerate(tensors)}
    records = [wr.storage_data for rr in results for wr in rr]  # one per rank
    if not all(map(PartRecord.__instancecheck__, records)):
        raise CheckpointError("a rank wrote no metadata part although the save planner gave "
                              "sharding rules (are all ranks using DataStatesSavePlanner?)", checkpoint=path)
    try:  # every rank's packed rows at once (16,384 at scale); the few ranks with more, one by one
        g = Gathered.of(records, save_id)
    except FormatViolation as e:
        raise CheckpointError(f"the ranks' records do not make an index: {e}", checkpoint=path) from None
    which = list(compress(count(), map(attrgetter("rare"), records)))  # the few ranks with more
    rare = [records[i].rare for i in which]
    named, homes, values, explicit, shared, seen, named_held = {}, {}, {}, [], {}, set(), []
    for rank, rec in zip(g.ranks[which].tolist(), rare):
        for home, n in rec.shared.items():
            shared[home] = shared.get(home, 0) + n
        named.update(rec.files)  # files not named by rank (another save's), by name
        homes.update(rec.homes)
        values.update(rec.values)
        named_held += rec.held
        for fqn, offs, sizes, ext in rec.explicit:
            if (fqn, offs) not in seen:  # a replicated item written by several ranks: keep one
                seen.add((fqn, offs))
                explicit.append(ExplicitChunk(at[fqn], offs, sizes, rank,
                                              None if ext is None else Chunk(offs, sizes, ext)))
    files = GatheredFiles(named, g.files)
    ranks = g.ranks.tolist()
    ranks.sort()  # DCP gathers by rank: already in order, so the sort is cheap
    world = max(dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1,
                ranks[-1] + 1 if ranks else 1)
    m = Manifest(save_id=save_id, world_size=world, ranks=ranks, files=files,
                 tensors={}, values=values, planner_data=_planner_data(metadata), homes=homes, version=4,
                 created_unix=time.time(), torch_version=torch.__version__, writer=f"dcp-datastates {__version__}")
    try:
        fidx = files.positions_near(g.rows_of(which))  # the rows of the ranks with inline or named records
        held = HeldColumns.join(g.held(at, len(named)), HeldColumns.of(named_held, at, fidx))
        wire = index_wire(list(rules.meshes), tensors, explicit, files, g.files, (g.owned, shared), held, fidx)
    except FormatViolation as e:
        raise CheckpointError(f"the ranks' records do not make an index: {e}", checkpoint=path) from None
    return m, encode_index(m, wire)


def _planner_data(metadata: Metadata) -> dict:
    """DCP's flattening paths (key -> path of str and int keys); anything else is left out
    (format 4's rule table among them)."""
    raw = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    paths = {k: v for k, v in raw.items() if isinstance(v, (tuple, list))}
    if {type(k) for k in paths} <= {str} and {type(x) for v in paths.values() for x in v} <= {str, int}:
        return {k: list(v) for k, v in paths.items()}  # the usual case, checked at once
    return {k: list(v) for k, v in paths.items()
            if isinstance(k, str) and all(isinstance(x, (str, int)) for x in v)}


def _manifest_for(metadata: Metadata, results: list[list[WriteResult]], save_id: str):
    """The manifest of a save from DCP's global metadata and every rank's records."""
    shapes = {fqn: (dtype_name(md.properties.dtype), tuple(md.size))
              for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    pdata = _planner_data(metadata)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    return build_manifest(
        shapes=shapes, planner_data=pdata, save_id=save_id, world_size=world,
        torch_version=torch.__version__, writer=f"dcp-datastates {__version__}",
        results=[[(wr.index.fqn, wr.index.offset, wr.storage_data) for wr in rr] for rr in results])


def _check_options(thread_count: int, host_cache_bytes: int | None, async_mode: str | None,
                   dedup_unit_bytes: int, device_cache_bytes: int, eager_copy_bytes: int) -> None:
    if eager_copy_bytes < 0:
        raise ValueError(f"eager_copy_bytes must be 0 (off) or more, got {eager_copy_bytes}")
    if device_cache_bytes and device_cache_bytes < BLOCK_SIZE:
        raise ValueError(f"device_cache_bytes must be 0 (off) or at least {BLOCK_SIZE} (one checksum "
                         f"block), got {device_cache_bytes}")
    if thread_count < 1:
        raise ValueError(f"thread_count must be >= 1, got {thread_count}")
    if host_cache_bytes is not None and host_cache_bytes < BLOCK_SIZE:
        raise ValueError(f"host_cache_bytes must be at least {BLOCK_SIZE} (one checksum block), "
                         f"got {host_cache_bytes}")
    if async_mode not in (None, "thread", "process"):
        raise ValueError(f"async_mode must be None, 'thread' or 'process', got {async_mode!r}")
    if dedup_unit_bytes <= 0 or dedup_unit_bytes % BLOCK_SIZE:
        raise ValueError(f"dedup_unit_bytes must be a positive multiple of {BLOCK_SIZE}, "
                         f"got {dedup_unit_bytes}")


_written_ids: set[str] = set()
_written_lock = threading.Lock()


def _fresh_save_id(w: DataStatesWriter, planned: str) -> str:
    """The save id the coordinator planned, unless DCP's plan cache replayed an earlier save's
    plan (an id this process already wrote with): a single process then keeps its own; ranks
    of a job cannot agree on a new one without the plan, so the save fails before writing."""
    with _written_lock:
        if planned not in _written_ids:
            _written_ids.add(planned)
            return planned
    alone = not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1
    if alone and w.is_coordinator:
        with _written_lock:
            _written_ids.add(w.save_id)
        return w.save_id
    raise CheckpointError(
        f"DCP's plan cache replayed the plan of an earlier save (id {planned}) without this save's "
        "id; pass planner=DataStatesSavePlanner(enable_plan_caching=True), which carries it",
        checkpoint=w.path)


def _agree_save_id(mine: str) -> str:
    """Per-rank manifests (``use_collectives=False``) still name one save: rank 0's id, sent to
    the others with one broadcast on the default process group (DCP itself ends such a save
    with a barrier on it).  A single process keeps its own."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return mine
    box = [mine]
    dist.broadcast_object_list(box, src=0)
    return str(box[0])
